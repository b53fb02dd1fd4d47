"""One process of tests/test_tensor_parallel.py, and what the test measures in every process.

Launched by the test as ``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/_tp_worker.py DIR``:
each rank loads every checkpoint under ``DIR`` (one folder per architecture) with transformers' tensor parallelism
(``DistributedConfig(tp_plan="auto")``, gloo on CPU), runs `measure` and saves its result as ``DIR/<arch>/rank<r>.pt``.
The test runs the same `measure` in its own process on the unsharded model.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, DynamicCache

from flexentropy import EntropyConfig
from flexentropy.caches import LatentKVCache, StaticLatentKVCache
from flexentropy.integrations import hf

COVERING = EntropyConfig(segment_size=128, block_size=64, base_budget=4096, coverage=1.0, dense_prefix=128,
                         decode_budget=4096)
"""Budgets that cover every key block (prefill) and every token (decode): flexentropy computes dense attention."""
SMALL = EntropyConfig(segment_size=128, block_size=64, base_budget=64, dense_prefix=128, decode_budget=160,
                      decode_window=16, decode_delay=4)
"""Real sparsity: a few blocks per segment, and an eviction after 4 generated tokens."""
PROMPT, NEW = 640, 8
VOCAB = 256
SPLIT = "split_heads"
"""Folder of a checkpoint whose heads two ranks cannot share (one KV head): the worker records what `hf.enable` says."""


def prompt() -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def greedy(model: torch.nn.Module, cache: object = None, new: int = NEW, **kwargs: object) -> torch.Tensor:
    """The ``new`` greedy tokens after `prompt` ``[1, new]`` (a flexentropy cache passed under the installed
    transformers' keyword)."""
    ids = prompt()
    if cache is not None:
        kwargs[hf.cache_keyword(model)] = cache
    return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)[:, ids.shape[1]:]


def collectives(model: torch.nn.Module, cache: object) -> Counter[str]:
    """Collective calls of the process group's backend (profiler events such as ``gloo:all_reduce``) in one prompt
    forward and one decode step over ``cache``; empty without a process group."""
    if not dist.is_initialized():
        return Counter()
    backend = dist.get_backend()
    keyword = {hf.cache_keyword(model): cache}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logits = model(prompt(), use_cache=True, **keyword).logits
        model(logits[:, -1:].argmax(-1), use_cache=True, **keyword)
    return Counter(e.name for e in prof.events() if e.name.startswith(f"{backend}:"))


def measure(model: torch.nn.Module) -> dict:
    """Dense tokens, flexentropy tokens at `COVERING` and `SMALL`, and at `SMALL`: every sparse layer's plan, the
    queries and keys it was made from, and the positions the `LatentKVCache` kept (this process's heads only); the
    same prompt's tokens and kept positions with a `StaticLatentKVCache` (eager); the collectives of a prompt and a
    step, dense and sparse."""
    modules = hf.attention_modules(model)
    out: dict = {"heads": [tuple((h.start, h.stop) for h in hf.local_heads(m)) for m in modules]}
    with torch.no_grad():
        out["dense"] = greedy(model)
        out["dense_collectives"] = collectives(model, DynamicCache())
        hf.enable(model, COVERING)
        out["covering"] = greedy(model, LatentKVCache(COVERING))
        out["covering_density"] = hf.prefill_density(model)
        hf.enable(model, SMALL)
        inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep_inputs(layer: int, query: torch.Tensor, key: torch.Tensor, plan: object) -> object:
            inputs[layer] = (query.clone(), key.clone())
            return plan

        for module in modules:
            hf.layer_state(module).plan_edit = keep_inputs
        cache = LatentKVCache(SMALL)
        out["small"] = greedy(model, cache, new=12)
        out["plans"] = {m.layer_idx: hf.layer_state(m).plans[0] for m in modules if m.layer_idx in inputs}
        out["sparse_collectives"] = collectives(model, LatentKVCache(SMALL))
        static = StaticLatentKVCache(SMALL, model=model)
        out["static"] = greedy(model, static, new=12, disable_compile=True)
    out["inputs"] = inputs
    out["kept"] = {m.layer_idx: cache.kept_positions(m.layer_idx) for m in modules}
    out["static_kept"] = {m.layer_idx: static.kept_positions(m.layer_idx) for m in modules}
    out["stored"] = {m.layer_idx: (cache.stored_length(m.layer_idx), cache.get_seq_length(m.layer_idx))
                     for m in modules}
    return out


def main(root: Path) -> None:
    from transformers.distributed import DistributedConfig

    for folder in sorted(p for p in root.iterdir() if (p / "config.json").is_file()):
        model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto"),
                                                     dtype=torch.float32, attn_implementation="sdpa").eval()
        if folder.name == SPLIT:
            try:
                hf.enable(model)
                result = {"refused": None}
            except ValueError as error:
                result = {"refused": str(error)}
        else:
            result = measure(model)
        result["world_size"] = dist.get_world_size()
        torch.save(result, folder / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
