"""Attention mass kept and attention-output error against density, per prefill rule, on a real model's own q/k/v
(CPU; docs/quality.md).

    python profiling/quality/mass_study.py --model qwen2.5-coder-0.5b --length 16384 \
        --out runs/qwen_mass_study.txt [--rules "seg 256"]  (docs/results/qwen_cpu_studies.md)

Captures every layer's post-RoPE q/k/v on one niah_multikey prompt (dense forward, float32; cached next to ``--out``
as ``<stem>_v.pt``, not committed), then for every rule plans each sparse layer (layer 0 and the dense segments
excluded) and measures, on 128 random query rows of the sparse segments per layer, the dense softmax mass inside the
plan's blocks. Prints, per rule: mean density (computed / causal key blocks), mean mass kept, the worst layer's mean,
the worst head's mean over its rows; then the relative attention-output error ``||o_plan - o_dense|| / ||o_dense||``
(mean over layers, heads and rows, and the worst layer's mean) of softmax attention restricted to the plan's blocks,
without and with the block-mean tail: every unselected key block that lies entirely before the row's query block
enters the softmax as one representative (mean key, mean value, logit ``scale * q . mean_k + log(block_size)``) next
to the exact logits of the selected keys. Last, the per-layer output error of a few rules.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from flexentropy.config import Q_BLOCK_SIZE, EntropyConfig  # noqa: E402
from flexentropy.policies import make_prefill  # noqa: E402
from flexentropy.policies.prefill.fixed import dense_segments  # noqa: E402
from flexentropy.sparse.plan import causal_blocks  # noqa: E402

GEOMETRY = dict(segment_size=512, block_size=128, dense_prefix=4096)
PROBE = dict(observation="probe", budget_rule="coverage")
SEG256 = dict(segment_size=256)   # the default's geometry and coverage; the base GEOMETRY has segments of 512
POOLED = dict(SEG256, observation="pooled")


def _depth(layer: int, late: float) -> float:
    """Coverage of a depth schedule: 0.9 in layers 1-5, ``late`` after."""
    return 0.9 if layer <= 5 else late


Knobs = dict | Callable[[int], dict]  # a rule's knobs, or per layer index (a depth schedule)
RULES: dict[str, tuple[str, Knobs]] = {
    "paper, B_0 1024": ("entropy_paper", dict(base_budget=1024)),
    "paper, B_0 2048": ("entropy_paper", dict(base_budget=2048)),
    "paper observation, coverage 0.9": ("entropy", dict(observation="paper", budget_rule="coverage", coverage=0.9)),
    "probe observation, B_0 1024 (Alg. 3)": ("entropy", dict(observation="probe", budget_rule="fluctuation",
                                                            base_budget=1024)),
    "probe, coverage 0.6": ("entropy", dict(PROBE, coverage=0.6)),
    "probe, coverage 0.7": ("entropy", dict(PROBE, coverage=0.7)),
    "probe, coverage 0.8 (default)": ("entropy", dict(PROBE, coverage=0.8)),
    "probe, coverage 0.9": ("entropy", dict(PROBE, coverage=0.9)),
    "probe, coverage 0.95": ("entropy", dict(PROBE, coverage=0.95)),
    "probe, cov. 0.9 layers 1-5, 0.7 after": ("entropy", lambda layer: dict(PROBE, coverage=_depth(layer, 0.7))),
    "probe, cov. 0.9 layers 1-5, 0.8 after": ("entropy", lambda layer: dict(PROBE, coverage=_depth(layer, 0.8))),
    "probe (8), coverage 0.9": ("entropy", dict(PROBE, coverage=0.9, probes=8)),
    "xattention 0.9": ("xattention", dict(threshold=0.9)),
    "xattention 0.8": ("xattention", dict(threshold=0.8)),
    # the cheap observations of docs/quality.md, at the default's geometry (segments of 256, coverage 0.8)
    "seg 256: probe 16 (default)": ("entropy", SEG256),
    "seg 256: probe 8": ("entropy", dict(SEG256, probes=8)),
    "seg 256: probe 4": ("entropy", dict(SEG256, probes=4)),
    "seg 256: pooled 16": ("entropy", POOLED),
    "seg 256: pooled 32": ("entropy", dict(POOLED, probes=32)),
    **{f"seg 256: pooled 16, coverage {c}": ("entropy", dict(POOLED, coverage=c)) for c in (0.7, 0.75, 0.85, 0.9)},
}
PER_LAYER = ("probe, coverage 0.7", "probe, coverage 0.8 (default)", "probe, coverage 0.9")


def capture(model: str, length: int, path: Path) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    if path.is_file():
        return torch.load(path)
    from bench.eval.capture import capture_qkv
    from bench.eval.tasks import make_sample, sample_ids
    from bench.loading import load_model

    loaded, tokenizer = load_model(model, device="cpu", dtype="float32")[:2]
    layers = capture_qkv(loaded, sample_ids(tokenizer, make_sample("niah_multikey", length, 0, tokenizer)))
    kept = [(layer.layer_idx, layer.q[0].half(), layer.k[0].half(), layer.v[0].half(), layer.scale)
            for layer in layers]
    torch.save(kept, path)
    return kept


def dense_rows(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal logits ``[Hq, R, N]`` of query rows ``rows`` (``-inf`` above the diagonal); ``k`` is ``[Hkv, N, D]``."""
    n, group = k.shape[1], q.shape[0] // k.shape[0]
    logits = torch.einsum("hrd,hnd->hrn", q[:, rows], k.repeat_interleave(group, 0)) * scale
    return logits.masked_fill(torch.arange(n)[None, None] > rows[None, :, None], float("-inf"))


def block_mass(probs: torch.Tensor, block: int) -> torch.Tensor:
    """Dense attention mass ``[Hq, R, C_B]`` per key block from the rows' probabilities ``probs [Hq, R, N]``."""
    n = probs.shape[-1]
    blocks = -(-n // block)
    return F.pad(probs, (0, blocks * block - n)).view(*probs.shape[:2], blocks, block).sum(-1)


def query_start(rows: torch.Tensor) -> torch.Tensor:
    """First token ``[R]`` of each row's query block."""
    return rows // Q_BLOCK_SIZE * Q_BLOCK_SIZE


def output_error(logits: torch.Tensor, selected: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, block: int,
                 dense_out: torch.Tensor, tail: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Relative output error ``[Hq, R]`` of attention restricted to the ``selected [Hq, R, C_B]`` key blocks.

    ``logits [Hq, R, N]`` are the rows' causal logits, ``v [Hq, N, D]`` the values (expanded to query heads),
    ``dense_out [Hq, R, D]`` the dense output. With ``tail = (tail_logits [Hq, R, C_B], block_values [Hq, C_B, D])``
    every unselected block ending before the row's query block joins the softmax as one representative.
    """
    n = logits.shape[-1]
    keep = selected.repeat_interleave(block, -1)[..., :n]
    scores, values = logits.masked_fill(~keep, float("-inf")), v
    if tail is not None:
        before = ((torch.arange(selected.shape[-1]) + 1) * block)[None, None] <= query_start(rows)[None, :, None]
        scores = torch.cat([scores, tail[0].masked_fill(selected | ~before, float("-inf"))], -1)
        values = torch.cat([v, tail[1]], -2)
    out = torch.softmax(scores, -1) @ values
    return (out - dense_out).norm(dim=-1) / dense_out.norm(dim=-1)


def study_arguments(description: str) -> argparse.Namespace:
    """The studies' arguments: the model alias, the prompt length, the output text file (the capture sits beside it)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rules", nargs="*", default=None, help="run only the rules whose name contains one of these")
    return parser.parse_args()


def main() -> None:
    args = study_arguments(__doc__.splitlines()[0])
    torch.manual_seed(0)
    layers = capture(args.model, args.length, args.out.with_name(f"{args.out.stem}_v.pt"))
    base = EntropyConfig(**GEOMETRY)
    rules = {name: rule for name, rule in RULES.items()
             if args.rules is None or any(part in name for part in args.rules)}
    results: dict[str, list[tuple[float, ...]]] = {name: [] for name in rules}
    layer_ids, partial = [], 0
    for layer_idx, q, k, v, scale in layers:
        if layer_idx in base.dense_layers:
            continue
        layer_ids.append(layer_idx)
        q, k, v = q.float(), k.float(), v.float()
        n, group, block = q.shape[1], q.shape[0] // k.shape[0], base.block_size
        sparse = torch.nonzero((~dense_segments(n, base))[torch.arange(n) // base.segment_size]).flatten()
        rows = sparse[torch.randperm(len(sparse))[:128]].sort().values
        logits = dense_rows(q, k, rows, scale)
        probs = torch.softmax(logits, -1)
        mass = block_mass(probs, block)
        v = v.repeat_interleave(group, 0)                                                 # [Hq, N, D]
        dense_out = probs @ v
        full = n // block                                                                 # whole blocks only
        means = [x[:, : full * block].unflatten(1, (full, block)).mean(2) for x in (k, v)]  # [H, C_B, D]
        tail_logits = F.pad(torch.einsum("hrd,hjd->hrj", q[:, rows], means[0].repeat_interleave(group, 0)) * scale
                            + torch.log(torch.tensor(float(block))), (0, mass.shape[-1] - full), value=float("-inf"))
        tail = (tail_logits, F.pad(means[1], (0, 0, 0, mass.shape[-1] - full)))
        causal = int(causal_blocks(n, block).sum())
        for name, (policy, knobs) in rules.items():
            knobs = knobs(layer_idx) if callable(knobs) else knobs
            own = {key: value for key, value in knobs.items() if key == "threshold"}
            config = base.replace(**{key: value for key, value in knobs.items() if key not in own})
            blocks = make_prefill(policy, config, **own).plan(q[None], k[None], layer_idx).blocks[0]
            selected = blocks[:, rows // Q_BLOCK_SIZE, :]                                 # [Hq, R, C_B]
            kept = (mass * selected.float()).sum(-1)                                      # [Hq, R]
            # unselected blocks holding keys visible to the row that do not end before its query block
            first = torch.arange(mass.shape[-1])[None, None] * block
            partial += int((~selected & (first <= rows[None, :, None])
                            & (first + block > query_start(rows)[None, :, None])).sum())
            error = output_error(logits, selected, v, rows, block, dense_out)
            error_tail = output_error(logits, selected, v, rows, block, dense_out, tail)
            results[name].append((float(blocks.float().sum((1, 2)).mean()) / causal, float(kept.mean()),
                                  float(kept.mean(-1).min()), float(error.mean()), float(error_tail.mean())))
    lines = [f"{args.model}, niah_multikey sample 0, {n} tokens, {len(layer_ids)} sparse layers, "
             f"segments 512 (256 in the rules named 'seg 256') / blocks 128 / dense prefix 4096; 128 query rows of "
             "the sparse segments per layer",
             "out err: ||o_plan - o_dense|| / ||o_dense|| (mean; worst: the worst layer's mean); +tail: unselected "
             "blocks before the row's query block as one mean-key / mean-value representative each",
             f"{'rule':40s} {'density':>8s} {'mass kept':>10s} {'worst layer':>12s} {'worst head':>11s} "
             f"{'out err':>8s} {'worst':>6s} {'+tail':>6s} {'worst':>6s}"]
    for name, values in results.items():
        density, kept, worst, error, error_tail = zip(*values, strict=True)
        lines.append(f"{name:40s} {statistics.fmean(density):8.3f} {statistics.fmean(kept):10.3f} "
                     f"{min(kept):12.3f} {min(worst):11.3f} {statistics.fmean(error):8.3f} {max(error):6.3f} "
                     f"{statistics.fmean(error_tail):6.3f} {max(error_tail):6.3f}")
    lines.append(f"unselected blocks partially visible to a row (not covered by the tail): {partial}")
    per_layer = [name for name in PER_LAYER if name in rules] or list(rules)[:3]
    lines += ["", "per-layer out err (without / with tail)",
              f"{'layer':>5s} " + " ".join(f"{name.split(': ')[-1].split(', ', 1)[-1].split(' (')[0]:>17s}"
                                      for name in per_layer)]
    for i, layer_idx in enumerate(layer_ids):
        lines.append(f"{layer_idx:5d} " + " ".join(f"{results[name][i][3]:8.3f}/{results[name][i][4]:<8.3f}"
                                                  for name in per_layer))
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
