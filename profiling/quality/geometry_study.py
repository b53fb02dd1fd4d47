"""Attention-output error against density per segment and key-block size, the default rule (probe observation,
coverage budgets) on a real model's own q/k/v (CPU; docs/quality.md).

    python profiling/quality/geometry_study.py --out runs/qwen_geometry_study.txt  (docs/results/qwen_cpu_studies.md)

Uses `mass_study`'s capture (Qwen2.5-Coder-0.5B, one 16k niah_multikey prompt, cached as
``docs/results/qwen_mass_study_v.pt``). Per sparse layer, 128 random query rows between the dense prefix (4096) and
the last 1024 tokens (sparse under every geometry); per geometry and coverage: density (computed / causal key
blocks), the dense softmax mass inside the plan's blocks, and the relative L2 error of the attention output against
dense (mean over layers, heads and rows; worst: the worst layer's mean).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mass_study import block_mass, capture, dense_rows, output_error, study_arguments  # noqa: E402

from flexentropy.config import Q_BLOCK_SIZE, EntropyConfig  # noqa: E402
from flexentropy.policies import make_prefill  # noqa: E402
from flexentropy.sparse.plan import causal_blocks  # noqa: E402

GEOMETRIES = [(512, 128, 16), (256, 128, 16), (256, 128, 8), (256, 64, 16), (512, 64, 16), (256, 64, 8), (128, 64, 8)]
"""(segment size, key block size, probes per segment)."""
COVERAGES = (0.7, 0.8, 0.9)


def main() -> None:
    args = study_arguments(__doc__.splitlines()[0])
    layers = capture(args.model, args.length, args.out.parent / "qwen_mass_study_v.pt")
    torch.manual_seed(0)
    results: dict[tuple, list[tuple[float, float, float]]] = {}
    for layer_idx, q, k, v, scale in layers:
        if layer_idx == 0:
            continue
        q, k, v = q.float(), k.float(), v.float()
        n, group = q.shape[1], q.shape[0] // k.shape[0]
        rows = torch.arange(4096, n - 1024)[torch.randperm(n - 1024 - 4096)[:128]].sort().values
        logits = dense_rows(q, k, rows, scale)
        probs = torch.softmax(logits, -1)
        values = v.repeat_interleave(group, 0)
        dense_out = probs @ values
        for segment, block, probes in GEOMETRIES:
            mass, causal = block_mass(probs, block), int(causal_blocks(n, block).sum())
            for coverage in COVERAGES:
                config = EntropyConfig(segment_size=segment, block_size=block, dense_prefix=4096, probes=probes,
                                       coverage=coverage)
                blocks = make_prefill("entropy", config).plan(q[None], k[None], layer_idx).blocks[0]
                selected = blocks[:, rows // Q_BLOCK_SIZE, :]
                error = output_error(logits, selected, values, rows, block, dense_out)
                results.setdefault((segment, block, probes, coverage), []).append(
                    (float(blocks.float().sum((1, 2)).mean()) / causal, float((mass * selected.float()).sum(-1).mean()),
                     float(error.mean())))
        print(f"layer {layer_idx}", flush=True)
    lines = [f"{args.model}, niah_multikey sample 0, {n} tokens, 23 sparse layers, dense prefix 4096, the default rule "
             "(probe observation, coverage budgets); 128 query rows per layer in [4096, N - 1024)",
             f"{'segment / block / probes':>24s} {'coverage':>8s} {'density':>8s} {'mass kept':>9s} {'out err':>8s} "
             f"{'worst layer':>11s}"]
    for (segment, block, probes, coverage), rows_ in results.items():
        density, kept, error = zip(*rows_, strict=True)
        lines.append(f"{segment:>10d} / {block:>4d} / {probes:>3d} {coverage:8.2f} {statistics.fmean(density):8.3f} "
                     f"{statistics.fmean(kept):9.3f} {statistics.fmean(error):8.3f} {max(error):11.3f}")
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
