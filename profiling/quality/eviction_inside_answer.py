"""Answers that outlive the first eviction, on SmolLM2-135M-Instruct (CPU): which code digits the latent cache keeps.

A ~2.5k-token essay prompt with one planted "access code for the {colour} vault is NNNNN" sentence (`vault_needle`),
dense prefill, and a `LatentKVCache` that evicts ``--delay`` tokens into the answer (before the code is read). For
each setting: the answers, how many hold the code, and, at the first eviction, the share of (layer, KV head) pairs
that kept each digit of the code. Writes ``--out``/smollm2.json.

    python profiling/quality/eviction_inside_answer.py --prompts 6 --out docs/results/eviction_inside_answer
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the lab (bench/) is not installed: the checkout
import flexentropy as fe  # noqa: E402
from bench.data import load_essays, prompt_ids, vault_needle  # noqa: E402
from bench.loading import load_model  # noqa: E402
from flexentropy.integrations.hf import cache_keyword  # noqa: E402

SETTINGS = {   # name -> EntropyConfig changes (None: the full cache)
    "full": None,
    "b1024_span0": {"decode_budget": 1024, "decode_span": 0},
    "b1024_span16": {"decode_budget": 1024, "decode_span": 16},
    "b256_span0": {"decode_budget": 256, "decode_span": 0},
    "b256_span16": {"decode_budget": 256, "decode_span": 16},
    "b256_span4": {"decode_budget": 256, "decode_span": 4},
    "b256_pool1_span0": {"decode_budget": 256, "decode_pool": 1, "decode_span": 0},
    "b256_window64_span0": {"decode_budget": 256, "decode_window": 64, "decode_span": 0},
    "b256_span16_delay0": {"decode_budget": 256, "decode_delay": 0},
    "b1024_span16_delay0": {"decode_budget": 1024, "decode_delay": 0},
    "b128_span16": {"decode_budget": 128, "decode_span": 16},
    "b256_span64": {"decode_budget": 256, "decode_span": 64},
    "b1024_span64": {"decode_budget": 1024, "decode_span": 64},
}


def digit_positions(tokenizer: object, ids: list[int], code: str) -> list[int]:
    """Positions of the code's tokens in the prompt (the first run of tokens that spells it)."""
    pieces = [tokenizer.decode([t]).strip() for t in ids]
    for start in range(len(ids)):
        spelled, end = "", start
        while end < len(ids) and len(spelled) < len(code) and pieces[end].isdigit():
            spelled, end = spelled + pieces[end], end + 1
        if spelled == code:
            return list(range(start, end))
    raise ValueError(f"code {code} not found in the prompt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--delay", type=int, default=8)
    parser.add_argument("--context", type=int, default=2500)
    parser.add_argument("--new-tokens", type=int, default=16, help="fewer than delay + recompress_every (32)")
    parser.add_argument("--out", type=Path, default=Path("docs/results/eviction_inside_answer"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer, source = load_model(None, "cpu", "float32")
    base = fe.EntropyConfig(dense_prefix=1 << 20, decode_delay=args.delay)
    fe.enable(model, base, prefill="dense")
    essays = load_essays()
    prompts = []
    for seed in range(args.prompts):
        needle = vault_needle(seed)
        ids = prompt_ids(tokenizer, essays[seed * 20000:], needle.question, needle=needle, context_tokens=args.context)
        prompts.append((needle, ids, digit_positions(tokenizer, ids, needle.answer)))
    rows = {}
    for name, changes in SETTINGS.items():
        answers, right, kept_share, start = [], 0, [], time.time()
        for needle, ids, digits in prompts:
            cache = None if changes is None else fe.LatentKVCache(base.replace(**changes))
            kwargs = {} if cache is None else {cache_keyword(model): cache}
            out = model.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False, **kwargs)
            if cache is not None:   # one eviction (no recompression within the answer): what it kept of the code
                assert cache.layers[0].evictions == 1, "the answer must hold exactly one eviction"
                kept = torch.stack([torch.stack([(cache.kept_positions(i)[0] == p).any(-1) for p in digits], -1)
                                    for i in range(len(cache.layers))])          # [layers, Hkv, digits]
                kept_share.append(kept.float().mean(dim=(0, 1)).tolist())
            text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
            answers.append(text)
            right += needle.found_in(text)
        share = torch.tensor(kept_share).mean(0).tolist() if kept_share else None
        rows[name] = {"changes": changes, "right": right, "n": len(prompts), "answers": answers,
                      "digit_kept_share": share, "seconds": round(time.time() - start, 1)}
        print(f"{name:22s} {right}/{len(prompts)}  digits kept (share of layer x head): "
              f"{'-' if share is None else ' '.join(f'{s:.2f}' for s in share)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"model": source, "context": args.context, "delay": args.delay, "new_tokens": args.new_tokens,
              "torch": torch.__version__,
              "codes": [n.answer for n, _, _ in prompts], "rows": rows}
    (args.out / "smollm2.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
