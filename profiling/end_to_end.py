"""End to end on a Llama-3.1-8B-shaped model (random weights, built from its config: no download).

    python profiling/end_to_end.py --contexts 4096 16384 32768 65536 131072 --out docs/results/end_to_end.json

For each context and variant: time to first token (prefill forward + first token), prefill + ``--new-tokens``
greedy tokens through ``generate``, the mean decode step, and peak GPU memory. Variants:

* ``dense_cudnn`` / ``dense_flash``: transformers' SDPA attention pinned to the cuDNN / flash backend (the faster
  of the two is "best dense");
* ``entropy``: flexentropy sparse prefill, full cache;
* ``latent``: dense prefill, `LatentKVCache` (B_d 1024);
* ``entropy+latent``: both;
* ``critiprefill``: CritiPrefill's uniform budget (design.md §3) on the same kernels.

Each row also counts the graphs dynamo compiled during the timed runs (``compiles_after_warmup``; 0 means no
recompile after the warm-up at 4k), and the JSON is rewritten after every row, so a cut-off run keeps its rows.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, speed_config, sync, write_json  # noqa: E402

import flexentropy as fe  # noqa: E402

LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=262144,
                   rms_norm_eps=1e-5, tie_word_embeddings=False)


TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=128256)


def build_model(layers: int, device: torch.device, tiny: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA_31_8B, **(TINY if tiny else {}), "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


def configure(model, variant: str, cfg: fe.EntropyConfig):
    """Attention implementation, prefill context and cache for ``variant``: ``(sdpa_ctx, cache_factory)``."""
    from transformers import DynamicCache

    if variant.startswith("dense"):
        model.set_attn_implementation("sdpa")
        backend = SDPBackend.CUDNN_ATTENTION if variant == "dense_cudnn" else SDPBackend.FLASH_ATTENTION
        return (lambda: sdpa_kernel(backend)), DynamicCache
    prefill = "dense" if variant == "latent" else variant.split("+")[0]
    fe.enable(model, cfg, prefill=prefill)
    cache = (lambda: fe.LatentKVCache(cfg)) if variant.endswith("latent") else DynamicCache
    return contextlib.nullcontext, cache


def _peak(dev: torch.device) -> float:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def run_variant(model, variant: str, ids: torch.Tensor, new_tokens: int, cfg: fe.EntropyConfig) -> dict:
    ctx, make_cache = configure(model, variant, cfg)
    dev = ids.device
    gen_kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode(), ctx():
        # warm-up (compiles flex graphs on first use; lengths share graphs afterwards)
        model.generate(ids[:, :4096 + 17], max_new_tokens=2, min_new_tokens=2, past_key_values=make_cache(),
                       **gen_kwargs)
        sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        graphs = _graphs()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, past_key_values=make_cache(), **gen_kwargs)
        sync(dev)
        ttft = time.perf_counter() - t0
        peak_prefill = _peak(dev)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, past_key_values=make_cache(),
                             **gen_kwargs)
        sync(dev)
        total = time.perf_counter() - t0
    row = {"variant": variant, "ttft_s": ttft, "prefill_plus_new_s": total,
           "decode_step_ms": (total - ttft) / (new_tokens - 1) * 1e3, "peak_prefill_gib": peak_prefill,
           "peak_total_gib": _peak(dev), "new_tokens": out.shape[1] - ids.shape[1],
           "compiles_after_warmup": _graphs() - graphs}
    if variant.startswith(("entropy", "critiprefill")):
        row["density"] = fe.integrations.hf.prefill_density(model)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768, 65536, 131072])
    p.add_argument("--variants", nargs="+",
                   default=["dense_cudnn", "dense_flash", "entropy", "latent", "entropy+latent", "critiprefill"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=100)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small model of the same family, for a quick CPU check")
    p.add_argument("--out", default="docs/results/end_to_end.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    model = build_model(args.layers, device, args.tiny)
    cfg = speed_config()
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for n in args.contexts:
        ids = torch.randint(100, 120000, (1, n), device=device, generator=gen)
        for variant in args.variants:
            row = {"n": n, **run_variant(model, variant, ids, args.new_tokens, cfg)}
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            write_json(args.out, {"benchmark": "end_to_end", "model": "Llama-3.1-8B shape, random weights, bf16",
                                  "layers": args.layers, "new_tokens": args.new_tokens,
                                  "environment": environment(), "rows": rows})
    print(f"\n{'N':>7} {'variant':>15} {'TTFT s':>8} {'+new s':>8} {'step ms':>8} {'peak GiB':>8} {'density':>7} "
          f"{'compiles':>8}")
    for r in rows:
        print(f"{r['n']:>7} {r['variant']:>15} {r['ttft_s']:8.3f} {r['prefill_plus_new_s']:8.3f} "
              f"{r['decode_step_ms']:8.2f} {r['peak_prefill_gib']:8.1f} {r.get('density') or float('nan'):7.3f} "
              f"{r['compiles_after_warmup']:8d}")


if __name__ == "__main__":
    main()
