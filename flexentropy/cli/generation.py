"""Timed greedy generation and its measurements: warm-up, prefill and per-step decode times, cache sizes.

torch and transformers are imported inside the functions, so that importing this module stays light.
"""

from __future__ import annotations

import sys
import time
from typing import Any


def cache_bytes(cache: Any) -> int:
    """Bytes of a cache's stored keys and values (``LatentKVCache.nbytes`` also counts its query window)."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)


def eos_ids(model: Any) -> set[int]:
    """The end-of-sequence token ids of ``model.generation_config`` (none, one or several)."""
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def warm_up(model: Any, prompt: Any, length: int, attention_mask: Any = None, desc: str = "warm-up") -> float:
    """One forward over the first ``length`` prompt tokens (compiles kernels, fills allocators); seconds.
    ``attention_mask`` (``[B, N]``, 0 for left padding) is cut like ``prompt``. A progress bar named ``desc``
    advances per attention layer (the first sparse layer's compile is most of a CPU warm-up).

    It writes into a throwaway `DynamicCache` so that keys and values reach the kernels in the layout a cache gives
    them (contiguous), as in the timed run: without a cache they are strided views, and the compiled kernel would
    compile again for the timed run. Only the last position's logits are computed, as ``generate`` does: all of them
    would take ``B * N * V`` values (64 GiB in bf16 for 8 rows of 16k tokens over Gemma-3's 262k vocabulary).
    """
    import torch
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from flexentropy.cli.progress import after_each_layer
    from flexentropy.integrations.hf import attention_modules, cache_keyword

    bar = tqdm(total=len(attention_modules(model)), desc=desc, unit="layer", leave=False, file=sys.stderr)
    start = time.perf_counter()
    try:
        with torch.no_grad(), after_each_layer(model, lambda: bar.update(1)):
            mask = None if attention_mask is None else attention_mask[:, :length]
            model(prompt[:, :length], attention_mask=mask,
                  **{cache_keyword(model): DynamicCache(config=model.config)}, use_cache=True, logits_to_keep=1)
    finally:
        bar.close()
    return time.perf_counter() - start


def generate_timed(model: Any, tokenizer: Any, prompt: Any, cache: Any, max_new_tokens: int, desc: str
                   ) -> tuple[list[int], float, float | None]:
    """Greedy ``model.generate`` of one prompt ``[1, N]``; returns ``(new token ids, prefill seconds, decode seconds
    per token)`` (`generate_batch_timed` with a mask of ones)."""
    rows, prefill, decode = generate_batch_timed(model, tokenizer, prompt, prompt.new_ones(prompt.shape), cache,
                                                 max_new_tokens, desc)
    return rows[0], prefill, decode


def generate_batch_timed(model: Any, tokenizer: Any, prompt: Any, attention_mask: Any, cache: Any,
                         max_new_tokens: int, desc: str) -> tuple[list[list[int]], float, float | None]:
    """Greedy ``model.generate`` of a (left-padded) batch; returns ``(new token ids of each row, prefill seconds,
    decode seconds per step)``.

    Args:
        prompt: int64 ``[B, N]``, rows left-padded to the longest. attention_mask: ``[B, N]``, 1 on real tokens,
            0 on padding.

    Each row's ids are cut after its first end-of-sequence token (``model.generation_config.eos_token_id``): HF pads a
    finished row while the others go on, and a row alone stops there, so each row gets the ids of its solo run (a
    batch of one is never cut). Times come from a streamer: the prompt is handed to it before the prefill, each
    step's tokens when they are chosen (one step for the whole batch). One progress bar advances per attention layer
    during the prefill, then per generated step.
    """
    from tqdm.auto import tqdm
    from transformers.generation.streamers import BaseStreamer

    from flexentropy.cli.progress import after_each_layer
    from flexentropy.integrations.hf import attention_modules, cache_keyword

    stamps: list[float] = []
    bar = tqdm(total=len(attention_modules(model)) + max_new_tokens, desc=f"{desc} prefill", unit="step",
               leave=False, file=sys.stderr)

    def layer_done() -> None:
        if len(stamps) < 2:  # prefill: the prompt is stamped, the first token is not yet
            bar.update(1)

    class Stamps(BaseStreamer):
        def put(self, value: Any) -> None:
            stamps.append(time.perf_counter())
            if len(stamps) == 2:
                bar.set_description(f"{desc} decode")
            if len(stamps) > 1:
                bar.update(1)

        def end(self) -> None:
            pass

    try:
        with after_each_layer(model, layer_done):
            out = model.generate(prompt, attention_mask=attention_mask, **{cache_keyword(model): cache},
                                 max_new_tokens=max_new_tokens, do_sample=False, streamer=Stamps(),
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    finally:
        bar.close()
    eos = eos_ids(model)
    rows = []
    for row in out[:, prompt.shape[1]:].tolist():
        ends = [i for i, token in enumerate(row) if token in eos]
        rows.append(row[:ends[0] + 1] if ends and len(out) > 1 else row)
    prefill = stamps[1] - stamps[0]
    decode = (stamps[-1] - stamps[1]) / (len(stamps) - 2) if len(stamps) > 2 else None
    return rows, prefill, decode
