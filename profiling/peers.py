"""The peers' selection rules on one kernel (issue 15): ``flexprefill``, ``xattention`` and ``vertical_slash`` beside
``entropy``, ``critiprefill``, ``streaming`` and ``dense``, one attention layer, each policy at its default knobs.

Llama-3.1-8B attention shape by default (32 q heads, 8 kv heads, D 128, bf16, causal, B 1), kernel backend
``auto`` (FLASH where flash-attn-4 imports), random and structured inputs (profiling/common.py, design.md §6):

    python profiling/peers.py --out docs/results/peers.json
    python profiling/peers.py --official official --out docs/results/peers.json    # + the released code
    python profiling/peers.py --tiny --out /tmp/peers.json                          # CPU smoke test, seconds

Per (inputs, N, policy): selection time (``policy.plan``), kernel time (the plan on the shared kernel; causal SDPA
for dense plans), density (computed / causal blocks), relative L2 error of the output against dense SDPA, peak
extra GPU memory of the selection; ``vertical_slash`` also the density of its token-level pattern, ``flexprefill``
the share of query-aware heads.

``--official DIR`` (see profiling/fetch_peers.sh) also runs the released FlexPrefill (its Triton selection and
kernel, ``DIR/FlexPrefill/flex_prefill/ops/flex_prefill_attention.py``, imported by file: the package's
``__init__`` patches transformers 4.44 models) and XAttention's estimate (``DIR/x-attention/xattn``; its kernel only
when ``block_sparse_attn`` imports, else a stub stands in for it) on the same q/k/v. Per method: selection time, its
own kernel time (FlexPrefill; XAttention with block_sparse_attn), density, IoU of the block sets with ours under a
matched geometry (128-token rows, sink block + diagonal kept, no dense prefix or last segment: what the released
code keeps), output error against dense, and our kernel run on their block set (same set, our kernel).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import attention_inputs, environment, time_ms, write_json  # noqa: E402

from flexentropy import EntropyConfig  # noqa: E402
from flexentropy.policies import PrefillPolicy, make_prefill  # noqa: E402
from flexentropy.policies.base import attend, dense_causal_attention  # noqa: E402
from flexentropy.policies.prefill.vertical_slash import token_density  # noqa: E402
from flexentropy.sparse.plan import SparsePlan, causal_blocks  # noqa: E402

POLICIES = ("dense", "entropy", "critiprefill", "streaming", "flexprefill", "xattention", "vertical_slash")


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def iou(a: torch.Tensor, b: torch.Tensor) -> float:
    """Intersection over union of two block tables ``[B, H, C_Q, C_B]`` (1.0 when both are empty)."""
    union = float((a | b).sum())
    return float((a & b).sum()) / union if union else 1.0


def table_density(blocks: torch.Tensor, n: int) -> float:
    causal = causal_blocks(n, 128, blocks.device)
    return float((blocks & causal).sum()) / float(causal.sum() * blocks.shape[0] * blocks.shape[1])


def matched_config(config: EntropyConfig) -> EntropyConfig:
    """The geometry the released codes keep besides their selection: 128-token rows, the first key block and the
    diagonal block; no dense prefix, no dense last segment."""
    return config.replace(segment_size=128, block_size=128, sink_blocks=1, local_blocks=0, dense_prefix=0,
                          dense_last_segment=False)


class Runner:
    """Times and runs plans of one input on one device (eager flex on CPU, the compiled kernel on GPU)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: EntropyConfig, reps: int):
        self.q, self.k, self.v, self.config, self.reps = q, k, v, config, reps
        self.device, self.compiled = q.device, q.is_cuda
        self.reference = dense_causal_attention(q, k, v)

    def time(self, fn: Callable[[], object]) -> float:
        return time_ms(fn, self.device, warmup=1 if self.reps < 3 else 2, reps=self.reps)

    def peak_gib(self, fn: Callable[[], object]) -> float | None:
        if not self.q.is_cuda:
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**30


def bench_policy(run: Runner, name: str) -> dict[str, Any]:
    policy = make_prefill(name, run.config)
    q, k, v = run.q, run.k, run.v
    plan = policy.plan(q, k)
    row: dict[str, Any] = {"policy": name, "density": plan.density,
                           "selection_ms": run.time(lambda: policy.plan(q, k)),
                           "selection_peak_gib": run.peak_gib(lambda: policy.plan(q, k))}
    kernel = lambda: attend(q, k, v, plan, run.config, compiled=run.compiled)  # noqa: E731  (SDPA for dense plans)
    row["kernel_ms"] = run.time(kernel)
    row["total_ms"] = row["selection_ms"] + row["kernel_ms"]
    row["rel_l2_vs_dense"] = rel_l2(kernel(), run.reference)
    if name == "vertical_slash":
        row["token_density"] = float(token_density(*policy.select_tokens(q, k)).mean())
    if name == "flexprefill":
        row["query_aware_heads"] = float(policy.estimate(q, k).query_aware.float().mean())
    return row


# --------------------------------------------------------------------------------------------------------------
# the released implementations (GPU only: Triton kernels and hard-coded .to("cuda"))


def _block_sparse_attn() -> bool:
    """Whether MIT Han Lab's ``block_sparse_attn`` (XAttention's kernel, a CUDA extension) imports."""
    module = sys.modules.get("block_sparse_attn")
    if module is None:
        try:
            module = importlib.import_module("block_sparse_attn")
        except ImportError:
            return False
    return getattr(module, "block_sparse_attn_func", None) is not None


def load_official(folder: Path) -> dict[str, Any]:
    """``{"flexprefill": module, "xattention": module, "block_sparse_attn": bool}`` from ``folder`` (each entry an
    error string where it does not import)."""
    found: dict[str, Any] = {}
    flex_file = folder / "FlexPrefill" / "flex_prefill" / "ops" / "flex_prefill_attention.py"
    try:
        spec = importlib.util.spec_from_file_location("official_flex_prefill", flex_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found["flexprefill"] = module
    except Exception as err:  # missing file, Triton or einops: reported, the rest still runs
        found["flexprefill"] = f"{type(err).__name__}: {err}"
    sys.path.insert(0, str(folder / "x-attention"))
    found["block_sparse_attn"] = _block_sparse_attn()
    if not found["block_sparse_attn"]:  # xattn imports it at module level; the estimate does not use it
        stub = types.ModuleType("block_sparse_attn")
        stub.block_sparse_attn_func = None
        sys.modules["block_sparse_attn"] = stub
    try:
        found["xattention"] = importlib.import_module("xattn.src.Xattention")
    except Exception as err:
        found["xattention"] = f"{type(err).__name__}: {err}"
    return found


def flexprefill_table(block_idx: list[list[torch.Tensor]], num_blocks: int) -> torch.Tensor:
    """The released FlexPrefill's ``block_idx[b][h]`` (flat ``row * num_blocks + col`` indices) as a block table
    ``[B, H, C, C]``."""
    table = torch.zeros(len(block_idx), len(block_idx[0]), num_blocks, num_blocks, dtype=torch.bool,
                        device=block_idx[0][0].device)
    for b, heads in enumerate(block_idx):
        for h, idx in enumerate(heads):
            table[b, h].view(-1)[idx.long()] = True
    return table


def xattention_chunk(n: int) -> int:
    """The chunk size the released ``Xattention_prefill`` picks for ``n`` keys."""
    p = 1 << (n - 1).bit_length()
    return int(max(min(max(2048, p), 128 * 1024 * 2048 // p), 2048))


def bench_official(run: Runner, found: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per released method; a method that fails (import or run) gets its error and the rest still runs."""
    rows = []
    for method, bench in (("flexprefill (released)", _official_flexprefill),
                          ("xattention (released estimate)", _official_xattention)):
        module = found[method.split()[0]]
        try:
            if isinstance(module, str):
                raise ImportError(module)
            rows.append({"method": method, **bench(run, module, found["block_sparse_attn"])})
        except Exception as err:  # a peer's code failing on this torch/triton is a result, not a crash
            rows.append({"method": method, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"})
    return rows


def _official_flexprefill(run: Runner, module: Any, _: bool) -> dict[str, Any]:
    q, k, v, n = run.q, run.k, run.v, run.q.shape[-2]
    ours = make_prefill("flexprefill", matched_config(run.config))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))                   # the code's [B, N, H, D]
    least = math.ceil(ours.min_tokens / 128)

    def select() -> list[list[torch.Tensor]]:
        return module.get_active_blocks(qt, kt, vt, 128, ours.gamma, least, 2**31 - 1, ours.tau, False)

    def attend() -> torch.Tensor:
        return module.flex_prefill_attention(qt, kt, vt, ours.gamma, ours.tau, min_budget=ours.min_tokens,
                                             block_size=128)

    row: dict[str, Any] = {"gamma": ours.gamma, "tau": ours.tau, "min_budget": ours.min_tokens,
                           "selection_ms": run.time(select), "total_ms": run.time(attend)}
    row["kernel_ms"] = row["total_ms"] - row["selection_ms"]
    row["rel_l2_vs_dense"] = rel_l2(attend().transpose(1, 2), run.reference)
    return row | official_vs_ours(run, flexprefill_table(select(), -(-n // 128)), ours)


def _official_xattention(run: Runner, module: Any, has_kernel: bool) -> dict[str, Any]:
    q, k, v, n = run.q, run.k, run.v, run.q.shape[-2]
    ours = make_prefill("xattention", matched_config(run.config))
    group, num_blocks = q.shape[1] // k.shape[1], -(-n // 128)
    kx, vx = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)     # the code wants Hq == Hkv

    def estimate() -> torch.Tensor:       # the torch path: their Triton path runs only on GPUs named "*100*"
        return module.xattn_estimate(q, kx, block_size=128, stride=ours.stride, threshold=ours.threshold,
                                     chunk_size=xattention_chunk(n), use_triton=False, causal=True)[1]

    row: dict[str, Any] = {"threshold": ours.threshold, "stride": ours.stride, "selection_ms": run.time(estimate)}
    if has_kernel:
        def attend() -> torch.Tensor:
            return module.Xattention_prefill(q, kx, vx, stride=ours.stride, threshold=ours.threshold,
                                             use_triton=False)

        row["total_ms"] = run.time(attend)
        row["kernel_ms"] = row["total_ms"] - row["selection_ms"]
        row["rel_l2_vs_dense"] = rel_l2(attend(), run.reference)
    return row | official_vs_ours(run, estimate()[:, :, :num_blocks, :num_blocks], ours)


def official_vs_ours(run: Runner, theirs: torch.Tensor, ours: PrefillPolicy) -> dict[str, Any]:
    """Their block set against ours (matched geometry), and their set run by our kernel."""
    n = run.q.shape[-2]
    theirs = theirs & causal_blocks(n, 128, theirs.device)
    mine = ours.plan(run.q, run.k).blocks
    plan = SparsePlan(theirs.contiguous(), n, 128)
    kernel = lambda: attend(run.q, run.k, run.v, plan, run.config, compiled=run.compiled)  # noqa: E731
    return {"density": table_density(theirs, n), "ours_matched_density": table_density(mine, n),
            "iou_vs_ours": iou(theirs, mine), "our_kernel_on_their_blocks_ms": run.time(kernel),
            "rel_l2_their_blocks_our_kernel": rel_l2(kernel(), run.reference),
            "ours_matched_rel_l2": rel_l2(ours.attention(run.q, run.k, run.v, compiled=run.compiled),
                                          run.reference)}


# --------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=None, help="default 32768 131072 (--tiny: 1536)")
    p.add_argument("--inputs", choices=["random", "structured"], nargs="+", default=["random", "structured"])
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--backend", choices=["auto", "triton", "flash"], default="auto")
    p.add_argument("--official", type=Path, default=None, help="folder holding FlexPrefill/ and x-attention/")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: 4/2 heads, D 64, float32, eager flex")
    p.add_argument("--out", default="docs/results/peers.json")
    args = p.parse_args(argv)
    if args.tiny:
        device, dtype, (hq, hkv, dim), reps = torch.device("cpu"), torch.float32, (4, 2, 64), 1
        config = EntropyConfig(segment_size=256, base_budget=256, dense_prefix=512, backend=args.backend)
        contexts = args.contexts or [1536]
    else:
        device, dtype, (hq, hkv, dim), reps = torch.device("cuda"), torch.bfloat16, (32, 8, 128), 5
        config = EntropyConfig(backend=args.backend)
        contexts = args.contexts or [32768, 131072]
    found = load_official(args.official) if args.official and device.type == "cuda" else None
    if args.official and found is None:
        print("--official needs CUDA (the released kernels are Triton, the estimates call .to('cuda')): skipped")
    rows, official = [], []
    for kind in args.inputs:
        for n in contexts:
            q, k, v = attention_inputs(1, hq, hkv, n, dim, dtype, device, kind=kind)
            run = Runner(q, k, v, config, reps)
            for name in args.policies:
                rows.append({"inputs": kind, "n": n, **bench_policy(run, name)})
                print({key: round(val, 4) if isinstance(val, float) else val for key, val in rows[-1].items()},
                      flush=True)
            if found is not None:
                for row in bench_official(run, found):
                    official.append({"inputs": kind, "n": n, **row})
                    print(official[-1], flush=True)
            del run, q, k, v
    write_json(args.out, {"benchmark": "peers", "shape": {"hq": hq, "hkv": hkv, "dim": dim, "dtype": str(dtype)},
                          "config": {"base_budget": config.base_budget, "segment_size": config.segment_size,
                                     "dense_prefix": config.dense_prefix, "backend": config.backend},
                          "environment": environment(), "rows": rows, "official": official})
    print(f"\n{'inputs':>10} {'N':>7} {'policy':>15} {'select':>8} {'kernel':>8} {'density':>7} {'relL2':>7}")
    for r in rows + official:
        print(f"{r['inputs']:>10} {r['n']:>7} {r.get('policy', r.get('method', ''))[:15]:>15} "
              f"{r.get('selection_ms', math.nan):8.2f} {r.get('kernel_ms', math.nan):8.2f} "
              f"{r.get('density', math.nan):7.3f} {r.get('rel_l2_vs_dense', math.nan):7.3f}")


if __name__ == "__main__":
    main()
