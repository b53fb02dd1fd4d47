"""Plots of the committed benchmark JSON under ``docs/results/`` (one PNG per JSON).

    python profiling/plots.py docs/results/prefill_attention_h200_flash.json docs/results/end_to_end.json \
        docs/results/decode_latency.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

PREFILL_SERIES = [("sdpa_cudnn_ms", "cuDNN SDPA"), ("sdpa_flash_ms", "SDPA flash"), ("flex_dense_ms", "dense flex"),
                  ("sparse_total_ms", "flexentropy (all stages)"), ("sparse_kernel_ms", "flexentropy kernel only")]


def plot_prefill(data: dict, out: Path) -> None:
    kinds = sorted({r["inputs"] for r in data["rows"]})
    fig, axes = plt.subplots(1, len(kinds) + 1, figsize=(6 * (len(kinds) + 1), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=False):
        rows = sorted((r for r in data["rows"] if r["inputs"] == kind), key=lambda r: r["n"])
        ns = [r["n"] // 1024 for r in rows]
        for key, label in PREFILL_SERIES:
            if all(r.get(key) for r in rows):
                ax.plot(ns, [r[key] for r in rows], marker="o", label=label)
        for r in rows:
            ax.annotate(f"{100 * r['density']:.1f}%", (r["n"] // 1024, r["sparse_total_ms"]),
                        textcoords="offset points", xytext=(4, -12), fontsize=8)
        ax.set(xscale="log", yscale="log", xlabel="context (k tokens)", ylabel="ms per layer",
               title=f"{kind} inputs (labels: density)")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _plot_selection_share(axes[0][-1], data["rows"])
    env = data.get("environment", {})
    fig.suptitle(f"One prefill attention layer, Llama-3.1-8B shape, {env.get('gpu', '')}, torch {env.get('torch', '')}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def _plot_selection_share(ax: plt.Axes, rows: list[dict]) -> None:
    """Share of the whole sparse call spent outside the kernel (selection + BlockMask), against the 10% target."""
    for kind in sorted({r["inputs"] for r in rows}):
        sel = sorted((r for r in rows if r["inputs"] == kind), key=lambda r: r["n"])
        ax.plot([r["n"] // 1024 for r in sel], [100 * r["selection_ms"] / r["sparse_total_ms"] for r in sel],
                marker="o", label=f"{kind} inputs")
    ax.axhline(10, color="grey", linestyle="--", label="target (10%)")
    ns = sorted({r["n"] // 1024 for r in rows})
    ax.set(xscale="log", xlabel="context (k tokens)", ylabel="% of sparse attention time",
           title="selection overhead (everything but the kernel)")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


E2E_PANELS = [("ttft_s", "time to first token (s)"), ("prefill_plus_new_s", "prefill + {new} tokens (s)"),
              ("decode_step_ms", "mean decode step (ms)"), ("peak_prefill_gib", "peak GPU memory, prefill (GiB)")]


def plot_end_to_end(data: dict, out: Path) -> None:
    rows = data["rows"]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(1, len(E2E_PANELS), figsize=(5 * len(E2E_PANELS), 4.2))
    ns = sorted({r["n"] // 1024 for r in rows})
    for ax, (key, label) in zip(axes, E2E_PANELS, strict=True):
        for variant in variants:
            sel = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["n"])
            ax.plot([r["n"] // 1024 for r in sel], [r[key] for r in sel], marker="o", label=variant,
                    linestyle="--" if variant.startswith("dense") else "-")
        ax.set(xscale="log", xlabel="context (k tokens)", title=label.format(new=data["new_tokens"]))
        if key in ("ttft_s", "prefill_plus_new_s"):
            ax.set_yscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    env = data.get("environment", {})
    fig.suptitle(f"{data['model']}, {data['layers']} layers, {env.get('gpu', '')}, torch {env.get('torch', '')}, "
                 f"transformers {env.get('transformers', '')}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def plot_decode(data: dict, out: Path) -> None:
    rows = data["results"]
    caches = sorted({r["cache"] for r in rows})
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for cache in caches:
        sel = sorted((r for r in rows if r["cache"] == cache), key=lambda r: r["context"])
        ns = [r["context"] // 1024 for r in sel]
        ax_t.plot(ns, [r["median_ms"] for r in sel], marker="o", label=cache)
        ax_m.plot(ns, [r["kv_bytes"] / 2**20 for r in sel], marker="o", label=cache)
    ax_t.set(xlabel="context (k tokens)", ylabel="ms per decode step (update + attention)", xscale="log")
    ax_m.set(xlabel="context (k tokens)", ylabel="KV MiB per layer", xscale="log", yscale="log")
    for ax in (ax_t, ax_m):
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Decode step, one layer, {data.get('device', '')}, budget {data['latent']['decode_budget']}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("paths", nargs="+", type=Path)
    for path in p.parse_args(argv).paths:
        data = json.loads(path.read_text())
        out = path.with_suffix(".png")
        if data.get("benchmark") == "prefill_attention":
            plot_prefill(data, out)
        elif data.get("benchmark") == "end_to_end":
            plot_end_to_end(data, out)
        elif "results" in data and "latent" in data:
            plot_decode(data, out)
        else:
            raise SystemExit(f"{path}: no plot for this JSON")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
