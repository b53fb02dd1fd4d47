"""Attention mass kept against density, per prefill rule, on a real model's own q/k (CPU; docs/quality.md).

    python profiling/quality/mass_study.py --model qwen2.5-coder-0.5b --length 16384 \
        --out docs/results/qwen_mass_study.txt

Captures every layer's post-RoPE q/k on one niah_multikey prompt (dense forward, float32; cached next to ``--out`` as
a ``.pt`` file, not committed), then for every rule plans each sparse layer (layer 0 and the dense segments excluded)
and measures, on 128 random query rows of the sparse segments per layer, the dense softmax mass inside the plan's
blocks. Prints, per rule: mean density (computed / causal key blocks), mean mass kept, the worst layer's mean, and
the worst head's mean over its rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from flexentropy.config import EntropyConfig  # noqa: E402
from flexentropy.policies import make_prefill  # noqa: E402
from flexentropy.prefill.plan import causal_blocks  # noqa: E402
from flexentropy.prefill.selection import dense_segments  # noqa: E402

GEOMETRY = dict(segment_size=512, block_size=128, dense_prefix=4096)
PROBE = dict(observation="probe", budget_rule="coverage")
RULES: dict[str, tuple[str, dict]] = {
    "paper, B_0 1024": ("entropy_paper", dict(base_budget=1024)),
    "paper, B_0 2048": ("entropy_paper", dict(base_budget=2048)),
    "paper observation, coverage 0.9": ("entropy", dict(observation="paper", budget_rule="coverage", coverage=0.9)),
    "probe observation, B_0 1024 (Alg. 3)": ("entropy", dict(observation="probe", budget_rule="fluctuation",
                                                            base_budget=1024)),
    "probe, coverage 0.7": ("entropy", dict(PROBE, coverage=0.7)),
    "probe, coverage 0.8 (default)": ("entropy", dict(PROBE, coverage=0.8)),
    "probe, coverage 0.9": ("entropy", dict(PROBE, coverage=0.9)),
    "probe (8), coverage 0.9": ("entropy", dict(PROBE, coverage=0.9, probes=8)),
    "xattention 0.9": ("xattention", dict(threshold=0.9)),
    "xattention 0.8": ("xattention", dict(threshold=0.8)),
}


def capture(model: str, length: int, path: Path) -> list[tuple[int, torch.Tensor, torch.Tensor, float]]:
    if path.is_file():
        return torch.load(path)
    from flexentropy.eval.capture import capture_qkv
    from flexentropy.eval.tasks import make_sample, sample_ids
    from flexentropy.runtime.loading import load_model

    loaded, tokenizer = load_model(model, device="cpu", dtype="float32")[:2]
    layers = capture_qkv(loaded, sample_ids(tokenizer, make_sample("niah_multikey", length, 0, tokenizer)))
    kept = [(layer.layer_idx, layer.q[0].half(), layer.k[0].half(), layer.scale) for layer in layers]
    torch.save(kept, path)
    return kept


def block_mass(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, scale: float, block: int) -> torch.Tensor:
    """Dense causal attention mass ``[Hq, R, C_B]`` of query rows ``rows`` per key block."""
    n, group = k.shape[1], q.shape[0] // k.shape[0]
    logits = torch.einsum("hrd,hnd->hrn", q[:, rows], k.repeat_interleave(group, 0)) * scale
    probs = torch.softmax(logits.masked_fill(torch.arange(n)[None, None] > rows[None, :, None], float("-inf")), -1)
    blocks = -(-n // block)
    return F.pad(probs, (0, blocks * block - n)).view(*probs.shape[:2], blocks, block).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = capture(args.model, args.length, args.out.with_suffix(".pt"))
    base = EntropyConfig(**GEOMETRY)
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in RULES}
    for layer_idx, q, k, scale in layers:
        if layer_idx in base.dense_layers:
            continue
        q, k = q.float(), k.float()
        n = q.shape[1]
        sparse = torch.nonzero((~dense_segments(n, base))[torch.arange(n) // base.segment_size]).flatten()
        rows = sparse[torch.randperm(len(sparse))[:128]].sort().values
        mass = block_mass(q, k, rows, scale, base.block_size)
        causal = int(causal_blocks(n, base.block_size).sum())
        for name, (policy, knobs) in RULES.items():
            own = {key: value for key, value in knobs.items() if key == "threshold"}
            config = base.replace(**{key: value for key, value in knobs.items() if key not in own})
            blocks = make_prefill(policy, config, **own).plan(q[None], k[None], layer_idx).blocks[0]
            kept = (mass * blocks[:, rows // 128, :].float()).sum(-1)                    # [Hq, R]
            results[name].append((float(blocks.float().sum((1, 2)).mean()) / causal, float(kept.mean()),
                                  float(kept.mean(-1).min())))
    lines = [f"{args.model}, niah_multikey sample 0, {n} tokens, {len(results[next(iter(RULES))])} sparse layers, "
             f"segments 512 / blocks 128 / dense prefix 4096; 128 query rows of the sparse segments per layer",
             f"{'rule':40s} {'density':>8s} {'mass kept':>10s} {'worst layer':>12s} {'worst head':>11s}"]
    for name, values in results.items():
        density, kept, worst = zip(*values, strict=True)
        lines.append(f"{name:40s} {statistics.fmean(density):8.3f} {statistics.fmean(kept):10.3f} "
                     f"{min(kept):12.3f} {min(worst):11.3f}")
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
