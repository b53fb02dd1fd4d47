"""Side-by-side tables and plots of the finished runs under an output root (`bench.eval.runner` layout).

Every run is compared with the dense-prefill, full-cache run of the same (model, task, length, placement) on the
same samples: besides the task score, ``same_as_dense`` (share of samples whose greedy generation is token for token
the dense one) and ``prefix_agreement`` ("agreement" in the tables: mean share of the dense generation reproduced before
the first differing token) show deviations that a handful of samples cannot show in the score.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench.eval.metrics import common_prefix_tokens
from bench.eval.plotting import pyplot, save
from bench.eval.runner import CONFIG_FILE, METRICS_FILE, RunSpec, read_predictions
from flexentropy.policies import PREFILL_POLICIES

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h")
"""Marker and line style per policy, so that policies with equal scores stay visible on top of each other."""
LINESTYLES = ("-", "--", "-.", ":")

COLUMNS = ("model", "task", "length", "placement", "prefill", "prefill_budget", "cache", "cache_budget", "samples",
           "score", "score_low", "score_high", "same_as_dense", "prefix_agreement", "density", "prompt_tokens",
           "prefill_s", "decode_s_per_token", "kv_mib", "device", "path")

Row = dict[str, Any]


def _baseline_key(spec: RunSpec) -> tuple[str, str, int, str]:
    return spec.model, spec.task, spec.length, spec.placement


def collect(root: Path) -> list[Row]:
    """One row (`COLUMNS`) per finished run under ``root``, with agreement against its dense/full baseline."""
    runs = []
    for metrics_path in sorted(root.rglob(METRICS_FILE)):
        run_dir = metrics_path.parent
        spec = RunSpec.from_json(json.loads((run_dir / CONFIG_FILE).read_text(encoding="utf-8")))
        metrics = json.loads(metrics_path.read_text(encoding="utf-8"))
        records = read_predictions(run_dir)
        runs.append((spec, metrics, {i: records[i] for i in range(metrics["samples"]) if i in records}, run_dir))
    baselines = {_baseline_key(s): recs for s, _, recs, _ in runs if s.prefill == "dense" and s.cache == "full"}
    rows = []
    for spec, metrics, records, run_dir in runs:
        base = baselines.get(_baseline_key(spec), {})
        shared = [i for i in records if i in base]
        same = [records[i]["new_token_ids"] == base[i]["new_token_ids"] for i in shared]
        prefix = [common_prefix_tokens(records[i]["new_token_ids"], base[i]["new_token_ids"])
                  / max(len(base[i]["new_token_ids"]), 1) for i in shared]
        rows.append({
            "model": spec.model, "task": spec.task, "length": spec.length, "placement": spec.placement,
            "prefill": spec.prefill, "prefill_budget": spec.prefill_budget, "cache": spec.cache,
            "cache_budget": spec.cache_budget,
            **{k: metrics.get(k) for k in ("samples", "score", "score_low", "score_high", "density", "prompt_tokens",
                                          "prefill_s", "decode_s_per_token", "kv_mib", "device")},
            "same_as_dense": statistics.fmean(same) if same else None,
            "prefix_agreement": statistics.fmean(prefix) if prefix else None,
            "path": str(run_dir.relative_to(root)),
        })
    return rows


# --------------------------------------------------------------------------------------------------------------
# tables


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def score_cell(row: Row) -> str:
    """``0.75 [0.30, 0.95] n=4``: mean score with its 95% Wilson interval and sample count."""
    if row["score"] is None:
        return "-"
    return f"{row['score']:.2f} [{row['score_low']:.2f}, {row['score_high']:.2f}] n={row['samples']}"


def policy_name(row: Row, kind: str) -> str:
    """``entropy B_0=128`` / ``snapkv B_d=64`` / ``dense``."""
    budget = row[f"{kind}_budget"]
    return row[kind] if budget is None else f"{row[kind]} {'B_0' if kind == 'prefill' else 'B_d'}={budget}"


def _sort_key(value: Any) -> tuple:
    return (0, value) if isinstance(value, (int, float)) else (1, str(value))


def pivot(rows: Iterable[Row], row_key: Callable[[Row], str], col_key: Callable[[Row], Any],
          cell: Callable[[Row], str], corner: str, row_order: Callable[[Row], Any] | None = None) -> str:
    """A markdown table: one line per ``row_key`` (sorted by ``row_order``, default the label), one column per
    ``col_key``, cells from ``cell``."""
    cells: dict[tuple[str, Any], str] = {}
    order: dict[str, Any] = {}
    for row in rows:
        label = row_key(row)
        cells[label, col_key(row)] = cell(row)
        order.setdefault(label, row_order(row) if row_order else _sort_key(label))
    lines = sorted(order, key=order.__getitem__)
    cols = sorted({c for _, c in cells}, key=_sort_key)
    out = [f"| {corner} | " + " | ".join(str(c) for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    out += [f"| {line} | " + " | ".join(cells.get((line, c), "") for c in cols) + " |" for line in lines]
    return "\n".join(out)


SPARSE_PREFILLS = tuple(name for name in PREFILL_POLICIES if name != "dense")
"""Every sparse prefill policy, in registry order (the order of table rows and plot lines)."""


def _prefill_order(row: Row) -> tuple:
    names = list(PREFILL_POLICIES)
    return (names.index(row["prefill"]) if row["prefill"] in names else len(names), row["prefill"],
            row["prefill_budget"] or 0)


def tables(rows: list[Row]) -> str:
    """The markdown tables of `write_report` (only the sections that have runs)."""
    sections = []
    base = [r for r in rows if r["prefill"] == "dense" and r["cache"] == "full" and r["score"] is not None]
    if base:
        sections.append("### Tasks, dense prefill and full cache (score [95% Wilson], n samples)\n\n" + pivot(
            base, lambda r: f"{r['task']} ({r['placement']})", lambda r: r["length"], score_cell, "task"))
    prefill = [r for r in rows if r["cache"] == "full" and r["score"] is not None]
    for (task, placement), group in _groups(prefill, ("task", "placement")).items():
        if len({r["prefill"] for r in group}) < 2:
            continue
        sections.append(f"### Prefill policies, {task}, question {placement}, full cache\n\n"
                        "score [95% Wilson] / mean prefill density / agreement with dense\n\n" + pivot(
                            group, lambda r: policy_name(r, "prefill"), lambda r: r["length"],
                            lambda r: f"{score_cell(r)} / d={_fmt(r['density'])} / agr={_fmt(r['prefix_agreement'])}",
                            "prefill", _prefill_order))
    caches = [r for r in rows if r["prefill"] == "dense" and r["score"] is not None]
    for (task, length), group in _groups(caches, ("task", "length")).items():
        if len({r["cache"] for r in group}) < 2:
            continue
        sections.append(f"### Cache policies, {task} at {length} tokens, dense prefill\n\n"
                        "score (agreement with dense) per B_d, n samples per cell; `full` keeps everything\n\n" + pivot(
                            group, lambda r: f"{r['cache']} (q {r['placement']})",
                            lambda r: r["cache_budget"] if r["cache_budget"] is not None else "all",
                            lambda r: f"{_fmt(r['score'])} ({_fmt(r['prefix_agreement'])}) n={r['samples']}", "cache"))
    scored = [r for r in rows if r["score"] is not None]
    for (task, length, placement), group in _groups(scored, ("task", "length", "placement")).items():
        budgets = {r["prefill_budget"] for r in group} & {r["cache_budget"] for r in group} - {None}
        for budget in sorted(budgets):
            cell_rows = [r for r in group
                         if r["prefill_budget"] in (None, budget) and r["cache_budget"] in (None, budget)]
            if len({r["prefill"] for r in cell_rows}) < 2 or len({r["cache"] for r in cell_rows}) < 2:
                continue
            sections.append(f"### Prefill x cache, {task} at {length} tokens, question {placement}, "
                            f"B_0 = B_d = {budget}\n\nscore (agreement with dense), n samples per cell\n\n" + pivot(
                                cell_rows, lambda r: r["prefill"], lambda r: r["cache"],
                                lambda r: f"{_fmt(r['score'])} ({_fmt(r['prefix_agreement'])}) n={r['samples']}",
                                "prefill \\ cache", _prefill_order))
    latency = [r for r in rows if r["task"] == "summarise"]
    if latency:
        devices = ", ".join(sorted({r["device"] for r in latency if r["device"]})) or "device not recorded"
        sections.append(f"### Latency prompt (summarise, 100 new tokens; {devices})\n\n"
                        "median prefill s / decode ms per token / KV MiB\n\n" + pivot(
                            latency, lambda r: f"{policy_name(r, 'prefill')} + {policy_name(r, 'cache')}",
                            lambda r: r["length"],
                            lambda r: (f"{_fmt(r['prefill_s'])} / {_fmt((r['decode_s_per_token'] or 0) * 1e3, '.0f')}"
                                       f" / {_fmt(r['kv_mib'], '.0f')}"), "policies"))
    return "\n\n".join(sections) + "\n"


def _groups(rows: Iterable[Row], keys: tuple[str, ...]) -> dict[tuple, list[Row]]:
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for row in rows:
        groups[tuple(row[k] for k in keys)].append(row)
    return dict(sorted(groups.items(), key=lambda kv: tuple(_sort_key(v) for v in kv[0])))


# --------------------------------------------------------------------------------------------------------------
# plots


PANELS_PER_ROW = 4
MIN_DENSITY_SPAN = 0.1
"""`plot_accuracy_vs_density`: (task, length) panels per row, and the narrowest density range a panel shows."""


def plot_accuracy_vs_density(rows: list[Row], path: Path, prefills: tuple[str, ...] = SPARSE_PREFILLS) -> bool:
    """Score and agreement with dense against measured density, per prefill policy (full cache, question after
    the context), one column per (task, length). False when there is nothing to plot."""
    plt = pyplot()

    data = [r for r in rows if r["cache"] == "full" and r["placement"] == "outside" and r["score"] is not None
            and r["density"] is not None and r["prefill"] in ("dense", *prefills)]
    panels = [k for k, g in _groups(data, ("task", "length")).items() if len({r["prefill"] for r in g}) > 1]
    if not panels:
        return False
    cols = min(len(panels), PANELS_PER_ROW)
    bands = -(-len(panels) // cols)  # each band: a row of scores over a row of agreements
    fig, axes = plt.subplots(2 * bands, cols, figsize=(4.2 * cols, 3.5 * 2 * bands), squeeze=False)
    for k in range(len(panels), bands * cols):  # the last band's empty slots
        band, col = divmod(k, cols)
        axes[2 * band, col].set_visible(False)
        axes[2 * band + 1, col].set_visible(False)
    for k, (task, length) in enumerate(panels):
        band, col = divmod(k, cols)
        top, bottom = axes[2 * band, col], axes[2 * band + 1, col]
        group = [r for r in data if (r["task"], r["length"]) == (task, length)]
        for i, prefill in enumerate(prefills):
            line = sorted((r for r in group if r["prefill"] == prefill), key=lambda r: r["density"])
            if not line:
                continue
            x = [r["density"] for r in line]
            y = [r["score"] for r in line]
            err = [[r["score"] - r["score_low"] for r in line], [r["score_high"] - r["score"] for r in line]]
            top.errorbar(x, y, yerr=err, marker=MARKERS[i], ls=LINESTYLES[i % len(LINESTYLES)], capsize=3,
                         label=prefill, alpha=0.85, color=f"C{i}")
            for r in line:
                if r["prefill_budget"] is not None:
                    top.annotate(str(r["prefill_budget"]), (r["density"], r["score"]), fontsize=7,
                                 textcoords="offset points", xytext=(3, 3))
            bottom.plot(x, [r["prefix_agreement"] for r in line], marker=MARKERS[i],
                        ls=LINESTYLES[i % len(LINESTYLES)], label=prefill, color=f"C{i}")
        for r in group:
            if r["prefill"] == "dense":
                top.axhline(r["score"], color="k", ls="--", lw=1, label=f"dense (n={r['samples']})")
        sparse = [r["density"] for r in group if r["prefill"] != "dense"]
        middle, half = (min(sparse) + max(sparse)) / 2, max(max(sparse) - min(sparse), MIN_DENSITY_SPAN) * 0.6
        top.set_title(f"{task}, {length} tokens")
        for ax in (top, bottom):
            ax.set_xlim(middle - half, middle + half)  # points at one density are not spread over the axis
            ax.set_ylim(-0.03, 1.05)
            ax.grid(alpha=0.3)
        if col == 0:
            top.set_ylabel("score (95% Wilson interval)")
            bottom.set_ylabel("share of the dense greedy answer\nreproduced before divergence")
    fig.supxlabel("mean prefill density\n(computed / causal key blocks, all layers)")
    legend = {label: handle for ax in axes[::2].flat for handle, label in zip(*ax.get_legend_handles_labels(),
                                                                              strict=True)}
    axes[0, 0].legend(legend.values(), legend.keys(), fontsize=8)  # every policy, also those absent from panel 1
    fig.suptitle("Accuracy against measured density (labels: B_0)\nfull cache, question after the context")
    save(fig, path)
    return True


def plot_cache_budgets(rows: list[Row], path: Path) -> bool:
    """Score against ``B_d`` per cache policy (dense prefill), question after vs before the context."""
    plt = pyplot()

    data = [r for r in rows if r["prefill"] == "dense" and r["score"] is not None and r["task"] != "summarise"]
    budgeted = [r for r in data if r["cache_budget"] is not None]
    panels = sorted({(r["task"], r["length"]) for r in budgeted}, key=lambda k: tuple(map(_sort_key, k)))
    placements = sorted({r["placement"] for r in budgeted}, reverse=True)
    if not panels:
        return False
    fig, axes = plt.subplots(len(placements), len(panels), figsize=(5 * len(panels), 3.8 * len(placements)),
                             squeeze=False, sharey=True)
    for col, (task, length) in enumerate(panels):
        for row_i, placement in enumerate(placements):
            ax = axes[row_i, col]
            group = [r for r in data if (r["task"], r["length"], r["placement"]) == (task, length, placement)]
            for i, cache in enumerate(sorted({r["cache"] for r in group if r["cache_budget"] is not None})):
                line = sorted((r for r in group if r["cache"] == cache), key=lambda r: r["cache_budget"])
                ax.plot([r["cache_budget"] for r in line], [r["score"] for r in line], marker=MARKERS[i],
                        ls=LINESTYLES[i % len(LINESTYLES)], ms=9 - 1.5 * i, label=cache, alpha=0.85)
            for r in group:
                if r["cache"] == "full":
                    ax.axhline(r["score"], color="k", ls="--", lw=1, label="full cache")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{task}, {length} tokens, question {placement}", fontsize=10)
            ax.set_xlabel("B_d (entries per KV head)")
            ax.grid(alpha=0.3)
        axes[0, col].legend(fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("score")
    fig.suptitle("KV-cache policies at matched budgets (dense prefill)")
    save(fig, path)
    return True


def plot_tasks(rows: list[Row], path: Path) -> bool:
    """Dense/full score per task and length (which tasks a model can do at all)."""
    plt = pyplot()
    import numpy as np

    data = [r for r in rows if r["prefill"] == "dense" and r["cache"] == "full" and r["score"] is not None
            and r["placement"] == "outside"]
    if not data:
        return False
    tasks = sorted({r["task"] for r in data})
    lengths = sorted({r["length"] for r in data})
    fig, ax = plt.subplots(figsize=(1.6 * len(tasks) + 2, 3.8))
    width = 0.8 / len(lengths)
    for i, length in enumerate(lengths):
        cells = {r["task"]: r for r in data if r["length"] == length}
        x = np.arange(len(tasks)) + i * width
        y = [cells[t]["score"] if t in cells else np.nan for t in tasks]
        err = [[cells[t]["score"] - cells[t]["score_low"] if t in cells else 0 for t in tasks],
               [cells[t]["score_high"] - cells[t]["score"] if t in cells else 0 for t in tasks]]
        ax.bar(x, y, width, yerr=err, capsize=2, label=f"{length} tokens")
    ax.set_xticks(np.arange(len(tasks)) + 0.4 - width / 2, tasks, rotation=15)
    ax.set_ylabel("score (95% Wilson)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax.set_title("Dense prefill, full cache: what the model can do at all")
    save(fig, path)
    return True


def fidelity_tables(path: Path) -> str:
    """Markdown tables of a ``fidelity_summary.json`` (`bench.eval.fidelity`): per policy and budget, at
    matched density, and the budget-allocation check."""
    from bench.eval.fidelity import at_density

    data = json.loads(path.read_text(encoding="utf-8"))
    summary, meta = data["summary"], data["meta"]
    head = (f"### Attention fidelity, {meta['length']} tokens, {meta['contexts']} context(s), sparse-segment queries"
            "\n\nmean over sparse layers and heads\n\n| policy | B_0 | density | mass kept | rel. error | "
            "rel. error p90 |\n|---|---|---|---|---|---|\n")
    lines = [f"| {s['policy']} | {s['budget']} | {s['density']:.3f} | {s['mass_kept_sparse']:.3f} | "
             f"{s['rel_error_sparse']:.3f} | {s['rel_error_sparse_p90']:.3f} |" for s in summary if s["budget"]]
    policies = sorted({s["policy"] for s in summary if s["budget"] is not None})
    grid = [s["density"] for s in summary if s["policy"] == "critiprefill"]
    matched = "\n\n### Relative error at matched density (linear interpolation between budgets; - outside range)" \
        "\n\n| density | " + " | ".join(policies) + " |\n" + "|---" * (len(policies) + 1) + "|\n"
    for d in grid:
        cells = [at_density(summary, p, "rel_error_sparse", d) for p in policies]
        matched += f"| {d:.3f} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |\n"
    alloc = meta.get("allocation", [])
    alloc_table = "\n### Does entropy give more blocks where a uniform budget errs most?\n\nSpearman correlation " \
        "over (layer, head) of entropy's per-head density and critiprefill's per-head error\n\n| B_0 | heads | " \
        "Spearman |\n|---|---|---|\n" + "".join(f"| {a['budget']} | {a['heads']} | {a['spearman']:+.2f} |\n"
                                                  for a in alloc)
    return head + "\n".join(lines) + matched + (alloc_table if alloc else "")


def entropy_tables(path: Path) -> str:
    """Markdown table of an ``entropy_maps.json`` (`bench.eval.entropy_maps`): rigid share and class changes."""
    stats = json.loads(path.read_text(encoding="utf-8"))["stats"]
    out = (f"### Rigid/dynamic heads over {stats['contexts']} contexts\n\nmax segment entropy: min "
           f"{stats['max_entropy_min']:.3g}, median {stats['max_entropy_median']:.3g}, max "
           f"{stats['max_entropy_max']:.3g} nats; segments below 1e-5: {100 * stats['segments_below_threshold']:.2f}%;"
           f" mean rank correlation of the head maps between contexts: {stats['rank_correlation']:.2f}\n\n"
           "| threshold | value | rigid share | heads changing class, mean over context pairs | the same if heads "
           "were drawn independently per context | heads changing class in some context |\n|---|---|---|---|---|---|\n")
    return out + "".join(f"| {name} | {c['threshold']:.3g} | {c['rigid_share']:.3f} | {c['pairwise_change']:.3f} | "
                         f"{c['independent_change']:.3f} | {c['ever_changes']:.3f} |\n"
                         for name, c in stats["classes"].items())


def write_report(root: Path, out: Path) -> list[Path]:
    """``runs.csv`` and ``tables.md`` of every finished run under ``root`` (plus the fidelity and entropy-map
    tables when ``out/fidelity`` and ``out/entropy`` hold results), and the plots; the files written."""
    rows = collect(root)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "runs.csv", out / "tables.md"]
    with files[0].open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    text = tables(rows)
    if (out / "fidelity" / "fidelity_summary.json").is_file():
        text += "\n" + fidelity_tables(out / "fidelity" / "fidelity_summary.json")
    if (out / "entropy" / "entropy_maps.json").is_file():
        text += "\n" + entropy_tables(out / "entropy" / "entropy_maps.json")
    files[1].write_text(text, encoding="utf-8")
    for name, draw in (("tasks.png", plot_tasks), ("accuracy_vs_density.png", plot_accuracy_vs_density),
                       ("cache_budgets.png", plot_cache_budgets)):
        if draw(rows, out / name):
            files.append(out / name)
    return files
