"""STUDY/rules.png: score against measured density (top) and measured prefill time (bottom) per prefill rule, one
column per task, from the ``runs.csv`` of one or more studies (the eval report's own plot groups runs by policy name
only, so it cannot tell the coverage variants of ``entropy`` apart). The segment size is read from the model label
(`SEGMENTS_256`), else the 512 of the first runs.

    python profiling/quality/plot_rules.py docs/results/qwen_h200
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing
from bench.eval.resolve import parse_spec  # noqa: E402

SEGMENTS_256 = ("-seg256", "-yarn4")
"""Model labels of the runs at segments of 256: the 32k runs from session 8 on, and every 128k run under YaRN."""


def label(row: dict[str, str]) -> str:
    """A short name of a run's prefill rule."""
    spec = row["prefill"]
    name, knobs = parse_spec(spec)
    if name == "entropy" and "coverage" in knobs:
        segments = 256 if any(tag in row["model"] for tag in SEGMENTS_256) else 512
        probes = f", {knobs['probes']} probes" if "probes" in knobs else ""
        return f"probe, coverage {knobs['coverage']}, segments {segments}{probes}"
    if spec == "entropy":
        return f"paper's rule, B_0 {row['prefill_budget']}"
    return spec


def main(study: Path, *more: Path) -> None:
    rows, dense = [], set()
    for folder in (study, *more):
        for row in csv.DictReader((folder / "runs.csv").open(encoding="utf-8")):
            if row["prefill"] == "dense":       # the same dense runs may sit in several studies
                if row["task"] in dense:
                    continue
                dense.add(row["task"])
            rows.append(row)
    tasks = sorted({r["task"] for r in rows})
    length = int(rows[0]["length"])
    batched = "median batch of 8" if length <= 32768 else "one prompt"     # the plans' --batch-size
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.2 * len(tasks), 8.4), squeeze=False)
    colors: dict[str, str] = {}                 # one colour per rule across the panels
    sparse = [r for r in rows if r["prefill"] != "dense"]
    axis = {"density": ("measured prefill density (computed / causal key blocks)",
                        [float(r["density"]) for r in sparse]),
            "prefill_s": (f"measured prefill time, s ({batched} in the eval)",
                          [float(r["prefill_s"]) for r in rows])}
    for line, (x_key, (x_label, xs)) in zip(axes, axis.items(), strict=True):
        for ax, task in zip(line, tasks, strict=True):
            for row in (r for r in rows if r["task"] == task):
                score, low, high = (float(row[k]) for k in ("score", "score_low", "score_high"))
                err = [[max(score - low, 0)], [max(high - score, 0)]]
                if row["prefill"] == "dense":
                    ax.axhspan(low, high, color="k", alpha=0.08)
                    ax.axhline(score, color="k", ls="--", lw=1, label=f"dense (n={row['samples']}), 95% band")
                    if x_key == "prefill_s":    # dense has a time, not a density
                        ax.errorbar(float(row[x_key]), score, yerr=err, marker="s", capsize=3, color="k")
                    continue
                color = colors.setdefault(label(row), f"C{len(colors)}")
                ax.errorbar(float(row[x_key]), score, yerr=err, marker="o", capsize=3, color=color,
                            label=f"{label(row)} (n={row['samples']})")
            ax.set_title(f"{task}, {rows[0]['length']} tokens")
            ax.set_xlabel(x_label)
            ax.set_ylim(0, 1.05)
            pad = 0.05 * (max(xs) - min(xs)) or 0.02
            ax.set_xlim(min(xs) - pad, max(xs) + pad)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
        line[0].set_ylabel("score (95% Wilson interval)")
    yarn = " under YaRN" if "-yarn" in rows[0]["model"] else ""
    mask = " with a padding mask" if length <= 32768 else ""
    fig.suptitle(f"Qwen2.5-Coder-1.5B at {length // 1024}k{yarn}: prefill rules (H200, blocks 128, dense prefix 4096, "
                 f"layer 0 dense; dense prefill: SDPA{mask})")
    fig.tight_layout()
    fig.savefig(study / "rules.png", dpi=110)


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:]))
