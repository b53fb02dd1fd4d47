"""More and longer requests than dense fits on one GPU (issue 47): requests per minute at 128k, and prompts of 512k and
1M tokens, on the Llama-3.1-8B shape (random bf16 weights, `fe.fuse_projections`).

    source profiling/h200/setup.sh
    python profiling/capacity.py --parts batch --out docs/results/capacity/capacity.json
    python profiling/capacity.py --parts long --contexts 524288 1048576 --out docs/results/capacity/capacity.json

Parts (``--parts``; every row is written to ``--out`` as it completes):

* ``batch``: ``--requests`` prompts of ``--context`` tokens, ``--new-tokens`` each, no stop token.
  - ``dense``: the largest batch whose KV fits beside the weights and one prompt's prefill (``--dense-batch``, or
    tried: one row above `dense_rows`'s estimate, then one fewer until a wave fits): each prompt prefilled alone
    on cuDNN SDPA straight into its row of one transformers ``StaticCache`` (no second copy of its KV), then all
    rows decoded together, the step captured whole in one CUDA graph with its attention cuDNN SDPA over the whole
    buffer, no mask (as `decode_timeline.py`'s dense decode). Every wave of that many requests is the same, so
    one full wave is timed: its requests per minute are dense's rate.
  - ``flexentropy``: `fe.generate_batch` with ``--rows`` rows (prefill alone, evicted at the end of each prompt,
    decoded together in one recorded step; a row that ends takes the next prompt).
  Both sides run their MLPs in chunks of ``--mlp-chunk`` tokens (`fe.chunk_mlp`), which leaves dense's prefill room
  for one more row. Per row: requests per minute, generated tokens per second, the batch, peak memory.
* ``long``: one prompt of each ``--contexts`` length, after two untimed prompts of ``--warm-length`` tokens
  (and 4,321 more) on each side: TTFT and peak memory of flexentropy's prefill into a
  `LatentKVCache` with ``decode_delay=0`` (each layer's full KV held only until its own attention has run), and of
  dense (cuDNN SDPA, `DynamicCache`) where its KV and activations fit, else the memory arithmetic that says it does
  not (``--variants``). Both run their MLPs in chunks of ``--mlp-chunk`` tokens (`fe.chunk_mlp`).

``--device cpu --tiny`` checks the harness on a small model; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import environment, record_graph, speed_config, sync, write_json  # noqa: E402
from decode_timeline import DENSE, dense_attention, dense_step, no_mask  # noqa: E402
from end_to_end import build_model  # noqa: E402

import flexentropy as fe  # noqa: E402
from flexentropy.caches.keywords import cache_keyword  # noqa: E402

CUDNN = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def kv_bytes_per_token(model: Any) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2


def dense_rows(model: Any, prompt: torch.Tensor, new: int, device: torch.device) -> int:
    """The most rows of dense KV (``prompt`` and ``new`` tokens each) that fit: a one-row wave is run first, and
    its peak above the memory held before it (its row and the prefill's activations) is what the first row
    costs; each further row costs its KV."""
    per_row = (prompt.numel() + new) * kv_bytes_per_token(model)
    if device.type != "cuda":
        return 2
    reset_peak(device)
    held, free = torch.cuda.memory_allocated(device), torch.cuda.mem_get_info(device)[0]
    dense_wave(model, [prompt], 4, device)
    first = torch.cuda.max_memory_allocated(device) - held
    return max(1, 1 + int((free - first) // per_row))


def prompts_of(model: Any, count: int, length: int, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(3)
    return [torch.randint(100, model.config.vocab_size - 1, (length,), device=device, generator=gen)
            for _ in range(count)]


def dense_wave(model: Any, prompts: list[torch.Tensor], new: int, device: torch.device) -> float:
    """Seconds for one wave of dense requests: each prompt prefilled alone into its row of a ``StaticCache``, then
    all rows decoded together by a captured step (module docstring)."""
    from transformers import StaticCache

    rows, n, keyword = len(prompts), prompts[0].numel(), cache_keyword(model)
    text = model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    cache = StaticCache(config=model.config, max_cache_len=n + new)
    cache.early_initialization(rows, text.num_key_value_heads, head_dim, model.dtype, device)
    first = torch.empty(rows, 1, dtype=torch.long, device=device)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad(), sdpa_kernel(CUDNN):
        for row, ids in enumerate(prompts):   # one prompt's prefill at a time, straight into its row
            alone = StaticCache(config=model.config, max_cache_len=n + new)
            for layer, whole in zip(alone.layers, cache.layers, strict=True):   # a one-row cache over that row
                layer.lazy_initialization(whole.keys[row:row + 1, :, :0], whole.values[row:row + 1, :, :0])
                layer.keys, layer.values = whole.keys[row:row + 1], whole.values[row:row + 1]
            logits = model(input_ids=ids[None], **{keyword: alone}, use_cache=True, logits_to_keep=1).logits
            first[row] = logits[:, -1:].argmax(dim=-1)[0]
            del alone
        for layer in cache.layers:
            layer.cumulative_length.fill_(n)
        token, position = first.clone(), torch.full_like(first, n)
        saved = [layer.cumulative_length.clone() for layer in cache.layers]

        def undo() -> None:   # recorded after the prefills, at the wave's first step (inside the timing)
            token.copy_(first)
            position.fill_(n)
            for layer, length in zip(cache.layers, saved, strict=True):
                layer.cumulative_length.copy_(length)

        run = record_graph(dense_step(model, cache, token, position), device, warmup=1, undo=undo)
        for _ in range(new - 1):
            run()
    sync(device)
    return time.perf_counter() - start


def batch_rows(model: Any, args: argparse.Namespace, device: torch.device) -> Iterator[dict]:
    n, new = args.context, args.new_tokens
    prompts = prompts_of(model, args.requests, n, device)
    fe.disable(model)
    previous = model.config._attn_implementation
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(DENSE, dense_attention)
    AttentionMaskInterface.register(DENSE, no_mask)
    model.set_attn_implementation(DENSE)
    # one row above the estimate first (it is a bound from one row's peak, not a trial): the batched cache is
    # allocated before the prefills, so a wave that does not fit fails within its first prefill; then one row
    # fewer until a wave fits
    rows = args.dense_batch or dense_rows(model, prompts[0], new, device) + 1   # also warms cuDNN's plans
    did_not_fit = None
    while True:
        reset_peak(device)
        wave = prompts[:rows] + prompts_of(model, max(0, rows - len(prompts)), n, device)
        try:
            seconds = dense_wave(model, wave, new, device)   # every wave is the same: one gives the rate
            break
        except torch.OutOfMemoryError:
            if rows == 1:
                raise
            did_not_fit, rows = rows, rows - 1
    model.set_attn_implementation(previous)
    yield {"part": "batch", "variant": "dense", "n": n, "new_tokens": new, "requests": rows, "batch": rows,
           "batch_out_of_memory": did_not_fit, "seconds": seconds, "requests_per_minute": rows / seconds * 60,
           "tokens_per_s": rows * new / seconds, "peak_gib": peak_gib(device)}
    if "flexentropy" not in args.variants:
        return
    cfg = speed_config(base_budget=args.prefill_budget)
    fe.enable(model, cfg)
    cache = fe.StaticLatentKVCache(cfg.replace(decode_delay=0), model=model)
    fe.generate_batch(model, prompts_of(model, 2, args.warm_length, device), 40, rows=args.rows, cache=cache)
    reset_peak(device)
    sync(device)
    start = time.perf_counter()
    outputs = fe.generate_batch(model, prompts, new, rows=args.rows, cache=cache)
    sync(device)
    seconds = time.perf_counter() - start
    yield {"part": "batch", "variant": "flexentropy", "n": n, "new_tokens": new, "requests": len(prompts),
           "batch": min(args.rows, len(prompts)), "seconds": seconds,
           "requests_per_minute": len(prompts) / seconds * 60,
           "tokens_per_s": sum(o.numel() for o in outputs) / seconds, "peak_gib": peak_gib(device)}


def prefill(model: Any, ids: torch.Tensor, cache: Any) -> None:
    """One prompt's forward into ``cache``, the last position's logits only (what TTFT times)."""
    with torch.no_grad():
        model(input_ids=ids, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1)


def warm_prefills(model: Any, new_cache: Callable[[], Any], args: argparse.Namespace, device: torch.device) -> None:
    """Two untimed prompts of ``--warm-length`` and a length that is not a multiple of the block size: the compiled
    graphs they build (dynamic after the second length) serve the timed long prompt, which then compiles nothing."""
    for length in (args.warm_length, args.warm_length + 4321):
        prefill(model, prompts_of(model, 1, length, device)[0][None], new_cache())


def long_rows(model: Any, args: argparse.Namespace, device: torch.device) -> Iterator[dict]:
    cfg = speed_config(base_budget=args.prefill_budget, decode_delay=0, probes=args.probes)
    for n in args.contexts:
        ids = prompts_of(model, 1, n, device)[0][None]
        if "flexentropy" in args.variants:
            fe.enable(model, cfg, keep_plans=False)
            warm_prefills(model, lambda: fe.LatentKVCache(cfg), args, device)
            reset_peak(device)
            sync(device)
            start = time.perf_counter()
            prefill(model, ids, fe.LatentKVCache(cfg))
            sync(device)
            yield {"part": "long", "variant": "flexentropy", "n": n, "mlp_chunk": args.mlp_chunk,
                   "probes": args.probes, "ttft_s": time.perf_counter() - start, "peak_gib": peak_gib(device)}
            fe.disable(model)
        if "dense" not in args.variants:
            continue
        reset_peak(device)   # what the run above left cached is free again
        kv = n * kv_bytes_per_token(model)
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        row = {"part": "long", "variant": "dense_cudnn", "n": n, "mlp_chunk": args.mlp_chunk, "kv_gib": kv / 2**30,
               "free_gib": None if free is None else free / 2**30}
        if free is not None and kv > free:
            row["result"] = "does not fit: its KV alone exceeds the free memory"
        else:
            from transformers import DynamicCache

            try:
                with sdpa_kernel(CUDNN):
                    warm_prefills(model, lambda: DynamicCache(config=model.config), args, device)
                    reset_peak(device)
                    sync(device)
                    start = time.perf_counter()
                    prefill(model, ids, DynamicCache(config=model.config))
                sync(device)
                row.update(ttft_s=time.perf_counter() - start, peak_gib=peak_gib(device))
            except torch.OutOfMemoryError as err:
                row["result"] = f"out of memory: {err}"[:300]
        yield row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="batch")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--new-tokens", type=int, default=2048)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--dense-batch", type=int, default=None, help="default: the most rows whose KV fits")
    p.add_argument("--contexts", type=int, nargs="+", default=[524288, 1048576])
    p.add_argument("--variants", default="flexentropy,dense",
                   help="which sides run (the batch part runs dense in any case)")
    p.add_argument("--mlp-chunk", type=int, default=65536, help="fe.chunk_mlp's tokens, on both sides")
    p.add_argument("--prefill-budget", type=int, default=3328)
    p.add_argument("--warm-length", type=int, default=8192)
    p.add_argument("--probes", type=int, default=fe.EntropyConfig().probes,
                   help="long: probe queries per segment of flexentropy's observation (EntropyConfig.probes)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default="docs/results/capacity/capacity.json")
    args = p.parse_args(argv)
    device, out = torch.device(args.device), Path(args.out)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    model = build_model(args.layers, device, args.tiny)
    fe.fuse_projections(model)
    # every part, both sides: a 1M prompt's MLP activations would not fit otherwise, and in the batch part dense's
    # prefill leaves room for one more row
    fe.chunk_mlp(model, args.mlp_chunk)

    def guarded(part: str, rows_of: Callable[[], Iterator[dict]]) -> None:
        try:
            for row in rows_of():
                rows.append(row)
                print(row, flush=True)
                write_json(out, {"benchmark": "capacity", "model": "Llama-3.1-8B shape, random weights, bf16",
                                 "environment": environment(), "rows": rows})
        except Exception as err:  # noqa: BLE001 - one failed part must not lose the others
            traceback.print_exc()
            rows.append({"part": part, "error": f"{type(err).__name__}: {err}"[:500]})
            write_json(out, {"benchmark": "capacity", "environment": environment(), "rows": rows})

    for part in args.parts.split(","):
        guarded(part, {"batch": lambda: batch_rows(model, args, device),
                       "long": lambda: long_rows(model, args, device)}[part])


if __name__ == "__main__":
    main()
