"""Tensor parallel over the GPUs of one host: a Llama-3.1-8B-shaped model (random bf16 weights) sharded by heads with
transformers' tensor parallelism, dense SDPA against flexentropy from 128k to 1M tokens.

    torchrun --standalone --nproc-per-node 2 profiling/tp_scale.py --out DIR --contexts 131072 262144
    torchrun --standalone --nproc-per-node 2 profiling/tp_scale.py --out DIR --contexts 524288 1048576 \\
        --dense-backends cudnn --skip-checks

Every rank builds its shard of the model directly on its GPU: ``from_pretrained(None, config=..., state_dict={},
distributed_config=DistributedConfig(tp_plan="auto"))`` loads nothing and initialises every (sharded) weight at
random, so there is no checkpoint to write or read (``setup_s`` in the JSON is that build). Then:

1. Checks (unless ``--skip-checks``). *Tokens*: a float32 model of ``--check-layers`` layers of the same shape, at
   covering budgets (every key block planned, no eviction), generates the same greedy tokens under flexentropy
   (`LatentKVCache`) as dense SDPA (`DynamicCache`), both tensor parallel, and a prompt and a step make the same
   collective calls (profiler events of the NCCL backend). *Plans*: one prefill of the bf16 model
   at the default knobs (``dense_prefix`` 1024, so that most segments are sparse); every rank's plan of every sparse
   layer is compared with the single-GPU plan that rank 0 computes from all ranks' queries and keys of that layer
   (gathered), restricted to the rank's heads (`flexentropy.integrations.hf.local_heads`).
2. One row per context and variant, all flexentropy rows first (so that they are in the JSON even if a dense row
   then takes the rest of the time or fails for good): ``flexentropy`` is `fe.enable` with `common.speed_config` (FLASH
   backend when flash-attn-4 is importable, else Triton) with a `LatentKVCache`; ``dense_<backend>`` is
   transformers' SDPA pinned to that backend for the prompt (``cudnn``, ``flash``) and to
   ``--dense-decode-backend`` (flash: cuDNN re-plans at every new length) for the tokens, with a `DynamicCache`.
   TTFT is the prompt's forward with ``logits_to_keep=1`` plus the first token's
   argmax; then ``--new-tokens`` single-token steps (median, mean and slowest step; for flexentropy also the median
   before and after its eviction, which runs at step ``decode_delay``: the table shows the latter). Peak memory per
   GPU after the prompt and after the steps; ``compiles``: graphs dynamo compiled during the row. Each variant is
   warmed up once on a ``--warmup-tokens`` prompt first (compiles the flex graphs).

An out-of-memory error or other failure of a row is recorded and the run goes on; a dense row whose predicted time
(its last measured dense row scaled by the square of the length; before one, the one-GPU 128k figure of
docs/performance.md) exceeds what is left of ``--budget-s`` is skipped with that reason. Rank 0 rewrites
``DIR/tp_scale_<world>gpu_<contexts>.json`` after every row (one file per call, so that several calls can share
``DIR``) and prints a table last. ``--nproc-per-node 1`` runs the same code on one GPU without sharding, for 1-GPU
rows measured alike. Nothing persists between calls: each call builds its shards again (``setup_s``).
A rank that fails alone (e.g. an out-of-memory error on one GPU only) leaves the other waiting in a collective: the
process group's timeout (``--collective-timeout-s``) then ends the run, and the JSON keeps the rows before it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # 1M tokens leave little headroom

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, speed_config, sync, write_json  # noqa: E402
from end_to_end import LLAMA_31_8B, TINY  # noqa: E402

import flexentropy as fe  # noqa: E402
from flexentropy.integrations import hf  # noqa: E402
from flexentropy.policies import make_prefill  # noqa: E402
from flexentropy.sparse.kernel import flash_available  # noqa: E402

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
PLAN_FIELDS = ("blocks", "rigid", "budgets", "entropy")


def start(device_type: str, timeout_s: float) -> tuple[int, int, torch.device]:
    """``(rank, world size, device)``; joins the process group (NCCL on CUDA, gloo on CPU) with ``timeout_s``."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s),
                                **({"device_id": device} if device.type == "cuda" else {}))
    return rank, world, device


def build(layers: int, dtype: torch.dtype, tiny: bool, max_positions: int, world: int, device: torch.device):
    """The Llama-3.1-8B-shaped model with random weights, sharded over the ``world`` ranks (whole on one)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.utils import logging

    logging.set_verbosity_error()  # every weight is "missing": that is the point
    logging.disable_progress_bar()
    config = LlamaConfig(**{**LLAMA_31_8B, **(TINY if tiny else {}), "num_hidden_layers": layers,
                            "max_position_embeddings": max_positions})
    placement = ({"distributed_config": DistributedConfig(tp_plan="auto")} if world > 1
                 else {"device_map": str(device)})
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(None, config=config, state_dict={}, dtype=dtype,
                                             attn_implementation="sdpa", **placement)
    return model.eval()


def prompt(n: int, seed: int, vocab: int, device: torch.device) -> torch.Tensor:
    """``[1, n]`` token ids, the same on every rank."""
    return torch.randint(100, vocab - 100, (1, n), generator=torch.Generator().manual_seed(seed)).to(device)


def peak_gib(device: torch.device, reserved: bool = False) -> float:
    """Peak GiB of tensors (``reserved``: of the caching allocator's segments) on ``device`` since the last reset."""
    if device.type != "cuda":
        return float("nan")
    return (torch.cuda.max_memory_reserved if reserved else torch.cuda.max_memory_allocated)(device) / 2**30


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def gathered(tensor: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on every rank), bool tensors included."""
    send = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor.contiguous()
    parts = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(parts, send)
    return [p.bool() for p in parts] if tensor.dtype == torch.bool else parts


def from_rank0(value: object) -> object:
    """Rank 0's ``value`` on every rank (decisions that every rank must take alike)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def greedy(model, ids: torch.Tensor, cache: object, new: int) -> list[int]:
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                         pad_token_id=0, **{hf.cache_keyword(model): cache})
    return out[0, ids.shape[1]:].tolist()


def check_tokens(args: argparse.Namespace, world: int, device: torch.device) -> dict:
    """Covering budgets, float32: flexentropy's greedy tokens against dense SDPA's, both sharded."""
    from transformers import DynamicCache

    n, new = args.check_tokens, args.check_new_tokens
    model = build(args.check_layers, torch.float32, args.tiny, n + new, world, device)
    ids = prompt(n, 1, model.config.vocab_size, device)
    covering = fe.EntropyConfig(dense_prefix=1024, base_budget=float(n), decode_budget=n + new)
    with torch.inference_mode():
        dense = greedy(model, ids, DynamicCache(), new)
        dense_calls = collective_calls(model, ids, DynamicCache())
        fe.enable(model, covering)
        ours = greedy(model, ids, fe.LatentKVCache(covering), new)
        our_calls = collective_calls(model, ids, fe.LatentKVCache(covering))
    density = hf.prefill_density(model)
    del model
    free(device)
    return {"check": "covering_tokens", "dtype": "float32", "layers": args.check_layers, "n": n, "dense": dense,
            "flexentropy": ours, "density": density, "dense_collectives": dense_calls,
            "flexentropy_collectives": our_calls, "collectives_seen": bool(dense_calls),
            "passed": dense == ours and density == 1.0 and dense_calls == our_calls}


def collective_calls(model, ids: torch.Tensor, cache: object) -> dict[str, int]:
    """Calls of the process group's backend (profiler events ``nccl:all_reduce``, ...) in one prompt forward and one
    decode step over ``cache``."""
    from torch.profiler import ProfilerActivity, profile

    backend = dist.get_backend()
    keyword = {hf.cache_keyword(model): cache}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **keyword).logits
        model(input_ids=logits[:, -1:].argmax(-1), use_cache=True, **keyword)
    calls: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith(f"{backend}:"):
            calls[event.name] = calls.get(event.name, 0) + 1
    return calls


def check_plans(model, args: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict:
    """Every rank's plans against the single-GPU plans of all heads from the same inputs, computed on rank 0."""
    n = args.check_tokens
    config = fe.EntropyConfig(dense_prefix=1024)
    fe.enable(model, config)
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor, object]] = {}

    def keep(layer: int, query: torch.Tensor, key: torch.Tensor, plan: object) -> object:
        inputs[layer] = (query, key, plan)
        return plan

    modules = hf.attention_modules(model)
    for module in modules:
        hf.layer_state(module).plan_edit = keep
    with torch.inference_mode():
        model(input_ids=prompt(n, 2, model.config.vocab_size, device), logits_to_keep=1, use_cache=False)
    heads = [None] * world
    dist.all_gather_object(heads, [tuple((h.start, h.stop) for h in hf.local_heads(m)) for m in modules])
    policy = make_prefill("entropy", config)
    layers = []
    for layer in sorted(inputs):
        query, key, plan = inputs[layer]
        queries, keys = gathered(query, world), gathered(key, world)
        parts = {name: gathered(getattr(plan, name), world) for name in PLAN_FIELDS
                 if getattr(plan, name) is not None}  # None alike on every rank (same length and knobs)
        if rank == 0:
            with torch.inference_mode():
                full = policy.plan(torch.cat(queries, dim=1), torch.cat(keys, dim=1), layer)
            row = {"layer": layer, "density": plan.density, "blocks_differing": 0, "rigid_differing": 0,
                   "budgets_max_abs_diff": 0.0, "entropy_max_abs_diff": 0.0}
            for r in range(world):
                own = slice(*heads[r][layer][0])
                for name, key_name in (("blocks", "blocks_differing"), ("rigid", "rigid_differing")):
                    if name in parts:
                        row[key_name] += int((parts[name][r] != getattr(full, name)[:, own]).sum())
                for name in ("budgets", "entropy") if "budgets" in parts else ():
                    diff = float((parts[name][r] - getattr(full, name)[:, own]).abs().max())
                    row[f"{name}_max_abs_diff"] = max(row[f"{name}_max_abs_diff"], diff)
            layers.append(row)
    for module in modules:
        hf.layer_state(module).plan_edit = None
    inputs.clear()
    free(device)
    passed = all(r["blocks_differing"] == 0 and r["rigid_differing"] == 0 for r in layers)
    return {"check": "plans_per_rank_vs_single_gpu", "dtype": str(model.dtype), "n": n, "heads_per_rank": heads,
            "layers": layers, "passed": passed if rank == 0 else None}


def configure(model, variant: str, cfg: fe.EntropyConfig, args: argparse.Namespace):
    """``(prompt context, decode context, cache factory)`` for ``variant``."""
    from transformers import DynamicCache

    if variant.startswith("dense_"):
        model.set_attn_implementation("sdpa")
        backend = BACKENDS[variant.removeprefix("dense_")]
        return (lambda: sdpa_kernel(backend)), (lambda: sdpa_kernel(BACKENDS[args.dense_decode_backend])), \
            DynamicCache
    fe.enable(model, cfg, keep_plans=False)  # a plan's block table is 1 GiB per layer at 1M tokens (16 heads)
    return contextlib.nullcontext, contextlib.nullcontext, (lambda: fe.LatentKVCache(cfg))


def run(model, variant: str, ids: torch.Tensor, new_tokens: int, cfg: fe.EntropyConfig, args: argparse.Namespace,
        device: torch.device) -> dict:
    """One prompt and ``new_tokens`` greedy steps under ``variant``: TTFT, step times, peaks of this rank."""
    prefill_ctx, decode_ctx, make_cache = configure(model, variant, cfg, args)
    keyword = hf.cache_keyword(model)
    cache = make_cache()
    compiled = graphs()
    free(device)
    dist.barrier()
    sync(device)
    start_time = time.perf_counter()
    with torch.inference_mode():
        with prefill_ctx():
            logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{keyword: cache}).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        ttft = time.perf_counter() - start_time
        peak_prefill = peak_gib(device)
        steps = []
        with decode_ctx():
            for _ in range(new_tokens):
                step_start = time.perf_counter()
                logits = model(input_ids=token, use_cache=True, **{keyword: cache}).logits
                token = logits[:, -1].argmax(-1, keepdim=True)
                sync(device)
                steps.append((time.perf_counter() - step_start) * 1e3)
    row = {"ttft_s": ttft, "peak_prefill_gib": peak_prefill, "peak_total_gib": peak_gib(device),
           "peak_reserved_gib": peak_gib(device, reserved=True),
           "compiles": graphs() - compiled,
           "decode_step_ms": median(steps),
           "decode_mean_ms": sum(steps) / len(steps) if steps else None, "decode_max_ms": max(steps, default=None),
           "decode_steps_ms": [round(s, 3) for s in steps]}
    if not variant.startswith("dense_"):
        row["density"] = hf.prefill_density(model)
        row["kv_stored_per_layer"] = cache.stored_length(1)
        delay = cfg.decode_delay  # the eviction runs in the step after `delay` generated tokens
        row["decode_before_eviction_ms"] = median(steps[:delay - 1])
        row["decode_after_eviction_ms"] = median(steps[delay + 1:])
    return row


def median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


ONE_GPU_TTFT_128K_S = {"cudnn": 11.72, "flash": 17.24}
"""Dense TTFT of this model at 128k tokens on one H200 (docs/results/end_to_end.json): the prior of a dense row's
time until the run has measured one of its own."""


def predicted_dense_s(rows: list[dict], variant: str, n: int, world: int) -> float | None:
    """The time of a ``variant`` row at ``n`` tokens: its longest measured row (else the one-GPU 128k figure over
    ``world`` GPUs) scaled by ``(n / N)^2``. Attention dominates there; the rest grows linearly, so this overestimates.
    None without either."""
    done = [r for r in rows if r["variant"] == variant and r.get("ttft_s") is not None]
    if done:
        last = max(done, key=lambda r: r["n"])
        return (last["ttft_s"] + sum(last["decode_steps_ms"]) / 1e3) * (n / last["n"]) ** 2
    prior = ONE_GPU_TTFT_128K_S.get(variant.removeprefix("dense_"))
    return None if prior is None else prior / world * (n / 131072) ** 2


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder of the JSON")
    p.add_argument("--contexts", type=int, nargs="+", default=[131072, 262144, 524288, 1048576])
    p.add_argument("--dense-backends", nargs="+", default=["cudnn", "flash"], choices=list(BACKENDS))
    p.add_argument("--dense-decode-backend", default="flash", choices=list(BACKENDS))
    p.add_argument("--no-flexentropy", action="store_true", help="dense rows only")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps per row (eviction at step 16)")
    p.add_argument("--warmup-tokens", type=int, default=16384 + 17)
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--check-layers", type=int, default=4)
    p.add_argument("--check-tokens", type=int, default=8192)
    p.add_argument("--check-new-tokens", type=int, default=16)
    p.add_argument("--budget-s", type=float, default=560.0, help="wall-clock budget of the whole run")
    p.add_argument("--collective-timeout-s", type=float, default=300.0)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a small model of the same family (a CPU smoke run)")
    args = p.parse_args(argv)
    began = time.perf_counter()
    rank, world, device = start(args.device, args.collective_timeout_s)
    out = Path(args.out) / f"tp_scale_{world}gpu_{'_'.join(f'{n // 1024}k' for n in args.contexts)}.json"
    payload = {"benchmark": "tp_scale", "model": "Llama-3.1-8B shape, random weights, bf16", "world_size": world,
               "layers": args.layers, "new_tokens": args.new_tokens, "flexentropy_backend":
               "flash" if flash_available() else ("triton" if device.type == "cuda" else "cpu"),
               "environment": environment(), "checks": [], "rows": []}

    def save() -> None:
        if rank == 0:
            write_json(out, payload)

    if not args.skip_checks:
        t0 = time.perf_counter()
        payload["checks"].append(check_tokens(args, world, device))
        payload["check_tokens_s"] = time.perf_counter() - t0
        save()
    t0 = time.perf_counter()
    model = build(args.layers, torch.bfloat16, args.tiny, max(args.contexts) + args.new_tokens + 1, world, device)
    sync(device)
    dist.barrier()
    payload["setup_s"] = time.perf_counter() - t0
    payload["weights_gib_per_gpu"] = sum(
        (t.to_local() if hasattr(t, "to_local") else t).nbytes for t in model.parameters()) / 2**30
    save()
    if not args.skip_checks:
        t0 = time.perf_counter()
        payload["checks"].append(check_plans(model, args, rank, world, device))
        payload["check_plans_s"] = time.perf_counter() - t0
        save()
    cfg = speed_config()
    variants = ([] if args.no_flexentropy else ["flexentropy"]) + [f"dense_{b}" for b in args.dense_backends]
    warm: set[str] = set()
    vocab = model.config.vocab_size
    for variant in variants:  # every flexentropy row first: a failing dense kernel cannot take them with it
        for n in args.contexts:
            ids = prompt(n, n, vocab, device)
            row = {"n": n, "variant": variant}
            left = args.budget_s - (time.perf_counter() - began)
            guess = predicted_dense_s(payload["rows"], variant, n, world) if variant.startswith("dense_") else None
            skip = from_rank0(f"predicted {guess:.0f} s > {left:.0f} s left of the budget"
                              if guess is not None and guess > left else
                              (f"{left:.0f} s left of the budget" if left <= 0 else None))
            results: dict = {"skipped": skip} if skip else {}
            if not skip:
                try:
                    if variant not in warm:
                        t0 = time.perf_counter()
                        run(model, variant, prompt(args.warmup_tokens, 0, vocab, device), args.new_tokens, cfg,
                            args, device)
                        row["warmup_s"] = time.perf_counter() - t0
                        warm.add(variant)
                    results = run(model, variant, ids, args.new_tokens, cfg, args, device)
                except Exception as error:  # noqa: BLE001 - record it (out of memory above all) and go on
                    results = {"error": f"{type(error).__name__}: {error}"[:2000],
                               "peak_at_error_gib": peak_gib(device)}
                free(device)
            per_rank = [None] * world
            dist.all_gather_object(per_rank, results)
            row.update({k: v for k, v in per_rank[0].items() if not k.startswith("peak")})
            for key in ("peak_prefill_gib", "peak_total_gib", "peak_reserved_gib", "peak_at_error_gib"):
                if key in per_rank[0]:
                    row[f"{key}_per_rank"] = [r.get(key) for r in per_rank]
            if any("error" in r for r in per_rank):
                row["errors_per_rank"] = [r.get("error") for r in per_rank]
            payload["rows"].append(row)
            if rank == 0:
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                       if k != "decode_steps_ms"}, flush=True)
            save()
    payload["total_s"] = time.perf_counter() - began
    save()
    if rank == 0:
        print_table(payload)
    dist.destroy_process_group()


def print_table(payload: dict) -> None:
    for check in payload["checks"]:
        print(f"check {check['check']}: {'PASS' if check['passed'] else 'FAIL'}")
    print(f"\n{world_label(payload)}, setup {payload.get('setup_s', float('nan')):.1f} s")
    print(f"{'N':>8} {'variant':>12} {'TTFT s':>8} {'step ms':>8} {'peak GiB/GPU':>13} {'density':>7}  note")
    for r in payload["rows"]:
        peaks = r.get("peak_prefill_gib_per_rank") or r.get("peak_at_error_gib_per_rank") or []
        peak = max((x for x in peaks if x is not None), default=float("nan"))
        note = r.get("skipped") or (r.get("error") or "")[:60]
        ttft = r.get("ttft_s")
        step = r.get("decode_after_eviction_ms") or r.get("decode_step_ms")
        print(f"{r['n']:>8} {r['variant']:>12} {ttft if ttft is not None else float('nan'):8.2f} "
              f"{step if step is not None else float('nan'):8.1f} {peak:13.1f} "
              f"{r.get('density') or float('nan'):7.3f}  {note}")


def world_label(payload: dict) -> str:
    return f"{payload['world_size']} GPU(s), {payload['layers']} layers, flexentropy backend " \
           f"{payload['flexentropy_backend']}"


if __name__ == "__main__":
    main()
