"""Which query tokens of a vLLM step run flexentropy's sparse prefill, and vLLM's metadata for the others.

Decided on the host from the step's host-side lengths (no wait on the device), once per step, by the metadata
builder: a request's query tokens are a *long prompt chunk* when there are more of them than a decode step holds
(``1 + num_speculative_tokens``) and the engine's prefill policy does not run it dense at the request's key length
at the chunk's end (`PrefillPolicy.runs_dense` with no layer given: more keys than ``dense_prefix``). The other
requests (decode rows, short prompts, chunks inside the dense prefix) form a sub-batch that vLLM's own builder and
kernel run as before. No vLLM import: the step's ``CommonAttentionMetadata`` is handled as a dataclass, field by
field, by name, so that fields one vLLM version has and another lacks are carried or left alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flexentropy.policies.base import PrefillPolicy


@dataclass(frozen=True)
class Chunk:
    """One request's long prompt chunk in a step.

    Attributes:
        request: the request's row in the step's batch (its block-table row).
        start, end: the chunk's query tokens are rows ``start:end`` of the step's token rows.
        q_start: the position of the chunk's first token: the request's tokens already in the cache.
    """

    request: int
    start: int
    end: int
    q_start: int

    @property
    def key_length(self) -> int:
        """Keys the chunk's queries see: positions ``0 .. q_start + (end - start) - 1``."""
        return self.q_start + self.end - self.start


@dataclass(frozen=True)
class Routing:
    """A step split between the sparse prefill and vLLM's own kernel.

    Attributes:
        chunks: the long prompt chunks, in batch order.
        parent_requests: int64 CPU ``[R]``: the other requests (vLLM's own kernel runs them), in batch order.
        dense_prompt_chunks: how many of those hold a prompt chunk (more query tokens than a decode step).
    """

    chunks: tuple[Chunk, ...]
    parent_requests: torch.Tensor
    dense_prompt_chunks: int


def route(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, policy: PrefillPolicy,
          decode_query_len: int) -> Routing:
    """Split a step's requests (see the module docstring).

    Args:
        query_start_loc: int CPU ``[R + 1]``: request ``r``'s query tokens are rows
            ``query_start_loc[r]:query_start_loc[r + 1]``.
        seq_lens: int CPU ``[R]``: each request's key length at the end of the step (exact for prompt rows).
        policy: the engine's prefill policy: a prompt chunk goes to it unless it runs dense at the chunk's key length
            in every layer (`PrefillPolicy.runs_dense` with no layer given: ``dense_prefix``, a dense rule).
        decode_query_len: the most query tokens a decode row holds (1, or 1 + speculative tokens).
    """
    starts = query_start_loc.to(torch.int64)
    query_lens = starts[1:] - starts[:-1]
    prompt = query_lens > decode_query_len
    sparse = prompt & ~policy.runs_dense(None, seq_lens.to(torch.int64))
    rows = sparse.nonzero().flatten().tolist()
    chunks = tuple(Chunk(r, int(starts[r]), int(starts[r + 1]), int(seq_lens[r] - query_lens[r])) for r in rows)
    return Routing(chunks, (~sparse).nonzero().flatten(), int((prompt & ~sparse).sum()))


UNSUPPORTED_FIELDS = {
    "mm_req_doc_ranges": "bidirectional multimodal ranges",
    "rswa_prefix_lens": "reference sliding-window attention",
    "encoder_seq_lens": "cross-attention",
    "dcp_local_seq_lens": "decode context parallelism",
}
"""Fields of vLLM's ``CommonAttentionMetadata`` that change the attention function of a step (when set)."""

REQUEST_FIELDS = ("seq_lens", "seq_lens_cpu_upper_bound", "block_table_tensor", "is_prefilling", "req_idx",
                  "replayssm_decode_base_cpu")
"""Per-request fields (first dim = requests) carried into a sub-batch."""

TOKEN_FIELDS = ("slot_mapping", "positions")
"""Per-token fields (first dim = query tokens) carried into a sub-batch."""

CACHE_FIELDS = ("_seq_lens_cpu", "_num_computed_tokens_cpu", "_num_computed_tokens_cache",
                "_token_to_req_indices_cache")
"""Values the metadata derives from its other fields on first use: reset in a sub-batch."""


def unsupported_step(metadata: Any) -> str | None:
    """Why a step cannot run sparse (its attention is not plain causal self-attention, or its host-side lengths are
    missing), or None."""
    if getattr(metadata, "seq_lens_cpu_upper_bound", None) is None:
        return "steps without a host copy of the sequence lengths (reading them would wait on the device)"
    if metadata.causal is not True:
        return "non-causal attention"
    return next((what for name, what in UNSUPPORTED_FIELDS.items() if getattr(metadata, name, None) is not None),
                None)


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` (CPU) on ``device`` without the host waiting (pinned, asynchronous copy on CUDA)."""
    if device.type == "cpu":
        return values
    return values.pin_memory().to(device, non_blocking=True)


def _take(value: Any, index: torch.Tensor, on_device: torch.Tensor) -> Any:
    """Rows ``index`` of a tensor (``on_device``: the same index on the tensor's device) or an array."""
    if isinstance(value, torch.Tensor):
        return value[index if value.device.type == "cpu" else on_device]
    if isinstance(value, np.ndarray):
        return value[index.numpy()]
    return value


def parent_metadata(metadata: Any, routing: Routing) -> tuple[Any, slice | torch.Tensor] | None:
    """vLLM's ``CommonAttentionMetadata`` of the requests ``routing`` leaves to vLLM's kernel (the parent backend's),
    and their query rows in the step (a slice when they lead the step, else an int64 index on the step's device);
    None without any."""
    requests = routing.parent_requests
    if requests.numel() == 0:
        return None
    starts = metadata.query_start_loc_cpu[: metadata.num_reqs + 1].to(torch.int64)
    query_lens = starts[1:] - starts[:-1]
    kept = torch.zeros_like(query_lens, dtype=torch.bool).index_fill_(0, requests, True)
    tokens = torch.arange(int(starts[-1]))[kept.repeat_interleave(query_lens)]
    sub_lens = query_lens[requests]
    sub_starts = torch.cat([sub_lens.new_zeros(1), sub_lens.cumsum(0)]).to(metadata.query_start_loc_cpu.dtype)
    device = metadata.query_start_loc.device
    on_device = to_device(requests, device)
    tokens_on_device = to_device(tokens, device)
    names = {f.name for f in dataclasses.fields(metadata)}
    changes: dict[str, Any] = {
        "query_start_loc": to_device(sub_starts, device),
        "query_start_loc_cpu": sub_starts,
        "num_reqs": requests.numel(),
        "num_actual_tokens": tokens.numel(),
        "max_query_len": int(sub_lens.max()),
        "max_seq_len": int(metadata.seq_lens_cpu_upper_bound[requests].max()),
    }
    changes.update({name: _take(getattr(metadata, name), requests, on_device)
                    for name in REQUEST_FIELDS if name in names})
    changes.update({name: _take(getattr(metadata, name), tokens, tokens_on_device)
                    for name in TOKEN_FIELDS if name in names})
    changes.update({name: None for name in CACHE_FIELDS if name in names})
    leading = tokens.numel() == 0 or int(tokens[-1]) == tokens.numel() - 1
    return dataclasses.replace(metadata, **changes), slice(0, tokens.numel()) if leading else tokens_on_device
