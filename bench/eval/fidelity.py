"""Attention fidelity on the real model's own q/k/v: how far each sparse prefill plan is from dense attention.

For every layer, query head and plan (prefill policy x budget ``B_0``), against dense causal attention ``P`` (the
softmax of the layer's own scaled logits):

* ``density``: computed / causal key blocks of the head's plan;
* ``mass_kept``: dense attention mass inside the plan's mask, ``sum_{j in mask(i)} P[i, j]``, averaged over queries;
* ``rel_error``: ``||O_sparse - O_dense||_F / ||O_dense||_F`` over the head's queries, where ``O_sparse`` is the
  attention restricted to the mask (``P * mask`` renormalised per row, the function the sparse kernel computes);
* the same two over the queries of *sparse* segments only (``*_sparse``): those outside the dense prefix and the
  dense last segment, whose rows are exact by construction.
"""

from __future__ import annotations

import csv
import itertools
import json
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.eval.capture import LayerQKV
from bench.eval.metrics import spearman
from bench.eval.plotting import pyplot, save
from bench.eval.resolve import make_prefill_policy, prefill_has_budget
from flexentropy.config import Q_BLOCK_SIZE, EntropyConfig
from flexentropy.policies.prefill.fixed import dense_segments
from flexentropy.sparse.plan import SparsePlan, causal_blocks

FIELDS = ("context", "policy", "budget", "layer", "head", "density", "mass_kept", "rel_error", "mass_kept_sparse",
          "rel_error_sparse")


def dense_probabilities(q: torch.Tensor, k: torch.Tensor, scale: float, first: int = 0) -> torch.Tensor:
    """Causal softmax attention ``[R, N]`` (float32) of one head's queries ``q [R, D]`` at positions
    ``first .. first + R - 1`` over the keys ``k [N, D]`` at ``0 .. N - 1``."""
    logits = (q.float() @ k.float().T) * scale
    positions = torch.arange(first, first + q.shape[0], device=q.device)
    causal = torch.arange(k.shape[0], device=q.device)[None, :] <= positions[:, None]
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


@dataclass
class BlockAttention:
    """One head's dense attention split by key block: enough to score any block plan without N x N masks.

    Attributes:
        mass: ``[R, C_B]`` dense attention probability of each query on each key block.
        partial: ``[R, C_B, Dv]`` each key block's contribution ``P[i, block] @ V[block]`` to the dense output.
    """

    mass: torch.Tensor
    partial: torch.Tensor

    @classmethod
    def of_head(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block_size: int,
                first: int = 0) -> BlockAttention:
        """From one head's ``q [R, D]`` (the queries at positions ``first ..``; all N by default), ``k [N, D]``,
        ``v [N, Dv]`` (causal, float32)."""
        n = k.shape[0]
        blocks = -(-n // block_size)
        pad = blocks * block_size - n
        probs = F.pad(dense_probabilities(q, k, scale, first), (0, pad)).view(q.shape[0], blocks, block_size)
        values = F.pad(v.float(), (0, 0, 0, pad)).view(blocks, block_size, -1)
        return cls(probs.sum(dim=-1), torch.einsum("icl,cld->icd", probs, values))

    def fidelity(self, selected: torch.Tensor, rows: torch.Tensor) -> dict[str, float]:
        """Mass kept and relative output error of a plan that lets query i read key block j where
        ``selected[i, j]`` (bool ``[R, C_B]``; causality inside blocks is already in the probabilities), over all
        queries and over the sparse-segment queries ``rows`` (bool ``[R]``; NaN when empty)."""
        weights = selected.float()
        kept = (self.mass * weights).sum(dim=-1)
        dense_out = self.partial.sum(dim=1)
        sparse_out = torch.einsum("ic,icd->id", weights, self.partial)
        sparse_out = sparse_out / kept.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
        diff = (sparse_out - dense_out).square().sum(dim=-1)
        norm = dense_out.square().sum(dim=-1)

        def error(select: torch.Tensor | slice) -> float:
            return float(diff[select].sum().sqrt() / norm[select].sum().sqrt().clamp_min(1e-30))

        any_rows = bool(rows.any())
        return {
            "mass_kept": float(kept.mean()),
            "rel_error": error(slice(None)),
            "mass_kept_sparse": float(kept[rows].mean()) if any_rows else float("nan"),
            "rel_error_sparse": error(rows) if any_rows else float("nan"),
        }


def sparse_rows(seq_len: int, config: EntropyConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """bool ``[N]``: queries whose segment selects blocks (not in the dense prefix nor the dense last segment)."""
    dense = dense_segments(seq_len, config, device)
    return ~dense.repeat_interleave(config.segment_size)[:seq_len]


def token_rows(plan: SparsePlan, head: int) -> torch.Tensor:
    """bool ``[N, C_B]``: the key blocks each query of ``head`` reads (its query block's row of the table)."""
    return plan.blocks[0, head].repeat_interleave(Q_BLOCK_SIZE, dim=0)[:plan.seq_len]


def layer_fidelity(layer: LayerQKV, plans: dict[tuple[str, int | None], SparsePlan], config: EntropyConfig
                   ) -> list[dict[str, Any]]:
    """Rows of `FIELDS` (without ``context``) for every head of ``layer`` and every plan ``(policy, budget)``."""
    q, k, v = layer.q[0], layer.k[0], layer.v[0]
    n, group = q.shape[1], q.shape[0] // k.shape[0]
    rows = sparse_rows(n, config, q.device)
    causal = int(causal_blocks(n, config.block_size, q.device).sum())
    out = []
    for head in range(q.shape[0]):
        attention = None
        for (policy, budget), plan in plans.items():
            row = {"policy": policy, "budget": budget, "layer": layer.layer_idx, "head": head}
            if plan.dense:
                out.append({**row, "density": 1.0, "mass_kept": 1.0, "rel_error": 0.0, "mass_kept_sparse": 1.0,
                            "rel_error_sparse": 0.0})
                continue
            if attention is None:
                kv = head // group
                attention = BlockAttention.of_head(q[head], k[kv], v[kv], layer.scale, config.block_size)
            density = float(plan.blocks[0, head].sum()) / causal
            out.append({**row, "density": density, **attention.fidelity(token_rows(plan, head), rows)})
    return out


def plan_layer(layer: LayerQKV, policies: Sequence[str], budgets: Sequence[int], config: EntropyConfig
               ) -> dict[tuple[str, int | None], SparsePlan]:
    """Every policy's plan of ``layer`` at every budget (one plan for a policy without a budget)."""
    plans = {}
    for policy in policies:
        for budget in budgets if prefill_has_budget(policy) else [None]:
            plans[policy, budget] = make_prefill_policy(policy, config, budget).plan(layer.q, layer.k,
                                                                                    layer.layer_idx)
    return plans


def summarise(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (policy, budget): means over contexts, sparse layers and heads of density, mass kept and error (plus
    the median and 90th percentile of the sparse-segment error)."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["density"] < 1.0 or row["policy"] == "dense":
            groups[row["policy"], row["budget"]].append(row)
    summary = []
    for (policy, budget), items in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        errors = sorted(r["rel_error_sparse"] for r in items)
        summary.append({
            "policy": policy, "budget": budget, "heads": len(items),
            **{f: statistics.fmean(r[f] for r in items) for f in FIELDS[5:]},
            "rel_error_sparse_median": statistics.median(errors),
            "rel_error_sparse_p90": errors[int(0.9 * (len(errors) - 1))],
        })
    return summary


def allocation(rows: Iterable[dict[str, Any]], policy: str = "entropy", baseline: str = "critiprefill"
               ) -> list[dict[str, Any]]:
    """Whether ``policy`` gives more blocks to the heads that need them: per ``B_0``, the Spearman correlation over
    (context, layer, head) of sparse layers between ``policy``'s per-head density and the error ``baseline`` (one
    budget for every head) makes on that head. Positive: budgets go where a uniform budget loses most."""
    density: dict[tuple, float] = {}
    error: dict[tuple, float] = {}
    for r in rows:
        key = (r["budget"], r["context"], r["layer"], r["head"])
        if r["policy"] == policy and r["density"] < 1.0:
            density[key] = r["density"]
        elif r["policy"] == baseline and r["density"] < 1.0:
            error[key] = r["rel_error_sparse"]
    out = []
    for budget in sorted({k[0] for k in density}):
        keys = [k for k in density if k[0] == budget and k in error]
        if len(keys) > 1:
            out.append({"budget": budget, "heads": len(keys),
                        "spearman": spearman([density[k] for k in keys], [error[k] for k in keys])})
    return out


def at_density(summary: list[dict[str, Any]], policy: str, field: str, density: float) -> float | None:
    """``field`` of ``policy`` linearly interpolated at ``density`` between its budgets (None outside its range)."""
    points = sorted((s["density"], s[field]) for s in summary if s["policy"] == policy and s["budget"] is not None)
    for (d0, v0), (d1, v1) in itertools.pairwise(points):
        if d0 <= density <= d1:
            return v0 if d1 == d0 else v0 + (v1 - v0) * (density - d0) / (d1 - d0)
    return None


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``fidelity.csv`` written by `write_results`, with their types back."""
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for name in ("context", "layer", "head"):
            row[name] = int(row[name])
        row["budget"] = int(row["budget"]) if row["budget"] else None
        for name in FIELDS[5:]:
            row[name] = float(row[name])
    return rows


def write_results(rows: list[dict[str, Any]], summary: list[dict[str, Any]], meta: dict[str, Any], out: Path
                  ) -> None:
    """``fidelity.csv`` (every head), ``fidelity_summary.json`` (per policy and budget, with ``meta``)."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "fidelity.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
    (out / "fidelity_summary.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=2),
                                               encoding="utf-8")


def plot(rows: list[dict[str, Any]], summary: list[dict[str, Any]], out: Path, heatmap_budget: int) -> list[Path]:
    """``fidelity_vs_density.png`` (error and mass kept against density, per policy) and ``fidelity_heatmaps.png``
    (layer x head maps at ``heatmap_budget``). Returns the files written."""
    plt = pyplot()
    import numpy as np

    policies = sorted({s["policy"] for s in summary if s["budget"] is not None})
    colours = dict(zip(policies, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, field, label in ((axes[0], "rel_error_sparse", "relative L2 error of attention output"),
                             (axes[1], "mass_kept_sparse", "dense attention mass kept")):
        for policy in policies:
            heads = [r for r in rows if r["policy"] == policy and r["density"] < 1.0]
            ax.scatter([r["density"] for r in heads], [r[field] for r in heads], s=3, alpha=0.12,
                       color=colours[policy], rasterized=True)
            line = [s for s in summary if s["policy"] == policy]
            ax.plot([s["density"] for s in line], [s[field] for s in line], "o-", color=colours[policy],
                    label=policy, lw=2)
            for s in line:
                ax.annotate(f"{s['budget']}", (s["density"], s[field]), textcoords="offset points", xytext=(4, 4),
                            fontsize=7, color=colours[policy])
        ax.set_xlabel("density (computed / causal key blocks, per head)")
        ax.set_ylabel(f"{label}\n(sparse-segment queries)")
        ax.grid(alpha=0.3)
        ax.legend(title="mean per policy, labels: B_0")
    axes[0].set_yscale("log")
    fig.suptitle("Attention fidelity on SmolLM2-135M's own q/k/v (dots: one layer x head x context)")
    files = [save(fig, out / "fidelity_vs_density.png")]

    layers = max(r["layer"] for r in rows) + 1
    heads = max(r["head"] for r in rows) + 1

    def grid(policy: str, field: str) -> np.ndarray:
        cells = defaultdict(list)
        for r in rows:
            if r["policy"] == policy and r["budget"] == heatmap_budget:
                cells[r["layer"], r["head"]].append(r[field])
        return np.array([[statistics.fmean(cells[layer, h]) if cells[layer, h] else np.nan for h in range(heads)]
                         for layer in range(layers)])

    panels = [(p, f) for p in policies if ":" not in p for f in ("density", "rel_error_sparse")]
    fig, axes = plt.subplots(1, len(panels), figsize=(2.3 * len(panels), 6.5), squeeze=False)
    for ax, (policy, field) in zip(axes[0], panels, strict=True):
        data = grid(policy, field)
        image = ax.imshow(data, aspect="auto", cmap="viridis" if field == "density" else "magma",
                          vmin=0, vmax=1 if field == "density" else np.nanmax([grid(p, field) for p in policies]))
        ax.set_title(f"{policy}\n{field.replace('_sparse', '')}", fontsize=9)
        ax.set_xlabel("query head")
        ax.set_ylabel("layer")
        fig.colorbar(image, ax=ax, fraction=0.08)
    fig.suptitle(f"Per layer and head at B_0 = {heatmap_budget} (mean over contexts; layer 0 is dense)")
    files.append(save(fig, out / "fidelity_heatmaps.png"))
    return files
