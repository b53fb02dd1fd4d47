"""`generate_batch`: the engine's batch scheduler, many prompts decoded a few rows at a time in one step of the
model's step driver (`flexentropy.engine.driver`). transformers is imported inside the function."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from flexentropy._checks import check_bool, check_int, is_int
from flexentropy.config import check_config
from flexentropy.engine.driver import step_driver
from flexentropy.engine.loops import decode_settings, served_config


def generate_batch(model: Any, prompts: Iterable[torch.Tensor], max_new_tokens: int, *, rows: int = 8,
                   config: Any = None, cache: Any = None, eos_token_id: int | Sequence[int] | None = None,
                   compile_config: Any = None, compiled: bool | None = None) -> list[torch.Tensor]:
    """Greedy decoding of many prompts, up to ``rows`` at a time in one batched step.

    Each prompt is prefilled on its own (the model's sparse prefill, batch 1) into a one-row `LatentKVCache` whose
    first eviction ends the prompt's forward, layer by layer (``decode_delay=0``, whatever ``config`` says: a
    prompt's full KV is held for one layer at a time), then put in a free row of one batched `StaticLatentKVCache`
    (`StaticLatentKVCache.insert`). All rows decode together, each at its own position and on its own count of
    entries (its recompressions are its own), through the model's `StepDriver` (on CUDA, one recorded step for all
    rows). A row ends at ``eos_token_id`` (kept) or after ``max_new_tokens`` tokens and takes the next waiting
    prompt. Each prompt gets the tokens of its run alone through `greedy_generate` with the same config. The cache
    comes back empty (``reset()``: its buffers kept), ready for the next call or another request.

    The host learns which rows ended after each step (one synchronisation per step, for all rows); the tokens stay
    on the device until their row ends.

    Args:
        model: an HF causal LM switched by `flexentropy.enable`.
        prompts: int64 token ids, ``[N_i]`` each (any lengths): a list, or any iterable (a generator is read once,
            before the first prompt runs).
        max_new_tokens: most tokens per prompt, its prompt's greedy next token included.
        rows: batch rows decoded together: the batch size of the one recorded step, whatever the number of prompts
            (rows without a prompt idle through it), so that a warm-up with a few prompts records the step that
            serves many.
        config: the `EntropyConfig` of the caches (default: the model's, as `enable` stored it); its
            ``decode_delay`` is taken as 0.
        cache: the batched `StaticLatentKVCache` to serve with (default: a new one); reusing one keeps its buffers
            and recorded step across calls.
        eos_token_id: a row's stop token, or several (a list, as ``generate`` takes), or None.
        compile_config, compiled: as for `greedy_generate`.

    Returns:
        int64 ``[T_i]`` per prompt, in the order of ``prompts``.
    """
    from flexentropy.caches.keywords import cache_keyword
    from flexentropy.caches.latent_kv import LatentKVCache
    from flexentropy.caches.static_latent import StaticLatentKVCache

    max_new_tokens = check_int("generate_batch", "max_new_tokens", max_new_tokens, 1)
    rows = check_int("generate_batch", "rows", rows, 1)
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Iterable):
        got = f"a tensor {list(prompts.shape)}" if isinstance(prompts, torch.Tensor) else type(prompts).__name__
        raise TypeError(f"generate_batch takes prompts as a list (or any iterable) of int64 token id tensors [N], got "
                        f"{got}: pass [ids] for one prompt, list(ids) for the rows of a [B, N] batch")
    prompts = list(prompts)
    check_bool("generate_batch", "compiled", compiled, optional=True)
    for index, ids in enumerate(prompts):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.long or ids.numel() == 0:
            got = f"{ids.dtype} {list(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"generate_batch expects each prompt as int64 token ids [N >= 1]; prompt {index} is {got}")
    if cache is not None and not isinstance(cache, StaticLatentKVCache):
        raise TypeError(f"generate_batch serves with a StaticLatentKVCache, got {type(cache).__name__}")
    config = served_config(model, cache) if config is None else check_config(config, "generate_batch")
    config = config.replace(decode_delay=0)
    cache = StaticLatentKVCache(config, model=model) if cache is None else cache
    if cache.config.decode_delay != 0 or cache.config != config:
        raise ValueError("generate_batch: the cache's EntropyConfig must be the one it serves with, decode_delay=0")
    device = model.device
    stops = stop_tokens(eos_token_id)
    stop_ids = torch.tensor(stops, dtype=torch.long, device=device)
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
            if max_new_tokens == 1 or int(first) in stops:
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
            ended = busy & ((counts >= max_new_tokens) | torch.isin(tokens[:, 0], stop_ids))
            for row in ended.nonzero().flatten().tolist():   # the step's one wait on the device
                outputs[owner[row]] = generated[row, :int(counts[row])].to("cpu", copy=True)
                admit(row)
    cache.reset()
    return outputs


def stop_tokens(eos_token_id: object) -> tuple[int, ...]:
    """The stop tokens of ``eos_token_id``: None (none), a token id, or a list, tuple or 1-D tensor of them."""
    ids = eos_token_id.tolist() if isinstance(eos_token_id, torch.Tensor) else eos_token_id
    if ids is None:
        return ()
    ids = [ids] if is_int(ids) else ids
    if not isinstance(ids, list | tuple) or not all(is_int(token) and token >= 0 for token in ids):
        raise TypeError(f"generate_batch: eos_token_id must be a token id (an int >= 0) or a list of them, as "
                        f"generate takes, got {eos_token_id!r}")
    return tuple(int(token) for token in ids)
