"""Why a sparse prefill loses needles: per sample and per layer, where the needle's key blocks are dropped, which
part of the computation carries the damage, and what the dense fallbacks cover.

For every sample (``make_sample(task, length, index)``, the eval's own samples, question after the context) it runs:

1. **dense**: greedy answer with SDPA everywhere, recording each attention layer's output on the *tail* queries (the
   last segment and the question);
2. **fidelity on identical inputs**: the dense model's own q/k/v of every layer (`capture_qkv`), the policy's plan of
   that layer from them, and the relative L2 error of the tail's attention output against dense (`BlockAttention`
   over the tail rows only: no N x N tensor), over the tail and over the question's queries;
3. **hybrids**, one batch row each, all rows the same prompt (no padding): the policy's plan of each row, OR'd with
   dense rows (`Variant`): ``none`` (the sparse run), ``all`` (dense through the sparse kernel), ``question`` (the
   question's query blocks dense: its own path), ``after_needle`` (the queries from the needle to the question
   dense: the keys/values of the tokens after the needle), ``before_needle``, each optionally on a layer range
   (``all@:12`` = dense keys/values in layers 0-11). Per row: answer, score, density, and per layer the drift of the
   tail's attention output from the dense run (accumulated error). On the ``none`` row, per layer: the share of
   (head, sparse segment after the needle) pairs whose selection kept the needle's key blocks, per head and per
   segment, whether the question's queries see them, and the rank of the needle block in the observation scores
   against the number of blocks the budget lets the segment take;
4. the prompt's layout against the geometry: segments, how many tokens the last (dense) segment holds, where the
   question starts and how much of it sits in dense segments, where the needles sit and whether inside the dense
   prefix.

Everything goes to one small JSON per (task, length, policy): meta, a summary, and the per-sample records.
Runs on CPU at small lengths (tests: a tiny random model); on a GPU (bf16), e.g. the Qwen2.5-Coder-0.5B at 16k and
32k, 24 samples, the paper's geometry with a 2048 dense prefix (see ``docs/quality.md``)::

    python -m bench.eval diagnose --model qwen2.5-coder-0.5b --task niah_single --lengths 16384 32768 \\
        --samples 24 --prefill entropy --budgets 1024 --segment-size 512 --block-size 128 --dense-prefix 2048
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench.eval.capture import capture_qkv
from bench.eval.fidelity import BlockAttention, token_rows
from bench.eval.layout import Layout, needle_selection
from bench.eval.metrics import string_match_all
from bench.eval.resolve import apply_prefill, make_prefill_policy
from bench.eval.runner import Loaded
from bench.eval.tasks import make_sample, sample_ids
from flexentropy import observation_attention
from flexentropy.config import EntropyConfig
from flexentropy.sparse.plan import SparsePlan, causal_blocks

REGIONS = ("none", "all", "question", "after_needle", "before_needle")
"""Query regions a `Variant` makes dense (see the module docstring)."""


# --------------------------------------------------------------------------------------------------------------
# hybrids


@dataclass(frozen=True)
class Variant:
    """One batch row: the policy's plan with the query blocks of ``region`` made dense in layers ``start:stop``.

    Spec: ``REGION`` or ``REGION@START:STOP`` (Python slice of layer indices, either end may be empty), e.g.
    ``question``, ``all@:12`` (layers 0-11 dense), ``after_needle@12:``.
    """

    spec: str
    region: str
    start: int | None = None
    stop: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Variant:
        region, _, layers = spec.partition("@")
        if region not in REGIONS:
            raise ValueError(f"variant {spec!r}: region must be one of {', '.join(REGIONS)}")
        if not layers:
            return cls(spec, region)
        low, sep, high = layers.partition(":")
        try:
            return cls(spec, region, int(low) if low else None, int(high) if high else None) if sep else \
                cls(spec, region, int(low), int(low) + 1)
        except ValueError:
            raise ValueError(f"variant {spec!r}: layers must be START:STOP (integers, either may be empty)") from None

    def covers(self, layer_idx: int, num_layers: int) -> bool:
        return layer_idx in range(num_layers)[self.start:self.stop]


def default_variants(num_layers: int) -> list[str]:
    """The sparse run, dense, the question's path dense, the context after the needle dense, and four layer cuts."""
    half, quarter = num_layers // 2, num_layers // 4
    return ["none", "all", "question", "after_needle", f"all@:{half}", f"all@{half}:", f"all@:{quarter}",
            f"all@{num_layers - quarter}:"]


class HybridEdit:
    """The `PlanEdit` of a batch of `Variant` rows: ORs each row's dense query blocks into its plan, and records
    `needle_selection` of the ``none`` row (before the edit, which leaves that row as it is) per layer."""

    def __init__(self, variants: list[Variant], layout: Layout, num_layers: int, config: EntropyConfig) -> None:
        self.variants, self.layout, self.num_layers, self.config = variants, layout, num_layers, config
        self.regions = torch.stack([layout.region(v.region) for v in variants])                # [V, C_Q]
        self.sparse_row = next((i for i, v in enumerate(variants) if v.region == "none"), None)
        self.needle: dict[int, dict[str, Any]] = {}

    def __call__(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, plan: SparsePlan) -> SparsePlan:
        if plan.blocks.shape[0] != len(self.variants):
            raise ValueError(f"the hybrid edit expects one batch row per variant ({len(self.variants)}), got "
                             f"{plan.blocks.shape[0]} (a padded batch runs row by row)")
        if self.sparse_row is not None:
            row = slice(self.sparse_row, self.sparse_row + 1)
            a_obs = observation_attention(query[row], key[row], self.config.segment_size, self.config.block_size,
                                          observation=self.config.observation, scale=self.config.observation_scale,
                                          probes=self.config.probes)
            budgets = None if plan.budgets is None else plan.budgets[self.sparse_row]
            self.needle[layer_idx] = needle_selection(plan.blocks[self.sparse_row], a_obs[0], budgets, self.layout,
                                                      self.config)
        covers = torch.tensor([v.covers(layer_idx, self.num_layers) for v in self.variants])
        dense = (self.regions & covers[:, None]).to(plan.blocks.device)                       # [V, C_Q]
        causal = causal_blocks(plan.seq_len, plan.block_size, plan.blocks.device)             # [C_Q, C_B]
        return replace(plan, blocks=plan.blocks | (dense[:, None, :, None] & causal))


@contextlib.contextmanager
def plan_edits(model: Any, edit: Any) -> Iterator[None]:
    """Run every attention module's sparse plans through ``edit`` (`flexentropy.integrations.hf.PlanEdit`)."""
    from flexentropy.integrations.hf import attention_modules, layer_state

    states = [layer_state(m) for m in attention_modules(model)]
    for state in states:
        state.plan_edit = edit
    try:
        yield
    finally:
        for state in states:
            state.plan_edit = None


@contextlib.contextmanager
def tail_outputs(model: Any, seq_len: int, first: int, into: dict[int, torch.Tensor]) -> Iterator[None]:
    """Record into ``into[layer]`` each attention module's output (after its output projection) on the queries
    ``first ..`` of the prompt forward (``seq_len`` tokens): float32 ``[B, seq_len - first, hidden]``."""
    from flexentropy.integrations.hf import attention_modules

    def hook(module: Any, _args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.shape[1] == seq_len and module.layer_idx not in into:
            into[module.layer_idx] = hidden[:, first:].float()

    handles = [m.register_forward_hook(hook) for m in attention_modules(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


# --------------------------------------------------------------------------------------------------------------
# one sample


def _generate(loaded: Loaded, ids: list[int], rows: int, max_new_tokens: int, desc: str) -> list[str]:
    """Greedy replies of ``rows`` identical rows of ``ids`` (no padding: the batch runs the sparse path together)."""
    from transformers import DynamicCache

    from flexentropy.cli.generation import generate_batch_timed

    prompt = torch.tensor([ids], device=loaded.model.device).expand(rows, -1).contiguous()
    new, _, _ = generate_batch_timed(loaded.model, loaded.tokenizer, prompt, torch.ones_like(prompt),
                                     DynamicCache(config=loaded.model.config), max_new_tokens, desc)
    return [loaded.tokenizer.decode(row, skip_special_tokens=True) for row in new]


def _row_densities(model: Any, rows: int) -> list[float]:
    """Per batch row: mean over attention layers of the last prefill's computed / causal blocks (dense layers 1)."""
    from flexentropy.integrations.hf import STATE_ATTR, attention_modules

    per_layer = []
    for module in attention_modules(model):
        plans = getattr(module, STATE_ATTR).plans
        plan = plans[0] if len(plans) == 1 else None
        if plan is None:
            per_layer.append(torch.ones(rows))
            continue
        causal = causal_blocks(plan.seq_len, plan.block_size, plan.blocks.device).sum() * plan.blocks.shape[1]
        per_layer.append(plan.blocks.sum(dim=(1, 2, 3)).float().cpu() / float(causal))
    return [round(float(x), 4) for x in torch.stack(per_layer).mean(dim=0)]


def layer_fidelity_tail(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, plan: SparsePlan,
                        layout: Layout, config: EntropyConfig) -> dict[str, float]:
    """Attention fidelity of one layer's tail queries under ``plan``, on the same (dense) inputs.

    Args:
        q: ``[Hq, N, D]``; k, v: ``[Hkv, N, D]`` (one prompt); plan: the policy's plan from them (batch 1).

    Returns:
        Mean and max over heads of the relative L2 error of the attention output over the tail queries
        (``tail_error*``) and over the question's (``question_error*``), and the question's mean dense mass kept.
    """
    first = layout.tail_start(config)
    question = torch.arange(first, layout.seq_len, device=q.device) >= layout.question
    group = q.shape[0] // k.shape[0]
    rows = []
    for head in range(q.shape[0]):
        attention = BlockAttention.of_head(q[head, first:], k[head // group], v[head // group], scale,
                                           config.block_size, first)
        rows.append(attention.fidelity(token_rows(plan, head)[first:], question))
    tail = [r["rel_error"] for r in rows]
    asked = [r["rel_error_sparse"] for r in rows]
    return {"tail_error": statistics.fmean(tail), "tail_error_max": max(tail),
            "question_error": statistics.fmean(asked), "question_error_max": max(asked),
            "question_mass_kept": statistics.fmean(r["mass_kept_sparse"] for r in rows)}


def diagnose_sample(loaded: Loaded, policy: Any, task: str, length: int, index: int, variants: list[Variant],
                    seed: int = 0, max_new_tokens: int | None = None) -> dict[str, Any]:
    """The record of one sample (module docstring, steps 1-4) under prefill ``policy`` (a `PrefillPolicy` whose
    knobs are all in its config: it runs through `flexentropy.enable`, `apply_prefill`); replies are greedy, at most
    the sample's ``max_new_tokens`` (or the given cap, if lower) tokens."""
    from flexentropy.integrations.hf import attention_modules

    model, tokenizer, config = loaded.model, loaded.tokenizer, policy.config
    sample = make_sample(task, length, index, tokenizer, seed)
    ids = sample_ids(tokenizer, sample)
    layout = Layout.of_sample(tokenizer, sample, ids)
    first = layout.tail_start(config)
    num_layers = len(attention_modules(model))
    new_tokens = min(sample.max_new_tokens, max_new_tokens or sample.max_new_tokens)

    apply_prefill(model, make_prefill_policy("dense", config, None))
    dense_tail: dict[int, torch.Tensor] = {}
    with tail_outputs(model, len(ids), first, dense_tail):
        dense_reply = _generate(loaded, ids, 1, new_tokens, f"{task} #{index} dense")[0]

    layers: dict[int, dict[str, Any]] = {}
    for layer in capture_qkv(model, ids):
        if policy.runs_dense(layer.layer_idx, len(ids)):
            continue
        with torch.compiler.set_stance("force_eager"):  # a batch of 1 would compile the selection once more
            plan = policy.plan(layer.q, layer.k, layer.layer_idx)
        layers[layer.layer_idx] = layer_fidelity_tail(layer.q[0], layer.k[0], layer.v[0], layer.scale, plan, layout,
                                                      config)

    apply_prefill(model, policy)
    edit = HybridEdit(variants, layout, num_layers, config)
    hybrid_tail: dict[int, torch.Tensor] = {}
    with plan_edits(model, edit), tail_outputs(model, len(ids), first, hybrid_tail):
        replies = _generate(loaded, ids, len(variants), new_tokens, f"{task} #{index} hybrids")
    densities = _row_densities(model, len(variants))

    per_layer = []
    for idx in range(num_layers):
        drift = {v.spec: round(relative_error(hybrid_tail[idx][row], dense_tail[idx][0]), 5)
                 for row, v in enumerate(variants)}
        entry = {"layer": idx, "drift": drift}
        if idx in layers:
            entry["fidelity"] = {k: round(v, 5) for k, v in layers[idx].items()}
        if idx in edit.needle:
            entry["needle"] = edit.needle[idx]
        per_layer.append(entry)
    score = string_match_all(dense_reply, sample.answers)
    return {
        "index": index,
        "answers": list(sample.answers),
        "layout": layout.describe(config),
        "dense": {"prediction": dense_reply, "score": score},
        "variants": {v.spec: {"prediction": reply, "score": string_match_all(reply, sample.answers),
                              "density": density}
                     for v, reply, density in zip(variants, replies, densities, strict=True)},
        "layers": per_layer,
    }


# --------------------------------------------------------------------------------------------------------------
# summary and file


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 4) if values else None


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over samples: scores per variant (all samples, and those dense answers right), density, layout checks,
    and per layer the needle statistics, the fidelity and each variant's drift."""
    right = [r for r in records if r["dense"]["score"] == 1.0]
    specs = list(records[0]["variants"])
    layers = []
    for idx in range(len(records[0]["layers"])):
        rows = [r["layers"][idx] for r in records]
        entry: dict[str, Any] = {"layer": idx, "drift": {s: _mean([row["drift"][s] for row in rows]) for s in specs}}
        if "fidelity" in rows[0]:
            entry["fidelity"] = {k: _mean([row["fidelity"][k] for row in rows]) for k in rows[0]["fidelity"]}
        if "needle" in rows[0]:
            entry["needle"] = {k: _mean([row["needle"][k] for row in rows])
                               for k in ("kept", "kept_question", "rank_median", "k_median")}
        layers.append(entry)
    layouts = [r["layout"] for r in records]
    return {
        "samples": len(records),
        "dense_score": _mean([r["dense"]["score"] for r in records]),
        "variants": {s: {"score": _mean([r["variants"][s]["score"] for r in records]),
                         "score_where_dense_right": _mean([r["variants"][s]["score"] for r in right]),
                         "density": _mean([r["variants"][s]["density"] for r in records])} for s in specs},
        "layout": {
            "question_fully_dense": _mean([float(lay["question_dense_share"] == 1.0) for lay in layouts]),
            "question_dense_share": _mean([lay["question_dense_share"] for lay in layouts]),
            "last_segment_tokens_min": min(lay["last_segment_tokens"] for lay in layouts),
            "question_tokens_max": max(lay["question_tokens"] for lay in layouts),
            "needles_in_dense_prefix": _mean([float(any(lay["needles_in_dense_prefix"])) for lay in layouts]),
        },
        "layers": layers,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """A few lines for the terminal: scores and density per variant, the layout checks, the worst layers, and each
    variant's drift at the last layer."""
    lines = [f"{summary['samples']} samples, dense score {summary['dense_score']}"]
    for spec, v in summary["variants"].items():
        lines.append(f"  {spec:>20}: score {v['score']}  (where dense is right: {v['score_where_dense_right']})  "
                     f"density {v['density']}")
    lines.append("  layout: " + ", ".join(f"{k} {v}" for k, v in summary["layout"].items()))
    needle = [(e["layer"], e["needle"]["kept"]) for e in summary["layers"] if e.get("needle", {}).get("kept")]
    if needle:
        worst = sorted(needle, key=lambda lk: lk[1])[:5]
        lines.append("  needle blocks kept after the needle, lowest layers: "
                     + ", ".join(f"L{layer} {kept:.2f}" for layer, kept in worst))
    last = summary["layers"][-1]["drift"]
    lines.append("  tail drift from dense at the last layer: " + ", ".join(f"{s} {d}" for s, d in last.items()))
    fidelity = [(e["layer"], e["fidelity"]["question_error"]) for e in summary["layers"] if "fidelity" in e]
    if fidelity:
        worst = sorted(fidelity, key=lambda lf: -(lf[1] or 0))[:5]
        lines.append("  question attention error on dense inputs, highest layers: "
                     + ", ".join(f"L{layer} {err:.3f}" for layer, err in worst))
    return "\n".join(lines)


def write_json(path: Path, meta: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """Write ``{"meta", "summary", "samples"}`` to ``path``; returns the summary."""
    from flexentropy.cli.files import write_json_atomic

    summary = summarise(records)
    write_json_atomic(path, {"meta": meta, "summary": summary, "samples": records})
    return summary
