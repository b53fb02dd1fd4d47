"""The paper's motivation figures (sec. 3, Fig. 1-2) from the real model: per-head segment entropy, rigid/dynamic
head maps over several contexts, and how much those maps change between contexts.

For each context and layer, the segment entropy ``e[h, s]`` of the observation attention (design.md §1.2-1.3, the same
numbers `select_blocks` budgets from) is computed from the model's own post-RoPE q/k. A head's *max entropy* is
``max_{s >= 1} e[h, s]``; it is *rigid* when that is below the threshold (paper: 1e-5), else *dynamic*. Because a
135M model's heads may never fall under 1e-5, the class change between contexts is also reported at data-driven
thresholds (quantiles of all max entropies), and the stability of the whole map as a rank correlation.
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.eval.capture import LayerQKV
from bench.eval.metrics import spearman
from bench.eval.plotting import pyplot, save
from flexentropy import allocate_budgets, observation_attention, segment_entropy
from flexentropy.config import MASS_OBSERVATIONS, EntropyConfig
from flexentropy.settings import parse_settings

QUANTILES = (0.1, 0.25, 0.5)
"""Data-driven rigid thresholds: these quantiles of every (context, layer, head) max entropy."""


def entropy_profile(layers: list[LayerQKV], config: EntropyConfig) -> torch.Tensor:
    """Segment entropy of every layer and query head: float32 ``[layers, Hq, C_S]`` (segment 0 is 0)."""
    rows = []
    for layer in layers:
        a_obs = observation_attention(layer.q, layer.k, config.segment_size, config.block_size,
                                      observation=config.observation, scale=config.observation_scale,
                                      probes=config.probes)
        rows.append(segment_entropy(a_obs, normalise=config.observation in MASS_OBSERVATIONS)[0])
    return torch.stack(rows)


def max_entropy(profile: torch.Tensor) -> torch.Tensor:
    """``[layers, Hq]``: each head's largest segment entropy over segments 1.. (segment 0 has no candidates)."""
    return profile[..., 1:].amax(dim=-1)


def budget_map(profile: torch.Tensor, config: EntropyConfig) -> torch.Tensor:
    """``[layers, Hq]``: each head's mean budget over segments, in units of ``B_0`` (design.md §1.4 on ``profile``)."""
    return allocate_budgets(profile, config).mean(dim=-1) / config.base_budget


def class_changes(maps: torch.Tensor, threshold: float) -> dict[str, float]:
    """How the rigid/dynamic split moves between contexts; ``maps`` ``[contexts, layers, Hq]`` max entropies.

    Returns the share of rigid heads; the mean over context pairs of the share of heads whose class differs, and
    what that share would be if each context drew its rigid heads independently at its own rigid share
    (``p_a (1 - p_b) + p_b (1 - p_a)``: a map that carries no head identity); and the share of heads that are rigid
    in some context and dynamic in another.
    """
    rigid = maps < threshold
    share = rigid.float().mean(dim=(1, 2))
    pairs = list(itertools.combinations(range(maps.shape[0]), 2))
    flips = [float((rigid[a] != rigid[b]).float().mean()) for a, b in pairs]
    independent = [float(share[a] * (1 - share[b]) + share[b] * (1 - share[a])) for a, b in pairs]
    return {
        "threshold": threshold,
        "rigid_share": float(rigid.float().mean()),
        "pairwise_change": statistics.fmean(flips) if flips else 0.0,
        "independent_change": statistics.fmean(independent) if independent else 0.0,
        "ever_changes": float((rigid.any(dim=0) & ~rigid.all(dim=0)).float().mean()),
    }


def rank_correlation(maps: torch.Tensor) -> float:
    """Mean Spearman correlation of the max-entropy maps over context pairs (1: the same head order everywhere)."""
    values = [spearman(maps[a].flatten().tolist(), maps[b].flatten().tolist())
              for a, b in itertools.combinations(range(maps.shape[0]), 2)]
    return statistics.fmean(values) if values else 1.0


def analyse(profiles: list[torch.Tensor], config: EntropyConfig) -> dict[str, Any]:
    """Class-change statistics of the contexts' profiles at the paper's threshold and at `QUANTILES`."""
    maps = torch.stack([max_entropy(p) for p in profiles])
    flat = maps.flatten().double()
    thresholds = {"paper": config.entropy_threshold,
                  **{f"q{int(100 * q)}": float(torch.quantile(flat, q)) for q in QUANTILES}}
    return {
        "contexts": len(profiles),
        "max_entropy_min": float(flat.min()),
        "max_entropy_median": float(flat.median()),
        "max_entropy_max": float(flat.max()),
        "segments_below_threshold": float((torch.cat([p[..., 1:].flatten() for p in profiles])
                                           < config.entropy_threshold).float().mean()),
        "rank_correlation": rank_correlation(maps),
        "classes": {name: class_changes(maps, t) for name, t in thresholds.items()},
    }


def write_results(profiles: list[torch.Tensor], contexts: list[dict[str, Any]], stats: dict[str, Any],
                  config: EntropyConfig, kv_heads: int, out: Path) -> Path:
    """``entropy_maps.json``: statistics, contexts, the config, and every profile (layers x heads x segments)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "entropy_maps.json"
    data = {"stats": stats, "contexts": contexts, "kv_heads": kv_heads,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()},
            "profiles": [[[[round(float(e), 8) for e in head] for head in layer] for layer in p] for p in profiles]}
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def read_results(path: Path) -> tuple[list[torch.Tensor], list[dict[str, Any]], EntropyConfig, int]:
    """``(profiles, contexts, config, kv_heads)`` of an ``entropy_maps.json`` written by `write_results`."""
    data = json.loads(path.read_text(encoding="utf-8"))
    config = parse_settings(data["config"], f"{path}: config").config
    return [torch.tensor(p) for p in data["profiles"]], data["contexts"], config, data["kv_heads"]


def plot(profiles: list[torch.Tensor], contexts: list[dict[str, Any]], stats: dict[str, Any],
         config: EntropyConfig, out: Path, kv_heads: int) -> list[Path]:
    """Fig. 1 (entropy curves), Fig. 2 (head maps per context, also GQA-averaged), the max-entropy histogram and
    the per-head budget map. Returns the files written."""
    plt = pyplot()
    import numpy as np
    from matplotlib.colors import LogNorm

    files = []
    first = profiles[0].numpy()
    floor = 1e-9
    peaks = first[..., 1:].max(axis=-1)
    spread = first[..., 1:].std(axis=-1) / np.maximum(first[..., 1:].mean(axis=-1), floor)
    order = np.dstack(np.unravel_index(np.argsort(-spread, axis=None), spread.shape))[0]
    lowest = np.dstack(np.unravel_index(np.argsort(peaks, axis=None), peaks.shape))[0]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, picks, title in ((axes[0], order[:6], "(a) most fluctuating heads (dynamic)"),
                             (axes[1], lowest[:6], "(b) lowest max-entropy heads (closest to rigid)")):
        for layer, head in picks:
            ax.plot(np.arange(1, first.shape[-1]), np.maximum(first[layer, head, 1:], floor), "o-", ms=3,
                    label=f"L{layer} H{head} (max {peaks[layer, head]:.2g})")
        ax.axhline(config.entropy_threshold, color="k", ls="--", lw=1, label="paper threshold 1e-5")
        ax.set_yscale("log")
        ax.set_xlabel(f"segment (L_S = {config.segment_size} tokens)")
        ax.set_title(title)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("segment entropy of A_obs (nats)")
    fig.suptitle(f"Fig. 1 on SmolLM2-135M: per-head segment entropy ({contexts[0]['label']})")
    files.append(save(fig, out / "fig1_entropy_curves.png"))

    maps = [max_entropy(p).numpy() for p in profiles]
    shown = min(len(maps), 4)
    vmin, vmax = max(min(m.min() for m in maps), floor), max(m.max() for m in maps)
    fig, axes = plt.subplots(2, shown, figsize=(2.6 * shown + 1.5, 9), squeeze=False, layout="constrained")
    for i in range(shown):
        group = maps[i].reshape(maps[i].shape[0], kv_heads, -1).mean(axis=-1)
        for row, data, name in ((0, maps[i], "query head"), (1, group, "KV head (GQA-group mean)")):
            ax = axes[row, i]
            image = ax.imshow(np.maximum(data, floor), aspect="auto", cmap="viridis",
                              norm=LogNorm(vmin=vmin, vmax=vmax))
            rigid = np.argwhere(data < config.entropy_threshold)
            ax.scatter(rigid[:, 1], rigid[:, 0], marker="x", color="red", s=12)
            ax.set_xticks(range(data.shape[1]))
            ax.set_title(contexts[i]["label"], fontsize=8)
            ax.set_xlabel(name, fontsize=8)
            ax.set_ylabel("layer")
    fig.colorbar(image, ax=axes, fraction=0.04, label="max segment entropy (nats, log scale); red x: rigid (< 1e-5)")
    fig.suptitle("Fig. 2 on SmolLM2-135M: max segment entropy per head, per context")
    files.append(save(fig, out / "fig2_head_maps.png"))

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    values = np.concatenate([m.ravel() for m in maps])
    segments = np.concatenate([p[..., 1:].numpy().ravel() for p in profiles])
    for ax, data, what in ((axes[0], values, f"max over segments, {maps[0].size} heads x {len(maps)} contexts"),
                           (axes[1], segments, "every segment >= 1 of every head and context")):
        ax.hist(np.log10(np.maximum(data, floor)), bins=60, color="tab:blue")
        ax.axvline(np.log10(config.entropy_threshold), color="k", ls="--", label="paper threshold 1e-5")
        ax.set_xlabel("log10 segment entropy (nats; 1e-9 floor)")
        ax.set_title(what, fontsize=10)
        below = float((data < config.entropy_threshold).mean())
        ax.legend(title=f"{100 * below:.1f}% below 1e-5", fontsize=8)
    quantiles = {name: item["threshold"] for name, item in stats["classes"].items() if name != "paper"}
    for i, threshold in enumerate(quantiles.values()):
        axes[0].axvline(np.log10(threshold), color="tab:orange", ls=":", lw=1,
                        label="quantile thresholds " + ", ".join(f"{n} {t:.2f}" for n, t in quantiles.items())
                        if i == 0 else None)
    axes[0].legend(title=f"{100 * float((values < config.entropy_threshold).mean()):.1f}% below 1e-5", fontsize=8)
    axes[0].set_ylabel("count")
    fig.suptitle("Segment entropy of the observation attention (rigid threshold and quantile thresholds)")
    files.append(save(fig, out / "max_entropy_hist.png"))

    budgets = budget_map(profiles[0], config).numpy()
    fig, ax = plt.subplots(figsize=(4, 6))
    image = ax.imshow(budgets, aspect="auto", cmap="cividis", vmin=1, vmax=config.max_budget_factor)
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_title(f"mean budget / B_0 per head (Alg. 3)\n{contexts[0]['label']}; layer 0 runs dense", fontsize=9)
    fig.colorbar(image, ax=ax)
    files.append(save(fig, out / "budget_map.png"))
    return files
