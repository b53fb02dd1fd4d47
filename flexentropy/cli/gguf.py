"""Tokenizers of GGUF models: :func:`load_tokenizer`, transformers' tokenizer repaired for SentencePiece-BPE GGUFs.

transformers (5.17) builds the tokenizer of a Gemma GGUF (``tokenizer.ggml.model == "llama"``: SentencePiece) as a
*Unigram* model scored by ``tokenizer.ggml.scores``. Gemma's SentencePiece model is BPE, though, and those scores are
its merge priorities (minus the rank), so Unigram over-segments: ``"Hello world"`` becomes ``Hello|▁w|or|ld`` instead
of ``Hello|▁world``. It also ignores ``tokenizer.ggml.add_bos_token``, so no ``<bos>`` is prepended, and the model
answers garbled text. :func:`repair_sentencepiece_bpe` rebuilds the BPE model: merges ranked by the merged piece's
score, byte fallback, the pure-space runs merged first, the other user-defined pieces (newline runs, HTML tags) and the
control tokens (``<start_of_turn>``) matched whole. On Gemma-3 it encoded the Paul Graham essays token for token as
Gemma's own ``tokenizer.json`` does, in a one-off check outside this repository (transformers alone: 1.8x as many
tokens, ``docs/results/gemma3_cpu/tokenizer_counts.json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
"""``tokenizer.ggml.token_type`` values (llama.cpp's ``LLAMA_TOKEN_TYPE_*``)."""


def load_tokenizer(folder: str | Path, gguf_file: str | None = None) -> Any:
    """``AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)``, repaired when transformers built a Unigram
    model for a ``"llama"`` (SentencePiece) GGUF; other tokenizers (a Llama GGUF already built as BPE, a folder, a
    fixed transformers) are returned untouched."""
    from gguf import GGUFReader
    from tokenizers.models import Unigram
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    if gguf_file is None or not isinstance(tokenizer.backend_tokenizer.model, Unigram):
        return tokenizer
    fields = {k: f.contents() for k, f in GGUFReader(Path(folder) / gguf_file).fields.items() if k.startswith("tok")}
    return repair_sentencepiece_bpe(tokenizer, fields) if fields.get("tokenizer.ggml.model") == "llama" else tokenizer


def repair_sentencepiece_bpe(tokenizer: Any, fields: dict[str, Any]) -> Any:
    """Give ``tokenizer`` (in place) the BPE model of a SentencePiece GGUF's ``tokenizer.ggml.*`` ``fields`` (values
    as ``ReaderField.contents()`` gives them) and its ``add_bos_token``/``add_eos_token``; returns it."""
    from tokenizers import AddedToken
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import generate_merges

    # the GGUF writes the pure-space pieces with spaces, SentencePiece with U+2581 (as the normalizer does)
    tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in fields["tokenizer.ggml.tokens"]]
    vocab, types = {t: i for i, t in enumerate(tokens)}, fields["tokenizer.ggml.token_type"]
    spaces = [ty == USER_DEFINED and not t.strip("\u2581") for t, ty in zip(tokens, types, strict=True)]
    # merge priority: the merged piece's score; the space runs score -1000 in the GGUF, 0 (first) in SentencePiece
    scores = zip(tokens, fields["tokenizer.ggml.scores"], types, spaces, strict=True)
    mergeable = [(t, 0.0 if space else s) for t, s, ty, space in scores if ty == NORMAL or space]
    unk = tokens[fields["tokenizer.ggml.unknown_token_id"]]
    backend = tokenizer.backend_tokenizer
    backend.model = BPE(vocab, generate_merges(vocab, mergeable), unk_token=unk, fuse_unk=True, byte_fallback=True)
    # matched whole before BPE, which cannot reach them: the control tokens (<start_of_turn>), the other user-defined
    whole = [(t, ty) for t, ty, space in zip(tokens, types, spaces, strict=True) if ty in (CONTROL, USER_DEFINED)
             and not space]
    backend.add_tokens([AddedToken(t, normalized=False, special=ty == CONTROL) for t, ty in whole])
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in fields:
            setattr(tokenizer, flag, bool(fields[f"tokenizer.ggml.{flag}"]))
    return tokenizer
