"""Which layers and heads lose the second and third values of a three-value answer (project issue 49, item 2, its
CPU half; docs/quality.md).

    python profiling/quality/value_loss_study.py --model qwen2.5-coder-0.5b --length 8192 --seeds 0 1 2 3 \
        --out docs/results/value_loss/value_loss_0.5b.json
    python profiling/quality/value_loss_study.py --model qwen2.5-coder-0.5b --length 16384 --seeds 0 1 \
        --out docs/results/value_loss/value_loss_0.5b.json    (adds to the file; --table prints its tables)
    python profiling/quality/value_loss_study.py --length 8192 --seeds 0 1 2 3 --rules "default (dense tail)" \
        "8 probes (dense tail)" "4 probes (dense tail)" "default, q sparse" "4 probes, q sparse" \
        --out docs/results/value_loss/value_loss_probes_0.5b.json            (the same at 16384, seeds 0 1)

Per seed, one prompt of 4 planted needles ("One of the special magic numbers for KEY is: NNNNNNN."), 3 of them
asked in one question (the harness's ``niah_multiquery3``, drawn with a seed of its own). Captures every layer's
post-RoPE q/k/v once (dense forward, float32; `bench.eval.capture.capture_qkv`, as mass_study's capture does; cached
as ``runs/value_loss_<length>_<seed>_v.pt``), then, for every sparse layer (layer 0 is dense) and every rule, plans
the layer (`flexentropy.policies.make_prefill`) and measures on the question rows (the prompt's tokens from the
question's first token to the end of the answer prefix that lie in the prompt's last segment of 256):

- ``mass``: the dense softmax mass of each (layer, head) on each needle's tokens (needles ordered as asked: ask 1,
  ask 2, ask 3, then the unasked one), summed over the rows;
- ``kept``: the share of that mass inside the blocks the plan gives those rows.

A (layer, head) *attends* to a needle when its mean mass per row on the needle's tokens is at least ``--attend``
(default 0.05). It *loses* the needle when it keeps less than half of that mass. Each loss is attributed with what
the plan exposes, on the needle's main key block (the block holding most of the head's mass on the needle):

- ``floor``: the head's budget for the rows' segment (``plan.budgets / block_size``, blocks chosen by coverage) is
  smaller than the main block's rank among the segment's free candidate blocks by the rows' true (dense) mass: even a
  perfect ranking would have dropped it with that budget;
- ``ranking``: the budget would have reached the block under the true ranking, but the observation (the segment's
  probes) ranked it lower and it was not selected;
- ``split``: the main block was selected but less than half of the needle's mass is kept (the needle straddles
  blocks).

The rules: the shipped default (coverage ``(0.8, 0.6)`` is 0.8 below 32k tokens; its last segment, where the question
sits, is dense), and, with ``dense_last_segment=False`` so that the question's rows get the rule's own plan: the
default probe (coverage 0.8), coverage 0.6 and 0.9, and the pooled observation. Last, the needle rows: the share of
the needle tokens' own dense attention (all their keys) inside their plan, per needle (the context's keys and values
at the needles are what the dense question and the dense decode read).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mass_study import block_mass, dense_rows  # noqa: E402

from flexentropy.config import Q_BLOCK_SIZE, EntropyConfig  # noqa: E402
from flexentropy.policies import make_prefill  # noqa: E402
from flexentropy.policies.prefill.entropy.probe_mass import probe_positions  # noqa: E402

NEEDLES = ("ask 1", "ask 2", "ask 3", "unasked")
SPARSE_Q = dict(dense_last_segment=False)   # the question's rows get the rule's plan, not the dense tail
RULES: dict[str, dict[str, Any]] = {
    "default (dense tail)": {},
    "default, q sparse": SPARSE_Q,
    "cov 0.6, q sparse": dict(SPARSE_Q, coverage=0.6),
    "cov 0.9, q sparse": dict(SPARSE_Q, coverage=0.9),
    "pooled, q sparse": dict(SPARSE_Q, observation="pooled"),
    "8 probes (dense tail)": dict(probes=8),
    "4 probes (dense tail)": dict(probes=4),
    "4 probes, q sparse": dict(SPARSE_Q, probes=4),
}
"""Rule name -> knobs on the default `EntropyConfig` (the default's coverage at these lengths is 0.8). ``--rules``
picks some (default: the first five); fewer probes per segment cut the observation's cost in proportion."""
FIRST_RULES = list(RULES)[:5]

Layers = list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, float]]


def build(tokenizer: Any, length: int, seed: int) -> tuple[Any, list[int]]:
    from bench.eval.tasks import Draw, niah_multiquery3, sample_ids

    draw = Draw(random.Random(f"value_loss/{length}/{seed}"), tokenizer, length)
    sample = niah_multiquery3(draw)
    return sample, sample_ids(tokenizer, sample)


def find(ids: list[int], part: list[int], last: bool = False) -> int:
    """Start of the first (or last) occurrence of ``part`` in ``ids``."""
    starts = [i for i in range(len(ids) - len(part) + 1) if ids[i:i + len(part)] == part]
    if not starts:
        raise ValueError(f"token run {part} not found in the prompt")
    return starts[-1] if last else starts[0]


def spans(tokenizer: Any, sample: Any, ids: list[int]) -> tuple[list[tuple[int, int]], int]:
    """``([start, end) token span of each needle in `NEEDLES` order], first token of the question)``.

    A needle's span: its fact's tokens, found as the fact's tokens without the first and last one (those may merge
    with the text around it), widened by one token each side."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    meta = sample.meta
    unasked = [key for key in meta["keys"] if key not in meta["asked"]]
    found = []
    for key in [*meta["asked"], *unasked]:
        fact = next(fact for fact in meta["facts"] if f" {key} " in fact)
        body = encode(" " + fact)[1:-1]
        start = find(ids, body)
        found.append((start - 1, start + len(body) + 1))
    question = encode(sample.question)[1:6]
    return found, find(ids, question, last=True) - 1


def capture(model: Any, ids: list[int], path: Path) -> Layers:
    if path.is_file():
        return torch.load(path)
    from bench.eval.capture import capture_qkv

    layers = capture_qkv(model, ids)
    kept = [(layer.layer_idx, layer.q[0].half(), layer.k[0].half(), layer.v[0].half(), layer.scale)
            for layer in layers]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(kept, path)
    return kept


def study_layer(q: torch.Tensor, k: torch.Tensor, scale: float, layer_idx: int, rows: torch.Tensor,
                needle_rows: torch.Tensor, member: torch.Tensor, config: EntropyConfig, rules: list[str]
                ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """``(dense, per_rule)`` for one layer. ``member`` float ``[N, 4]``: token-in-needle; ``rows`` the question rows
    (one segment); ``needle_rows`` long ``[4, T]``: each needle's token rows."""
    n, block = q.shape[1], config.block_size
    probs = torch.softmax(dense_rows(q, k, rows, scale), -1)                        # [Hq, R, N]
    mass = torch.einsum("hrn,nj->hj", probs, member)                                # [Hq, 4] summed over rows
    on_needle = probs.sum(1)[:, None, :] * member.T[None]                           # [Hq, 4, N]
    main = block_mass(on_needle, block).argmax(-1)                                  # [Hq, 4] main key block
    true = block_mass(probs, block).sum(1)                                          # [Hq, C_B] rows' true mass
    segment = int(rows[-1]) // config.segment_size
    j = torch.arange(true.shape[-1])
    free = (j >= config.sink_blocks) & ((j + 1) * block <= segment * config.segment_size)
    main_mass = true.gather(1, main)                                                # [Hq, 4]
    rank = 1 + ((true[:, None, :] > main_mass[..., None]) & free).sum(-1)          # [Hq, 4] among free blocks
    flat_rows = needle_rows.flatten()
    needle_probs = torch.softmax(dense_rows(q, k, flat_rows, scale), -1)            # [Hq, 4T, N]
    out = {}
    for name in rules:
        rule = EntropyConfig().replace(**RULES[name])
        plan = make_prefill("entropy", rule).plan(q[None], k[None], layer_idx)
        blocks = plan.blocks[0]                                                     # [Hq, C_Q, C_B]
        keep = blocks[:, rows // Q_BLOCK_SIZE].repeat_interleave(block, -1)[..., :n]   # [Hq, R, N]
        kept = torch.einsum("hrn,nj->hj", probs * keep, member)
        selected = blocks[:, int(rows[-1]) // Q_BLOCK_SIZE].gather(1, main)          # [Hq, 4]
        budget = (plan.budgets[0, :, segment] / block if plan.budgets is not None
                  else torch.full((q.shape[0],), float("nan")))
        nkeep = blocks[:, flat_rows // Q_BLOCK_SIZE].repeat_interleave(block, -1)[..., :n]
        own = (needle_probs * nkeep).sum(-1).unflatten(1, needle_rows.shape).mean(-1)  # [Hq, 4]
        out[name] = dict(share=kept / mass.clamp_min(1e-30), selected=selected,
                         fixed=~free.gather(0, main.flatten()).view_as(main), budget=budget, own=own)
    return dict(mass=mass / len(rows), rank=rank), out


def summarise(dense: dict[str, torch.Tensor], rules: dict[str, dict[str, torch.Tensor]], layer_ids: list[int],
              attend: float, top: int) -> dict[str, Any]:
    """Per rule and needle: heads attending, mean kept share, losses (> 50% lost) by category, the top losers."""
    mass, rank = dense["mass"], dense["rank"]                                       # [L, Hq, 4]
    result: dict[str, Any] = {}
    for name, r in rules.items():
        per_needle = {}
        for i, needle in enumerate(NEEDLES):
            m, share = mass[..., i], r["share"][..., i]
            attending = m >= attend
            lost = attending & (share < 0.5)
            budget = r["budget"]                                                    # [L, Hq]
            floor = lost & ~r["selected"][..., i] & (rank[..., i] > budget)
            ranking = lost & ~r["selected"][..., i] & (rank[..., i] <= budget)
            split = lost & r["selected"][..., i]
            loss = (m * (1 - share)).masked_fill(~lost, -1).flatten()
            order = loss.argsort(descending=True)[: min(top, int(lost.sum()))]
            heads = m.shape[1]
            per_needle[needle] = {
                "heads_attending": int(attending.sum()),
                "mean_kept_share": round(float(share[attending].mean()), 4) if attending.any() else None,
                "mass_weighted_kept": round(float((m * share)[attending].sum() / m[attending].sum()), 4)
                if attending.any() else None,
                "lose_over_half": int(lost.sum()),
                "floor": int(floor.sum()), "ranking": int(ranking.sum()), "split": int(split.sum()),
                "needle_rows_kept_mean": round(float(r["own"][..., i].mean()), 4),
                "needle_rows_kept_min": round(float(r["own"][..., i].min()), 4),
                "top_losers": [
                    {"layer": layer_ids[int(x) // heads], "head": int(x) % heads,
                     "mass_per_row": round(float(m.flatten()[x]), 4), "kept": round(float(share.flatten()[x]), 4),
                     "budget_blocks": float(budget.flatten()[x]), "true_rank": int(rank[..., i].flatten()[x]),
                     "category": "split" if bool(split.flatten()[x]) else
                     "floor" if bool(floor.flatten()[x]) else "ranking"}
                    for x in order.tolist()],
            }
        result[name] = per_needle
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--attend", type=float, default=0.05, help="mean mass per row that counts as attending")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=FIRST_RULES)
    parser.add_argument("--table", action="store_true", help="only print the tables of --out")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.table:
        report = json.loads(args.out.read_text(encoding="utf-8"))
        for length in sorted({p["length"] for p in report["prompts"].values()}):
            print_table(report, length)
        return
    from bench.loading import load_model

    model, tokenizer = load_model(args.model, device="cpu", dtype="float32")[:2]
    base = EntropyConfig()
    report: dict[str, Any] = {"model": args.model, "attend": args.attend,
                              "rules": {name: RULES[name] for name in args.rules}, "prompts": {}}
    if args.out.is_file():
        report["prompts"] = json.loads(args.out.read_text(encoding="utf-8")).get("prompts", {})
    for seed in args.seeds:
        started = time.time()
        sample, ids = build(tokenizer, args.length, seed)
        needle_spans, question = spans(tokenizer, sample, ids)
        n = len(ids)
        last = (n - 1) // base.segment_size * base.segment_size
        rows = torch.arange(max(question, last), n)
        width = min(end - start for start, end in needle_spans)
        needle_rows = torch.stack([torch.arange(start, start + width) for start, _ in needle_spans])
        member = torch.zeros(n, len(NEEDLES))
        for i, (start, end) in enumerate(needle_spans):
            member[start:end, i] = 1.0
        probes = probe_positions(n, base.segment_size, base.probes)[int(rows[-1]) // base.segment_size]
        probes_in_question = int((probes >= rows[0]).sum())     # of the rows' segment's probes
        layers = capture(model, ids, Path("runs") / f"value_loss_{args.length}_{seed}_v.pt")
        dense_parts, rule_parts, layer_ids = [], {name: [] for name in args.rules}, []
        for layer_idx, q, k, _, scale in layers:
            if layer_idx in base.dense_layers:
                continue
            layer_ids.append(layer_idx)
            dense, per_rule = study_layer(q.float(), k.float(), scale, layer_idx, rows, needle_rows, member, base,
                                          args.rules)
            dense_parts.append(dense)
            for name in args.rules:
                rule_parts[name].append(per_rule[name])
        stack = lambda parts: {key: torch.stack([p[key] for p in parts]) for key in parts[0]}  # noqa: E731
        summary = summarise(stack(dense_parts), {name: stack(p) for name, p in rule_parts.items()}, layer_ids,
                            args.attend, args.top)
        report["prompts"][f"{args.length}/{seed}"] = {
            "length": args.length, "seed": seed, "tokens": n, "question_rows": [int(rows[0]), n],
            "probes_in_question": [probes_in_question, base.probes], "needle_spans": needle_spans,
            "positions": sample.meta["positions"], "order": [*sample.meta["asked"]], "rules": summary}
        print(f"seed {seed}: {n} tokens, needles (asked order) at tokens {[s for s, _ in needle_spans]}, "
              f"question rows {int(rows[0])}-{n - 1} ({probes_in_question} of the segment's "
              f"{base.probes} probes among them), {time.time() - started:.0f} s", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    for length in sorted({p["length"] for p in report["prompts"].values()}):
        print_table(report, length)


def print_table(report: dict[str, Any], length: int) -> None:
    prompts = {key: p for key, p in report["prompts"].items() if p["length"] == length}
    seeds = ", ".join(str(p["seed"]) for p in prompts.values())
    print(f"{report['model']}, {length} tokens, seeds {seeds}; question rows in the last "
          f"segment; attending: mean mass per row >= {report['attend']}; per cell over the prompts: mean kept share "
          "over attending heads | (layer, head) pairs losing > 50% (floor/ranking/split) | needle rows' own kept")
    print(f"{'rule':22s} " + " ".join(f"{needle:>28s}" for needle in NEEDLES))
    for name in report["rules"]:
        cells = []
        for needle in NEEDLES:
            values = [p["rules"][name][needle] for p in prompts.values()]
            shares = [v["mean_kept_share"] for v in values if v["mean_kept_share"] is not None]
            share = f"{statistics.fmean(shares):.3f}" if shares else "  -  "
            lost = sum(v["lose_over_half"] for v in values)
            parts = "/".join(str(sum(v[c] for v in values)) for c in ("floor", "ranking", "split"))
            own = statistics.fmean(v["needle_rows_kept_mean"] for v in values)
            cells.append(f"{share} |{lost:3d} ({parts:>8s}) | {own:.3f}")
        print(f"{name:22s} " + " ".join(f"{cell:>28s}" for cell in cells))
    attending = [sum(p["rules"][next(iter(report["rules"]))][needle]["heads_attending"] for p in prompts.values())
                 for needle in NEEDLES]
    print("heads attending (sum over prompts): " + ", ".join(f"{n} {a}" for n, a in zip(NEEDLES, attending,
                                                                                            strict=True)))


if __name__ == "__main__":
    main()
