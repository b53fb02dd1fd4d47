"""What the latent cache's first eviction keeps against what the answer then reads: each scoring knob's kept set
against an oracle, the dense attention of the answer's own later tokens (SmolLM2-135M-Instruct, CPU).

For each prompt (a vault needle, as in ``eviction_inside_answer.py``): the full cache's greedy answer, then the model's
post-RoPE q/k over prompt + answer (`capture_qkv`). At the first decision, ``delay`` tokens into the answer, every
setting scores the entries held with the window of queries before it and keeps ``budget`` per KV head (the window's
own entries first, as the cache does). The oracle weight of an entry is the attention it gets from the answer's
tokens after the decision, averaged over them and over the group's query heads. Per (layer, KV head):
recall = the oracle weight on the kept entries / the oracle weight on every entry held; ``needed`` = the share kept
of the entries that some later token, in some query head of the group, gives at least ``--needed`` of its attention
(what a copy reads at the moment it copies, which a mean over the answer dilutes), and the same over the code's
digits alone (``digits_needed_kept``: the (layer, head) pairs that read a digit, not all of them). ``oracle`` keeps
the top ``budget`` by the mean weight, ``oracle_needed`` by the largest. Also the share of (layer, KV head) pairs that
kept each digit of the code. Writes ``--out``/kept_vs_oracle.json and a per-layer plot.

    python profiling/quality/kept_vs_oracle.py --prompts 6 --out docs/results/eviction_inside_answer
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from eviction_inside_answer import digit_positions

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the lab (bench/) is not installed: the checkout
from bench.data import load_essays, prompt_ids, vault_needle  # noqa: E402
from bench.eval.capture import capture_qkv  # noqa: E402
from bench.loading import load_model  # noqa: E402
from flexentropy.kv import keep_indices, pool_scores, spread_forward, window_attention_scores  # noqa: E402

DEFAULT = {"window": 32, "pool": 5, "span": 16, "kind": "softmax", "group": "mean", "split": "none"}
SETTINGS = {   # name -> changes to the default scoring (EntropyConfig's decode_* defaults)
    "default": {},
    "span0": {"span": 0},
    "span0_pool1": {"span": 0, "pool": 1},
    "window8": {"window": 8},
    "window64": {"window": 64},
    "raw": {"kind": "raw"},
    "group_max": {"group": "max"},
    "heads_shared": {"split": "heads"},     # one top-k over the layer's KV heads (per-head counts, as AdaKV)
    "pyramid": {"split": "layers"},         # 1.5x the budget in the first layer down to 0.5x in the last (PyramidKV)
}


def scores(q: torch.Tensor, k: torch.Tensor, at: int, setting: dict) -> torch.Tensor:
    """``[1, Hkv, at]`` scores of the ``at`` entries held at the decision, from the window of queries before it."""
    window = setting["window"]
    query, keys = q[:, :, at - window:at], k[:, :, :at]
    group = q.shape[1] // k.shape[1]
    if setting["group"] == "max":   # each query head scores alone, the group keeps its best head's view
        keys = keys.repeat_interleave(group, dim=1)
    raw = window_attention_scores(query, keys, query_positions=torch.arange(at - window, at),
                                  key_positions=torch.arange(at), kind=setting["kind"])
    if setting["group"] == "max":
        raw = raw.unflatten(1, (k.shape[1], group)).amax(dim=2)
    return spread_forward(pool_scores(raw, setting["pool"]), setting["span"])


def kept_mask(ranked: torch.Tensor, budget: int, window: int, split: str) -> torch.Tensor:
    """bool ``[1, Hkv, at]``: ``budget`` entries per KV head (the last ``window`` first), or with ``split="heads"``
    ``budget * Hkv`` over the layer's heads together (each head's window first)."""
    if split != "heads":
        kept = keep_indices(ranked, budget, window)
        return torch.zeros_like(ranked, dtype=torch.bool).scatter_(-1, kept, True)
    forced = ranked.clone()
    forced[..., -window:] = float("inf")
    flat = forced.flatten(1).topk(min(budget * ranked.shape[1], forced[0].numel()), dim=-1).indices
    return torch.zeros_like(ranked, dtype=torch.bool).flatten(1).scatter_(-1, flat, True).view_as(ranked)


def oracle_weight(q: torch.Tensor, k: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, Hkv, at]`` mean and largest attention the answer's tokens after the decision give the entries held at
    it (over those tokens and the group's query heads)."""
    length, group = q.shape[2], q.shape[1] // k.shape[1]
    logits = q[:, :, at:] @ k.repeat_interleave(group, dim=1).transpose(-1, -2) * q.shape[-1] ** -0.5
    causal = torch.arange(length) <= torch.arange(at, length)[:, None]
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)[..., :at]      # [1, Hq, F, at]
    grouped = probs.unflatten(1, (k.shape[1], group))
    return grouped.mean(dim=(2, 3)), grouped.amax(dim=(2, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--delays", type=int, nargs="+", default=[0, 8, 16])
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 1024])
    parser.add_argument("--context", type=int, default=2500)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--needed", type=float, default=0.1, help="attention share that makes an entry needed")
    parser.add_argument("--out", type=Path, default=Path("docs/results/eviction_inside_answer"))
    parser.add_argument("--replot", action="store_true", help="only plot --out's JSON again")
    args = parser.parse_args()
    if args.replot:
        data = json.loads((args.out / "kept_vs_oracle.json").read_text())
        args.delays, args.budgets = data["meta"]["delays"], data["meta"]["budgets"]
        plot(data["summary"], args, args.out / "kept_vs_oracle.png")
        return
    model, tokenizer, source = load_model(None, "cpu", "float32")
    essays = load_essays()
    recall: dict[str, list[torch.Tensor]] = {}     # "delay/budget/setting" -> per prompt [layers, Hkv]
    needed_kept: dict[str, list[torch.Tensor]] = {}
    digits_needed: dict[str, list[torch.Tensor]] = {}   # [kept and needed, needed] over (layer, head, digit)
    digits_kept: dict[str, list[list[float]]] = {}
    for seed in range(args.prompts):
        needle = vault_needle(seed)
        ids = prompt_ids(tokenizer, essays[seed * 20000:], needle.question, needle=needle, context_tokens=args.context)
        digits = digit_positions(tokenizer, ids, needle.answer)
        out = model.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             do_sample=False)
        layers = capture_qkv(model, out[:, :-1])
        print(f"prompt {seed}: {len(ids)} tokens, answer {tokenizer.decode(out[0, len(ids):])!r}", flush=True)
        weights = {delay: [oracle_weight(layer.q.float(), layer.k.float(), len(ids) + delay) for layer in layers]
                   for delay in args.delays}
        for delay in args.delays:
            at = len(ids) + delay
            for budget in args.budgets:
                for name, changes in {**SETTINGS, "oracle": None, "oracle_needed": None}.items():
                    setting = {**DEFAULT, **(changes or {})}
                    per_layer, needed, kept_digits, digit_counts = [], [], [], torch.zeros(2)
                    for index, layer in enumerate(layers):
                        weight, largest = weights[delay][index]
                        share = 1.5 - index / max(len(layers) - 1, 1) if setting["split"] == "layers" else 1.0
                        ranked = {"oracle": weight, "oracle_needed": largest}.get(name)
                        if ranked is None:
                            ranked = scores(layer.q.float(), layer.k.float(), at, setting)
                        kept = kept_mask(ranked, round(budget * share), 0 if changes is None else setting["window"],
                                         setting["split"])
                        per_layer.append(((weight * kept).sum(-1) / weight.sum(-1))[0])
                        wanted = largest >= args.needed
                        needed.append(((kept & wanted).sum() / wanted.sum().clamp(min=1)).reshape(()))
                        kept_digits.append(kept[0][:, digits])
                        wanted_digits = wanted[0][:, digits]
                        digit_counts += torch.stack([(kept[0][:, digits] & wanted_digits).sum(),
                                                     wanted_digits.sum()]).float()
                    key = f"{delay}/{budget}/{name}"
                    recall.setdefault(key, []).append(torch.stack(per_layer))
                    needed_kept.setdefault(key, []).append(torch.stack(needed))
                    digits_needed.setdefault(key, []).append(digit_counts)
                    digits_kept.setdefault(key, []).append(torch.stack(kept_digits).float().mean(dim=(0, 1)).tolist())
    summary = {}
    for key, values in recall.items():
        per_layer = torch.stack(values).mean(dim=0)          # [layers, Hkv], mean over prompts
        worst = per_layer.flatten().argsort()[:5]
        needed = torch.stack(needed_kept[key]).mean(dim=0)   # [layers]
        summary[key] = {"recall": per_layer.mean().item(), "worst_layer_recall": per_layer.mean(-1).min().item(),
                        "needed": needed.mean().item(), "needed_per_layer": needed.tolist(),
                        "digits_needed_kept": (lambda c: (c[0] / c[1]).item())(torch.stack(digits_needed[key]).sum(0)),
                        "digits_needed": int(torch.stack(digits_needed[key]).sum(0)[1]),
                        "worst_pairs": [(int(i) // per_layer.shape[1], int(i) % per_layer.shape[1],
                                         round(per_layer.flatten()[i].item(), 3)) for i in worst],
                        "per_layer": per_layer.mean(-1).tolist(),
                        "digits_kept": torch.tensor(digits_kept[key]).mean(dim=0).tolist()}
    for key, row in summary.items():
        print(f"{key:24s} recall {row['recall']:.3f}  worst layer {row['worst_layer_recall']:.3f}  needed kept "
              f"{row['needed']:.3f}  needed digits kept {row['digits_needed_kept']:.3f} of {row['digits_needed']}  "
              f"digits kept "
              f"{[round(x, 2) for x in row['digits_kept']]}")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": source, "prompts": args.prompts, "context": args.context, "new_tokens": args.new_tokens,
            "delays": args.delays, "budgets": args.budgets, "needed": args.needed, "default": DEFAULT,
            "settings": SETTINGS}
    (args.out / "kept_vs_oracle.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
    plot(summary, args, args.out / "kept_vs_oracle.png")


def plot(summary: dict, args: argparse.Namespace, path: Path) -> None:
    """At the middle delay, per setting and budget: the share of needed digit reads kept (what the answer's copy
    reads) beside the share of the answer's mean attention kept (which ranks the settings the other way)."""
    import matplotlib.pyplot as plt

    delay = args.delays[len(args.delays) // 2]
    names = [*SETTINGS, "oracle", "oracle_needed"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), sharey=True)
    width = 0.8 / len(args.budgets)
    for ax, field, title in ((axes[0], "digits_needed_kept", "needed digit reads kept"),
                             (axes[1], "recall", "answer's mean attention on kept entries")):
        for i, budget in enumerate(args.budgets):
            values = [summary[f"{delay}/{budget}/{name}"][field] for name in names]
            ax.bar([x + i * width for x in range(len(names))], values, width, label=f"decode_budget {budget}")
        ax.set_xticks([x + width * (len(args.budgets) - 1) / 2 for x in range(len(names))], names, rotation=45,
                      ha="right", fontsize=8)
        ax.set_title(f"{title}, eviction {delay} tokens into the answer", fontsize=9)
    axes[0].set_ylabel("share")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
