"""Why SnapKV (B_d 1024) fails some niah_single 2048-token samples on SmolLM2-135M-Instruct: not a bug, one head.

What it shows, per sample (default indices 0 3 6 7 of the eval's niah_single / 2048 tokens / question outside /
seed 0 draw, i.e. the prompts of ``runs/smollm2/niah_single/2048/q-outside/dense__snapkv-b1024``):

1. the needle digits' token positions, and SnapKV B_d 1024's greedy output (flexentropy's ``PolicyCache``, dense
   prefill, exactly as the eval runs it) against the answer and against the committed run's prediction;
2. the overlap, per (layer, KV head), between the prompt entries our cache keeps and an independent kvpress-style
   rescoring of the same prompt (last 64 prompt queries, causal softmax, window columns dropped, mean over the window
   queries, avg-pool 5, mean over the query heads of each GQA group, window forced in, top-k);
3. how many of the needle digits each (layer, KV head) keeps;
4. the one-head ablation: for every (layer, KV head) that loses needle digits under SnapKV, the greedy answer when
   only those digits are hidden from that head in an otherwise full cache; the heads whose single ablation
   reproduces SnapKV's wrong answer;
5. the add-back: SnapKV's kept sets plus the needle digits (in every head, then in the culprit heads only).

Masked decoding: a full cache of the prompt (transformers ``Cache`` of preallocated ``DynamicLayer``s) plus a
per-(layer, KV head) boolean mask over its prompt positions, applied by an attention function registered through
transformers' ``AttentionInterface`` (the mask sets travel as a forward keyword; nothing is patched). A mechanics
check first confirms that decoding over SnapKV's compressed cache equals this masked full-cache decode with SnapKV's
kept sets (teacher-forced on SnapKV's tokens).

Run from the repository root (CPU, about 2.5 minutes for 4 samples on 2 busy cores)::

    python profiling/quality/snapkv_diagnosis.py [--samples 0 3 6 7] [--budget 1024] [--new-tokens 12]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from archive import runs_folder  # this folder, run as a script
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the lab (bench/) is not installed: the checkout
from bench.eval.metrics import string_match_all  # noqa: E402
from bench.eval.resolve import apply_prefill, make_prefill_policy, make_run_cache  # noqa: E402
from bench.eval.runner import EVAL_CONFIG, load_model  # noqa: E402
from bench.eval.tasks import make_sample, sample_ids  # noqa: E402
from flexentropy.policies import SnapKV  # noqa: E402

TASK, LENGTH, PLACEMENT, SEED = "niah_single", 2048, "outside", 0
RUN_DIR = runs_folder("quality") / "smollm2/niah_single/2048/q-outside"
MASKED = "snapdiag_masked"
"""Name of the masked attention function registered in transformers' ``AttentionInterface``."""

Head = tuple[int, int]
"""(layer, KV head)."""
KeepSets = dict[int, torch.Tensor]
"""layer -> bool ``[Hkv, N]``: the prompt positions each KV head may attend at decode (missing layer: all)."""


# --------------------------------------------------------------------------------------------------------------
# masked full-cache attention


def masked_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs: Any
                     ) -> tuple[torch.Tensor, None]:
    """Prompt: HF's SDPA attention, recording the last window queries (``snapdiag_queries``: layer -> post-RoPE
    ``[1, Hq, W, D]``). Decode: exact grouped attention hiding from each KV head the prompt positions not in
    ``snapdiag_keep`` (layer -> bool ``[Hkv, N]``; a layer not in it attends everything)."""
    layer = module.layer_idx
    if query.shape[-2] == key.shape[-2]:
        record = kwargs.get("snapdiag_queries")
        if record is not None:
            record[layer] = query[:, :, -kwargs["snapdiag_window"]:].clone()
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)
    # decode: plain grouped attention (SDPA's CPU kernel is slow for one query over 2k keys), a mask per KV head
    batch, heads, steps, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * steps, dim)
    weights = grouped @ key.transpose(-1, -2) * (dim**-0.5 if scaling is None else scaling)  # [B, Hkv, G*L, T]
    keep = kwargs.get("snapdiag_keep", {}).get(layer)
    if keep is not None:
        hidden = torch.zeros(weights.shape[-1], dtype=torch.bool).repeat(kv_heads, 1)
        hidden[:, : keep.shape[-1]] = ~keep  # generated tokens stay visible
        weights = weights.masked_fill(hidden[None, :, None, :], float("-inf"))
    out = weights.softmax(-1) @ value                                                        # [B, Hkv, G*L, Dv]
    return out.reshape(batch, heads, steps, -1).transpose(1, 2).contiguous(), None


@contextmanager
def attention(model: Any, name: str) -> Iterator[None]:
    """Run ``model`` under attention implementation ``name``, then restore the previous one."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` writing into a buffer of ``capacity`` tokens: a decode step copies only its new entry (a
    ``DynamicLayer`` re-concatenates the whole 2k-token cache every step, the bulk of a CPU decode step here)."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer = key_states.new_empty(*key_states.shape[:2], self.capacity, key_states.shape[-1])
        self.value_buffer = value_states.new_empty(*value_states.shape[:2], self.capacity, value_states.shape[-1])
        self.keys, self.values = self.key_buffer[..., :0, :], self.value_buffer[..., :0, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, stop = self.keys.shape[-2], self.keys.shape[-2] + key_states.shape[-2]
        if stop > self.capacity:
            raise ValueError(f"PreallocatedLayer holds {self.capacity} tokens, {stop} asked")
        self.key_buffer[..., start:stop, :] = key_states
        self.value_buffer[..., start:stop, :] = value_states
        self.keys, self.values = self.key_buffer[..., :stop, :], self.value_buffer[..., :stop, :]
        return self.keys, self.values


@dataclass
class FullPrompt:
    """The prompt's full cache and what the masked decodes share."""

    cache: Cache
    first_token: int
    queries: dict[int, torch.Tensor]  # layer -> [1, Hq, W, D] post-RoPE window queries
    length: int

    def keys(self, layer: int) -> torch.Tensor:
        return self.cache.layers[layer].keys[..., : self.length, :]


def prefill_full(model: Any, ids: list[int], window: int, new_tokens: int) -> FullPrompt:
    capacity = len(ids) + new_tokens
    cache = Cache(layers=[PreallocatedLayer(capacity) for _ in range(model.config.num_hidden_layers)])
    queries: dict[int, torch.Tensor] = {}
    with attention(model, MASKED):
        logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True, snapdiag_queries=queries,
                       snapdiag_window=window).logits[0, -1]
    return FullPrompt(cache, int(logits.argmax()), queries, len(ids))


def masked_decode(model: Any, full: FullPrompt, keep: KeepSets, steps: int, eos: set[int],
                  forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy decode (or teacher-forced on ``forced``) over the full prompt cache with ``keep`` masks; returns the
    tokens and the logits of each step after the first token ``[steps - 1, V]``. The cache is cropped back."""
    tokens, logits = [forced[0] if forced else full.first_token], []
    try:
        with attention(model, MASKED):
            while len(tokens) < (len(forced) if forced else steps) and (forced or tokens[-1] not in eos):
                step = model(torch.tensor([[tokens[-1]]]), past_key_values=full.cache, use_cache=True,
                             snapdiag_keep=keep).logits[0, -1]
                logits.append(step)
                tokens.append(forced[len(tokens)] if forced else int(step.argmax()))
    finally:
        full.cache.crop(full.length - full.cache.get_seq_length())  # drop the generated tokens
    return tokens, torch.stack(logits) if logits else torch.empty(0)


# --------------------------------------------------------------------------------------------------------------
# the pieces of one sample


def needle_positions(tokenizer: Any, ids: list[int], value: str) -> list[int]:
    """Token positions of the needle's value (its digits) in the prompt."""
    starts, text = [], ""
    for token in ids:
        starts.append(len(text))
        text += tokenizer.decode([token])
    at = text.find(value)
    if at < 0 or text.find(value, at + 1) >= 0:
        raise ValueError(f"needle value {value!r} found {text.count(value)} times in the prompt")
    return [i for i, start in enumerate(starts) if at <= start < at + len(value)]


def kvpress_keep(keys: torch.Tensor, queries: torch.Tensor, budget: int, pool: int) -> torch.Tensor:
    """Independent SnapKV rescoring (kvpress style, float64): kept prompt positions ``[Hkv, budget]``, ascending.

    keys ``[1, Hkv, N, D]`` of the whole prompt; queries ``[1, Hq, W, D]`` of its last ``W`` tokens (post-RoPE).
    """
    k, q = keys[0].double(), queries[0].double()
    heads, length, dim = k.shape
    groups, window = q.shape[0] // heads, q.shape[1]
    logits = q @ k.repeat_interleave(groups, dim=0).transpose(-1, -2) / math.sqrt(dim)       # [Hq, W, N]
    causal = torch.ones(window, length, dtype=torch.bool).triu(length - window + 1)           # future keys
    weights = logits.masked_fill(causal, float("-inf")).softmax(-1)[..., : length - window]  # drop window columns
    scores = F.avg_pool1d(weights.mean(-2)[:, None], pool, stride=1, padding=pool // 2)[:, 0]
    scores = scores.view(heads, groups, -1).mean(1)                                            # [Hkv, N - W]
    scores = F.pad(scores, (0, window), value=float("inf"))                                     # window forced in
    return scores.topk(budget, dim=-1).indices.sort(-1).values


def to_mask(sets: list[torch.Tensor], length: int) -> KeepSets:
    """Per-layer kept positions ``[Hkv, K]`` -> bool masks ``[Hkv, length]``."""
    masks = {}
    for layer, kept in enumerate(sets):
        mask = torch.zeros(kept.shape[0], length, dtype=torch.bool)
        mask.scatter_(1, kept, True)
        masks[layer] = mask
    return masks


def committed_prediction(budget: int, index: int) -> str | None:
    path = RUN_DIR / f"dense__snapkv-b{budget}" / "predictions.jsonl"
    if not path.is_file():
        return None
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record["index"] == index:
            return record["prediction"]
    return None


def verdict(text: str, answer: str) -> str:
    """The eval's score of a generation (string match of the answer): ``correct`` or ``WRONG``."""
    return "correct" if string_match_all(text, [answer]) == 1.0 else "WRONG"


def fmt_heads(heads: list[Head]) -> str:
    return ", ".join(f"L{layer}h{head}" for layer, head in heads) or "-"


# --------------------------------------------------------------------------------------------------------------
# one sample


def diagnose(loaded: Any, index: int, budget: int, new_tokens: int) -> dict[str, Any]:
    model, tokenizer = loaded.model, loaded.tokenizer
    policy = SnapKV(budget=budget)
    sample = make_sample(TASK, LENGTH, index, tokenizer, SEED)
    ids = sample_ids(tokenizer, sample, PLACEMENT)
    length, answer = len(ids), sample.answers[0]
    needle = needle_positions(tokenizer, ids, answer)
    eos_id = model.generation_config.eos_token_id
    eos = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    decode = tokenizer.decode
    print(f"\n=== sample {index}: {length} prompt tokens, answer {answer} ===")
    print(f"[1] needle digits at positions {needle} ({[decode([ids[i]]) for i in needle]})")

    # SnapKV as the eval runs it: flexentropy attention, dense prefill, PolicyCache, greedy generate
    cache = make_run_cache(model, "snapkv", budget)
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                         max_new_tokens=sample.max_new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    snap_tokens = out.sequences[0, length:].tolist()
    snap_logits = torch.stack(out.logits)[:, 0]
    snap = decode(snap_tokens, skip_special_tokens=True)
    committed = committed_prediction(budget, index)
    layers = len(cache.layers)
    evictions = {layer.evictions for layer in cache.layers}
    kept = [cache.kept_positions(i)[0, :, :budget] for i in range(layers)]  # prompt entries (later tokens follow)
    ascending = all(bool((k[:, 1:] > k[:, :-1]).all()) for k in kept)
    heads = kept[0].shape[0]
    print(f"    SnapKV B_d {budget}: {snap!r} ({verdict(snap, answer)}); committed run: "
          f"{'n/a (not in the committed run)' if committed is None else repr(committed)}"
          f"{'' if committed is None else (' (same)' if committed == snap else ' (DIFFERENT)')}")
    print(f"    cache: evictions per layer {sorted(evictions)}, {kept[0].shape[-1]} prompt entries per head, "
          f"kept positions ascending: {ascending}, all < N: {all(bool((k < length).all()) for k in kept)}")

    # the full prompt cache (masked decodes) and the window queries (rescoring)
    full = prefill_full(model, ids, policy.window, max(new_tokens, sample.max_new_tokens))
    snap_keep = to_mask(kept, length)
    ref_tokens, ref_logits = masked_decode(model, full, snap_keep, 0, eos, forced=snap_tokens)
    dlogit = (ref_logits - snap_logits[1:]).abs().max().item() if len(snap_tokens) > 1 else 0.0
    same_first = full.first_token == snap_tokens[0]
    print(f"    mechanics: SnapKV cache decode vs masked full-cache decode with SnapKV's sets (teacher-forced, "
          f"{len(snap_tokens)} tokens): first token equal {same_first}, max |dlogit| {dlogit:.1e}, argmax equal "
          f"{bool((ref_logits.argmax(-1) == snap_logits[1:].argmax(-1)).all())}")

    # 2. independent kvpress-style rescoring
    overlap = {}
    for layer in range(layers):
        ref = kvpress_keep(full.keys(layer), full.queries[layer], budget, policy.pool)
        for head in range(heads):
            overlap[layer, head] = len(set(ref[head].tolist()) & set(kept[layer][head].tolist()))
    print(f"[2] overlap with kvpress-style rescoring: min {min(overlap.values())}/{budget}, "
          f"{sum(v == budget for v in overlap.values())}/{len(overlap)} (layer, KV head) pairs identical")

    # 3. needle digits kept per (layer, KV head)
    digits = torch.tensor(needle)
    kept_digits = {(layer, head): int(torch.isin(digits, kept[layer][head]).sum())
                   for layer in range(layers) for head in range(heads)}
    n = len(needle)
    every = [h for h, c in kept_digits.items() if c == n]
    some = [h for h, c in kept_digits.items() if 0 < c < n]
    none = [h for h, c in kept_digits.items() if c == 0]
    print(f"[3] needle digits kept ({n} digits): all in {len(every)} heads, some in {len(some)}, none in {len(none)} "
          f"(of {len(kept_digits)})")
    for head in range(heads):
        row = " ".join(str(kept_digits[layer, head]) for layer in range(layers))
        print(f"    KV head {head}, layers 0-{layers - 1}: {row}")

    # 4. one-head ablations: the full cache with only this head's lost digits hidden
    start = time.perf_counter()
    full_answer = decode(masked_decode(model, full, {}, new_tokens, eos)[0], skip_special_tokens=True)
    by_answer: dict[str, list[Head]] = defaultdict(list)
    losing = [h for h, c in kept_digits.items() if c < n]
    for layer, head in losing:
        mask = torch.ones(heads, length, dtype=torch.bool)
        mask[head, needle] = snap_keep[layer][head, needle]  # hide only the needle digits this head lost
        tokens = masked_decode(model, full, {layer: mask}, new_tokens, eos)[0]
        by_answer[decode(tokens, skip_special_tokens=True)].append((layer, head))
    print(f"[4] full cache (masked decode, no mask): {full_answer!r} ({verdict(full_answer, answer)}); one-head "
          f"ablations of the {len(losing)} heads that lose digits ({time.perf_counter() - start:.0f} s):")
    for text, found in sorted(by_answer.items(), key=lambda item: -len(item[1])):
        tag = " <- SnapKV's output" if text == snap else ""
        shown = f"{len(found)} heads" if len(found) > 6 else fmt_heads(found)
        print(f"    {text!r}: {shown}{tag}")
    culprits = by_answer.get(snap, []) if snap != full_answer else []
    print(f"    heads whose single ablation reproduces SnapKV's output: {fmt_heads(culprits)}")

    # 5. add-back: SnapKV's kept sets plus the needle digits
    every_head = {layer: mask.clone() for layer, mask in snap_keep.items()}
    for mask in every_head.values():
        mask[:, needle] = True
    restored = decode(masked_decode(model, full, every_head, new_tokens, eos)[0], skip_special_tokens=True)
    line = f"[5] SnapKV's sets + needle digits in every head: {restored!r} ({verdict(restored, answer)})"
    if culprits:
        only = {layer: mask.clone() for layer, mask in snap_keep.items()}
        for layer, head in culprits:
            only[layer][head, needle] = True
        text = decode(masked_decode(model, full, only, new_tokens, eos)[0], skip_special_tokens=True)
        line += f"; + digits in {fmt_heads(culprits)} only: {text!r} ({verdict(text, answer)})"
    print(line)
    return {"index": index, "snap": snap, "answer": answer, "culprits": culprits, "restored": restored,
            "min_overlap": min(overlap.values()), "dlogit": dlogit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[0, 3, 6, 7], help="niah_single sample indices")
    parser.add_argument("--budget", type=int, default=1024, help="SnapKV B_d (entries per KV head)")
    parser.add_argument("--new-tokens", type=int, default=12, help="greedy tokens of each masked decode")
    args = parser.parse_args()
    torch.manual_seed(0)
    AttentionInterface.register(MASKED, masked_attention)
    start = time.perf_counter()
    loaded = load_model(device="cpu")
    apply_prefill(loaded.model, make_prefill_policy("dense", EVAL_CONFIG, None))  # as the eval's dense__* runs
    print(f"SnapKV diagnosis: {TASK} {LENGTH} tokens, question {PLACEMENT}, seed {SEED}, B_d {args.budget}, "
          f"samples {args.samples}; model {Path(loaded.source).name}")
    results = []
    with torch.inference_mode():
        for index in args.samples:
            results.append(diagnose(loaded, index, args.budget, args.new_tokens))
    print("\n=== summary ===")
    for r in results:
        print(f"sample {r['index']}: SnapKV {r['snap']!r} vs {r['answer']}; kvpress overlap min {r['min_overlap']}/"
              f"{args.budget}; mechanics max |dlogit| {r['dlogit']:.1e}; culprit head(s) {fmt_heads(r['culprits'])}; "
              f"add-back {r['restored']!r}")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
