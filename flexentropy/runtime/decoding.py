"""Captured decoding: a plain greedy loop over a `StaticLatentKVCache` (models built from `EntropyAttention` or any
module with the same step signature), and `warm_up`, which compiles a server's prefill and decode graphs once.

Decode steps on the cache's static phase run a compiled step (CUDA: ``torch.compile(mode="reduce-overhead")``, i.e.
CUDA graphs; CPU: plain ``torch.compile``); the eager work of each step (the cache's decisions) runs before it in
``cache.prepare``. torch and transformers are imported inside the functions where they are heavy.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flexentropy._checks import check_int

DecodeStep = Callable[[torch.Tensor, Any, torch.Tensor], torch.Tensor]
"""``(tokens [B, L] int64, cache, position_ids [B, L] int64) -> logits [B, L, V]``: one forward of a model."""


def compile_step(step: DecodeStep, *, device: torch.device | str | None = None, **options: Any) -> DecodeStep:
    """``step`` compiled for fixed-shape decoding: ``mode="reduce-overhead"`` (CUDA graphs) on CUDA, the default
    mode elsewhere, ``dynamic=False`` (the static phase's shapes never change); ``options`` override these."""
    cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    settings = {"mode": "reduce-overhead" if cuda else None, "dynamic": False, **options}
    return torch.compile(step, **settings)


def greedy_decode(step: DecodeStep, cache: Any, tokens: torch.Tensor, position: int, steps: int, *,
                  compiled: DecodeStep | None = None) -> torch.Tensor:
    """Greedy decoding after a prompt, ``steps`` tokens; returns them, int64 ``[B, steps]``.

    Args:
        step: the model's forward (`DecodeStep`), eager.
        cache: the cache the prompt was run with; a `StaticLatentKVCache` gets ``prepare(1)`` before every step, and
            its static-phase steps run ``compiled``.
        tokens: int64 ``[B, 1]`` the first token to feed (the prompt's greedy next token).
        position: that token's position (the prompt length).
        steps: tokens to generate (the first fed token is not counted).
        compiled: the compiled step (`compile_step`); None: every step eager.
    """
    check_int("greedy_decode", "steps", steps, 1)
    if tokens.dim() != 2 or tokens.shape[1] != 1:
        raise ValueError(f"greedy_decode expects tokens [B, 1], got {list(tokens.shape)}")
    prepared = getattr(cache, "prepared", None)
    positions = torch.full_like(tokens, position)
    out = []
    for _ in range(steps):
        with prepared(1) if prepared is not None else contextlib.nullcontext():
            run = compiled if compiled is not None and getattr(cache, "is_static", False) else step
            tokens = run(tokens, cache, positions)[:, -1:].argmax(dim=-1)
        out.append(tokens)
        positions = positions + 1
    return torch.cat(out, dim=1)


def warm_up(model: Any, lengths: Sequence[int] | None = None, *, config: Any = None, batch_size: int = 1,
            new_tokens: int | None = None, compile_config: Any = None) -> dict[int, float]:
    """Compile what a server will run, before its first request: the sparse prefill graphs for prompts of
    ``lengths`` tokens and the static-phase decode graph of a `StaticLatentKVCache` (its first steps run eagerly),
    through ``model.generate``.

    Run it once after ``fe.enable(model, config)`` with lengths covering the served range (two distinct lengths
    above ``config.dense_prefix`` make the prefill graphs length-generic; the decode graphs do not depend on the
    length); later prompts of any length in that range and any number of decode steps compile nothing new.

    Args:
        model: an HF causal LM switched by `flexentropy.enable`.
        lengths: prompt lengths to run (default: two lengths just above ``dense_prefix``, one not a multiple of the
            block size).
        config: the `EntropyConfig` of the served caches (default: the model's, as `enable` stored it).
        batch_size: rows of the served batches (the decode graphs are per batch size).
        new_tokens: tokens generated per warm-up prompt (default: enough to reach the static phase and one
            recompression, ``decode_delay + recompress_every + 2``).
        compile_config: transformers' ``CompileConfig`` for ``generate`` (default: the model's; off CUDA, transformers
            compiles only with one whose ``_compile_all_devices`` is set).

    Returns:
        seconds each length took, ``{length: seconds}``.
    """
    from flexentropy.caches.static_latent import StaticLatentKVCache
    from flexentropy.integrations.hf import CONFIG_ATTR, cache_keyword, parse_settings

    if config is None:
        config = parse_settings(getattr(model.config, CONFIG_ATTR, None))[0]
    if lengths is None:
        start = config.dense_prefix + config.segment_size
        lengths = (start + config.block_size, 2 * start + config.block_size // 2 + 1)
    check_int("warm_up", "batch_size", batch_size, 1)
    for length in lengths:
        check_int("warm_up", "length", length, 1)
    if new_tokens is None:
        new_tokens = config.decode_delay + (config.recompress_every or 0) + 2
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    generator = torch.Generator(device="cpu").manual_seed(0)
    extra = {} if compile_config is None else {"compile_config": compile_config}
    seconds = {}
    for length in lengths:
        ids = torch.randint(min(3, text.vocab_size - 1), text.vocab_size, (batch_size, length), generator=generator)
        cache = StaticLatentKVCache(config, model=model)
        start_time = time.perf_counter()
        # no inference_mode: its tensors would not pass the guards of the compiled graphs for generate's own calls
        model.generate(ids.to(model.device), attention_mask=torch.ones_like(ids, device=model.device),
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=0, **{cache_keyword(model): cache}, **extra)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        seconds[length] = time.perf_counter() - start_time
    return seconds
