"""The paired checks quoted in docs/quality.md (H200 section), from the committed predictions; writes checks.txt.

Run from the repository root: ``python docs/results/quality_h200/checks.py``.
1. batch_check/: the runs repeated in batches of 8 against the one-by-one runs: identical new tokens, median timings.
2. niah_single, full cache: per-sample (paired) wins and losses of entropy against critiprefill and streaming at the
   same B_0 (a win: entropy answers a sample the other misses).
3. streamingllm at B_d 1024 on niah_single: which samples it answers, against where the needle lies.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
RUNS = HERE / "runs" / "smollm2"


def records(folder: Path) -> dict[int, dict]:
    lines = (folder / "predictions.jsonl").read_text(encoding="utf-8").splitlines()
    return {r["index"]: r for r in map(json.loads, lines)}


def metrics(folder: Path) -> dict:
    return json.loads((folder / "metrics.json").read_text(encoding="utf-8"))


def main() -> None:
    out = ["1. batched (8) against one by one, bf16 on the H200"]
    for batched in sorted((HERE / "batch_check" / "runs").glob("**/predictions.jsonl")):
        rel = batched.parent.relative_to(HERE / "batch_check" / "runs")
        a, b = records(HERE / "runs" / rel), records(batched.parent)
        same = sum(a[i]["new_token_ids"] == b[i]["new_token_ids"] for i in b)
        ma, mb = metrics(HERE / "runs" / rel), metrics(batched.parent)
        out.append(f"   {rel}: identical tokens {same}/{len(b)}; median prefill {ma['prefill_s']:.3f} s one by one, "
                   f"{mb['prefill_s']:.3f} s per batch of 8; median decode step {1e3 * ma['decode_s_per_token']:.1f} "
                   f"ms one by one, {1e3 * mb['decode_s_per_token']:.1f} ms per batch of 8")
    out.append("2. niah_single, full cache: entropy's paired wins/losses against the uniform policies at the same B_0")
    for length in (2048, 3072, 4096):
        total = {"critiprefill": [0, 0], "streaming": [0, 0]}
        for budget in (64, 128, 256):
            base = RUNS / "niah_single" / str(length) / "q-outside"
            entropy = records(base / f"entropy-b{budget}__full")
            for other, tally in total.items():
                rival = records(base / f"{other}-b{budget}__full")
                tally[0] += sum(entropy[i]["score"] > rival[i]["score"] for i in entropy)
                tally[1] += sum(entropy[i]["score"] < rival[i]["score"] for i in entropy)
        out.append(f"   {length} tokens, B_0 64+128+256: " + "; ".join(
            f"vs {other} {w} wins, {lost} losses" for other, (w, lost) in total.items()))
    stream = records(RUNS / "niah_single" / "2048" / "q-outside" / "dense__streamingllm-b1024")
    late = {i for i, r in stream.items() if r["meta"]["depths"][0] > 0.5}
    right = {i for i, r in stream.items() if r["score"] == 1.0}
    out.append(f"3. streamingllm B_d 1024, niah_single 2048: {len(right)} of {len(stream)} answered; needle past the "
               f"middle in {len(late)}; answered == past the middle: {right == late}")
    text = "\n".join(out) + "\n"
    (HERE / "checks.txt").write_text(text, encoding="utf-8")
    print(text, end="")


if __name__ == "__main__":
    main()
