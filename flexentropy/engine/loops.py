"""Greedy decoding loops over a `StaticLatentKVCache` (`greedy_generate` for HF causal LMs, on the model's
`flexentropy.engine.driver.StepDriver`, as ``generate``; `greedy_decode` for models of `EntropyAttention`
layers or any module with the same step signature), and `warm_up`, which compiles and records a server's prefill
and decode steps once. torch and transformers are imported inside the functions where they are heavy.
"""

from __future__ import annotations

import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from flexentropy._checks import check_int
from flexentropy.settings import model_settings

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
        cache: the cache the prompt was run with; a `StaticLatentKVCache` gets ``prepare(1)`` before every step (the
            modules have no hook that would), and its static steps run ``compiled``.
        tokens: int64 ``[B, 1]`` the first token to feed (the prompt's greedy next token).
        position: that token's position (the prompt length).
        steps: tokens to generate (the first fed token is not counted).
        compiled: the compiled step (`compile_step`); None: every step eager.
    """
    check_int("greedy_decode", "steps", steps, 1)
    if tokens.dim() != 2 or tokens.shape[1] != 1:
        raise ValueError(f"greedy_decode expects tokens [B, 1], got {list(tokens.shape)}")
    static = hasattr(cache, "prepare")
    positions = torch.full_like(tokens, position)
    out = []
    for _ in range(steps):
        if static:
            cache.prepare(1)
        run = compiled if compiled is not None and getattr(cache, "stage", None) is not None else step
        tokens = run(tokens, cache, positions)[:, -1:].argmax(dim=-1)
        out.append(tokens)
        positions = positions + 1
    return torch.cat(out, dim=1)


def decode_settings(model: Any, device: torch.device, compile_config: Any, compiled: bool | None
                    ) -> tuple[Any, bool]:
    """``(compile_config, compiled)`` of a decoding loop, as ``generate`` chooses them: the model's
    ``CompileConfig`` when none is given; compiled on CUDA, or anywhere with a config whose
    ``_compile_all_devices`` is set, unless ``compiled`` says otherwise."""
    if compile_config is None:
        compile_config = getattr(model.generation_config, "compile_config", None)
    if compiled is None:
        compiled = device.type == "cuda" or bool(getattr(compile_config, "_compile_all_devices", False))
    return compile_config, compiled


def served_config(model: Any, cache: Any) -> Any:
    """The `EntropyConfig` a loop serves with: ``cache``'s, else the model's `Settings`' (`flexentropy.enable`'s)."""
    return cache.config if cache is not None else model_settings(model).config


def greedy_generate(model: Any, input_ids: torch.Tensor, cache: Any, max_new_tokens: int, *,
                    attention_mask: torch.Tensor | None = None, compile_config: Any = None,
                    compiled: bool | None = None) -> torch.Tensor:
    """Greedy decoding of an HF causal LM in a plain loop: what ``model.generate(..., do_sample=False)`` returns
    after the prompt, without its per-step host work and synchronisation (its stopping checks), so that the next
    step's launch overlaps the current step on the GPU. No stopping token: exactly ``max_new_tokens`` tokens.

    The decode steps of a `StaticLatentKVCache` run the model's `StepDriver` (the one ``generate`` runs through
    ``model.get_compiled_call``: one warm-up serves both); those of transformers' ``StaticCache`` its compiled call.

    Args:
        model: an HF causal LM (switched by `flexentropy.enable` or not).
        input_ids: int64 ``[B, N]`` the prompt.
        cache: a `StaticLatentKVCache` (left-padded batches allowed: it reads the padding from the prompt) or
            transformers' ``StaticCache`` (the dense baseline; no padding).
        max_new_tokens: tokens to generate, the prompt's greedy next token included.
        attention_mask: ``[B, N]`` of the prompt (1 real, 0 left padding); None: no padding.
        compile_config: transformers' ``CompileConfig`` of the decode steps (default: the model's).
        compiled: run the decode steps compiled; None: as ``generate`` does, on CUDA, or anywhere with a
            ``compile_config`` whose ``_compile_all_devices`` is set.

    Returns:
        int64 ``[B, max_new_tokens]``.
    """
    from transformers import StaticCache

    from flexentropy.caches.keywords import cache_keyword
    from flexentropy.caches.static_latent import StaticLatentKVCache
    from flexentropy.engine.driver import step_driver

    check_int("greedy_generate", "max_new_tokens", max_new_tokens, 1)
    if input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"greedy_generate expects input_ids int64 [B, N], got {input_ids.dtype} "
                         f"{list(input_ids.shape)}")
    if not isinstance(cache, StaticLatentKVCache | StaticCache):
        raise TypeError(f"greedy_generate decodes over a StaticLatentKVCache or transformers' StaticCache, got "
                        f"{type(cache).__name__}; use model.generate for other caches")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {list(attention_mask.shape)} must match input_ids "
                             f"{list(input_ids.shape)}")
        real = attention_mask.bool()
        left = torch.arange(real.shape[1], device=real.device) >= (~real).sum(-1, keepdim=True)
        if not bool(real.any(-1).all()) or not torch.equal(left, real):
            raise ValueError("greedy_generate reads left padding only: each row of attention_mask must be 0s, then "
                             "1s to its end, with at least one 1 (pad on the left, as generate does)")
        if not isinstance(cache, StaticLatentKVCache) and not bool(real.all()):
            raise ValueError("greedy_generate runs a padded batch only over a StaticLatentKVCache (its decode "
                             "steps need no mask); a StaticCache batch must not be padded")
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    else:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    compile_config, compiled = decode_settings(model, input_ids.device, compile_config, compiled)
    keyword = {cache_keyword(model): cache}
    if isinstance(cache, StaticLatentKVCache):
        driver = step_driver(model, compile_config, input_ids.device, compiled=compiled)

        def call(tokens: torch.Tensor, position: torch.Tensor) -> Any:
            return driver(tokens, position, cache)
    else:
        compiled_call = model.get_compiled_call(compile_config) if compiled else model.__call__

        def call(tokens: torch.Tensor, position: torch.Tensor) -> Any:
            return compiled_call(input_ids=tokens, position_ids=position, **keyword, use_cache=True,
                                 logits_to_keep=1)
    with torch.no_grad():   # as generate: inference tensors would fail the compiled graphs' guards
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, **keyword,
                       use_cache=True, logits_to_keep=1).logits
        tokens = logits[:, -1:].argmax(dim=-1)
        position = positions[:, -1:] + 1
        out = [tokens]
        for _ in range(max_new_tokens - 1):
            tokens = call(tokens, position).logits[:, -1:].argmax(dim=-1)
            position = position + 1
            out.append(tokens)
    return torch.cat(out, dim=1)


def generate_batch(model: Any, prompts: Sequence[torch.Tensor], max_new_tokens: int, *, rows: int = 8,
                   config: Any = None, cache: Any = None, eos_token_id: int | None = None, compile_config: Any = None,
                   compiled: bool | None = None) -> list[torch.Tensor]:
    """Greedy decoding of many prompts, up to ``rows`` at a time in one batched step.

    Each prompt is prefilled on its own (the model's sparse prefill, batch 1) into a one-row `LatentKVCache` whose
    first eviction ends the prompt's forward, layer by layer (``decode_delay=0``, whatever ``config`` says: a
    prompt's full KV is held for one layer at a time), then put in a free row of one batched `StaticLatentKVCache`
    (`StaticLatentKVCache.insert`). All rows decode together, each at its own position and on its own count of
    entries (its recompressions are its own), through the model's `StepDriver` (on CUDA, one recorded step for all
    rows). A row ends at ``eos_token_id`` (kept) or after ``max_new_tokens`` tokens and takes the next waiting
    prompt. Each prompt gets the tokens of its run alone through `greedy_generate` with the same config.

    The host learns which rows ended after each step (one synchronisation per step, for all rows); the tokens stay
    on the device until their row ends.

    Args:
        model: an HF causal LM switched by `flexentropy.enable`.
        prompts: int64 token ids, ``[N_i]`` each (any lengths).
        max_new_tokens: most tokens per prompt, its prompt's greedy next token included.
        rows: batch rows decoded together: the batch size of the one recorded step, whatever the number of prompts
            (rows without a prompt idle through it), so that a warm-up with a few prompts records the step that
            serves many.
        config: the `EntropyConfig` of the caches (default: the model's, as `enable` stored it); its
            ``decode_delay`` is taken as 0.
        cache: the batched `StaticLatentKVCache` to serve with (default: a new one); reusing one keeps its buffers
            and recorded step across calls.
        eos_token_id: a row's stop token, or None.
        compile_config, compiled: as for `greedy_generate`.

    Returns:
        int64 ``[T_i]`` per prompt, in the order of ``prompts``.
    """
    from flexentropy.caches.keywords import cache_keyword
    from flexentropy.caches.latent_kv import LatentKVCache
    from flexentropy.caches.static_latent import StaticLatentKVCache
    from flexentropy.engine.driver import step_driver

    check_int("generate_batch", "max_new_tokens", max_new_tokens, 1)
    check_int("generate_batch", "rows", rows, 1)
    for index, ids in enumerate(prompts):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.long or ids.numel() == 0:
            got = f"{ids.dtype} {list(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"generate_batch expects each prompt as int64 token ids [N >= 1]; prompt {index} is {got}")
    if cache is not None and not isinstance(cache, StaticLatentKVCache):
        raise TypeError(f"generate_batch serves with a StaticLatentKVCache, got {type(cache).__name__}")
    config = served_config(model, cache) if config is None else config
    config = config.replace(decode_delay=0)
    cache = StaticLatentKVCache(config, model=model) if cache is None else cache
    if cache.config.decode_delay != 0 or cache.config != config:
        raise ValueError("generate_batch: the cache's EntropyConfig must be the one it serves with, decode_delay=0")
    device = model.device
    compile_config, compiled = decode_settings(model, device, compile_config, compiled)
    driver = step_driver(model, compile_config, device, compiled=compiled)
    single, keyword = LatentKVCache(config, model=model), cache_keyword(model)
    waiting = deque(enumerate(prompts))
    outputs: list[torch.Tensor | None] = [None] * len(prompts)
    owner = [-1] * rows                                   # the prompt each row decodes (-1: idle)
    tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
    positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
    generated = torch.zeros(rows, max_new_tokens, dtype=torch.long, device=device)
    counts = torch.zeros(rows, dtype=torch.long, device=device)
    busy = torch.zeros(rows, dtype=torch.bool, device=device)
    opened = False

    def admit(row: int) -> None:
        """Prefill waiting prompts until one needs decoding, and put it in ``row`` (else the row idles)."""
        nonlocal opened
        while waiting:
            index, ids = waiting.popleft()
            single.reset()
            logits = model(input_ids=ids.to(device)[None], **{keyword: single}, use_cache=True,
                           logits_to_keep=1).logits
            first = logits[:, -1:].argmax(dim=-1)
            if max_new_tokens == 1 or int(first) == eos_token_id:
                outputs[index] = first.view(1).cpu()
                continue
            if not opened:
                cache.open(rows, single)
                opened = True
            cache.insert(row, single)
            tokens[row] = first[0]
            positions[row] = ids.numel()
            generated[row, 0] = first[0, 0]
            counts[row], busy[row], owner[row] = 1, True, index
            return
        busy[row], owner[row] = False, -1
        if opened:
            cache.free(row)

    with torch.no_grad():   # as generate: inference tensors would fail the compiled graphs' guards
        for row in range(rows):
            admit(row)
        while any(index >= 0 for index in owner):
            tokens = driver(tokens, positions, cache).logits[:, -1:].argmax(dim=-1)
            positions = positions + 1
            generated.scatter_(1, counts.clamp(max=max_new_tokens - 1)[:, None], tokens)
            counts += 1
            ended = busy & ((counts >= max_new_tokens) | (tokens[:, 0] == (-1 if eos_token_id is None
                                                                            else eos_token_id)))
            for row in ended.nonzero().flatten().tolist():   # the step's one wait on the device
                outputs[owner[row]] = generated[row, :int(counts[row])].to("cpu", copy=True)
                admit(row)
    return outputs


def load_artifacts(path: Path) -> None:
    """Load the compiled artifacts at ``path`` into torch's caches when the file exists (`warm_up`); raise before
    any work where ``path`` cannot be written after it, warn where the file is not torch's."""
    if path.is_dir():
        raise ValueError(f"warm_up(artifacts=...) names a file to read and write, got the folder {path}")
    if not path.parent.is_dir():
        raise ValueError(f"warm_up(artifacts=...): the folder {path.parent} does not exist (the file is written "
                         f"there after the warm-up)")
    if not path.is_file():
        return
    try:
        loaded = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as err:  # noqa: BLE001 - torch raises several kinds for a file that is not its own
        loaded, reason = None, f" ({type(err).__name__}: {err})"
    else:
        reason = ""
    if loaded is None:
        warnings.warn(f"warm_up: could not load the compiled artifacts in {path}{reason}; compiling, and writing "
                      f"the file anew", stacklevel=3)


def warm_up(model: Any, lengths: Sequence[int] | None = None, *, config: Any = None, batch_size: int = 1,
            new_tokens: int | None = None, compile_config: Any = None, loop: bool = False,
            cache: Any = None, artifacts: str | os.PathLike[str] | None = None) -> dict[int, float]:
    """Compile what a server will run, before its first request: the sparse prefill graphs for prompts of
    ``lengths`` tokens and the static decode steps of a `StaticLatentKVCache` (the static phase's, and with a
    ``max_prompt_length`` the captured phase 1's), compiled and, on CUDA, recorded on the serving cache's buffers,
    through ``model.generate`` or, with ``loop=True``, through `greedy_generate` (both run the model's `StepDriver`
    for the same ``compile_config``: either warms both).

    Run it once after ``fe.enable(model, config)`` with lengths covering the served range (two distinct lengths
    above ``config.dense_prefix`` make the prefill graphs length-generic; the decode graphs do not depend on the
    length); later prompts of any length in that range and any number of decode steps compile nothing new. Pass the
    ``cache`` that will serve (reset after each warm-up prompt, and left empty): its buffers are then the ones the
    decode step was recorded with (CUDA graphs), so serving with it and ``cache.reset()`` between requests records
    nothing new.

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
        loop: run `greedy_generate` instead of ``generate``.
        cache: the `StaticLatentKVCache` that will serve (default: a new one for all lengths, dropped after the
            warm-up).
        artifacts: a file of compiled artifacts (``torch.compiler.save_cache_artifacts``): loaded before the warm-up
            if it exists, written after it, so that a new process, on this machine or another with the same torch and
            device, takes inductor's compiled kernels from it instead of compiling them again (dynamo still traces in
            every process; docs/performance.md). None: only torch's own caches (``TORCHINDUCTOR_CACHE_DIR``). A file
            torch cannot read is reported (a warning) and written anew; a folder, or a path in a missing folder, is
            an error raised before any work.

    Returns:
        seconds each length took, ``{length: seconds}``.
    """
    from flexentropy.caches.keywords import cache_keyword
    from flexentropy.caches.static_latent import StaticLatentKVCache

    if cache is not None and not isinstance(cache, StaticLatentKVCache):
        raise TypeError(f"warm_up warms a StaticLatentKVCache, got {type(cache).__name__}")
    if config is None:
        config = served_config(model, cache)
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
    if artifacts is not None:
        load_artifacts(Path(artifacts))
    serving = StaticLatentKVCache(config, model=model) if cache is None else cache
    seconds = {}
    for length in lengths:
        ids = torch.randint(min(3, text.vocab_size - 1), text.vocab_size, (batch_size, length), generator=generator)
        serving.reset()
        start_time = time.perf_counter()
        if loop:
            greedy_generate(model, ids.to(model.device), serving, new_tokens, compile_config=compile_config)
        else:  # no inference_mode: its tensors would not pass the guards of the compiled graphs for generate's calls
            model.generate(ids.to(model.device), attention_mask=torch.ones_like(ids, device=model.device),
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0, **{cache_keyword(model): serving}, **extra)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        seconds[length] = time.perf_counter() - start_time
    serving.reset()
    saved = torch.compiler.save_cache_artifacts() if artifacts is not None else None
    if saved is not None:
        Path(artifacts).write_bytes(saved[0])
    return seconds
