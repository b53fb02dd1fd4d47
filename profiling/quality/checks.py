"""The paired checks quoted in docs/quality.md (H200 section), from the committed predictions; writes checks.txt.

Run: ``python profiling/quality/checks.py`` (the raw runs come from the studies' packed runs, `archive.runs_folder`).
1. batch_check/: the runs repeated in batches of 8 against the one-by-one runs: identical new tokens, median timings.
2. niah_single, full cache: per-sample (paired) wins and losses of entropy against critiprefill and streaming at the
   same B_0 (a win: entropy answers a sample the other misses).
3. streamingllm at B_d 1024 on niah_single: which samples it answers, against where the needle lies.
4. Gemma-3-270m (../gemma3_h200/), full cache, B_0 128: the same paired wins/losses of entropy on the multi-needle
   tasks at 8k and 16k (fractional scores: a win is a sample where entropy scores higher).
5. Gemma-3-270m, snapkv and adakv on niah_single at 8k: how many wrong answers still contain the needle's first
   three digits (the needle partly kept).
"""

from __future__ import annotations

import json
from pathlib import Path

from archive import RESULTS, runs_folder  # this folder (run as a script)

HERE = RESULTS / "quality_h200"
RUNS = runs_folder("quality_h200") / "smollm2"
GEMMA = runs_folder("gemma3_h200") / "gemma3-270m"
BATCHED = runs_folder("quality_h200/batch_check")


def records(folder: Path) -> dict[int, dict]:
    lines = (folder / "predictions.jsonl").read_text(encoding="utf-8").splitlines()
    return {r["index"]: r for r in map(json.loads, lines)}


def metrics(folder: Path) -> dict:
    return json.loads((folder / "metrics.json").read_text(encoding="utf-8"))


def paired(entropy: dict[int, dict], rival: dict[int, dict]) -> tuple[int, int]:
    """(samples entropy scores higher on, samples it scores lower on)."""
    return (sum(entropy[i]["score"] > rival[i]["score"] for i in entropy),
            sum(entropy[i]["score"] < rival[i]["score"] for i in entropy))


def main() -> None:
    out = ["1. batched (8) against one by one, bf16 on the H200"]
    for batched in sorted(BATCHED.glob("**/predictions.jsonl")):
        rel = batched.parent.relative_to(BATCHED)
        a, b = records(RUNS.parent / rel), records(batched.parent)
        same = sum(a[i]["new_token_ids"] == b[i]["new_token_ids"] for i in b)
        ma, mb = metrics(RUNS.parent / rel), metrics(batched.parent)
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
                won, lost = paired(entropy, records(base / f"{other}-b{budget}__full"))
                tally[0], tally[1] = tally[0] + won, tally[1] + lost
        out.append(f"   {length} tokens, B_0 64+128+256: " + "; ".join(
            f"vs {other} {w} wins, {lost} losses" for other, (w, lost) in total.items()))
    stream = records(RUNS / "niah_single" / "2048" / "q-outside" / "dense__streamingllm-b1024")
    late = {i for i, r in stream.items() if r["meta"]["depths"][0] > 0.5}
    right = {i for i, r in stream.items() if r["score"] == 1.0}
    out.append(f"3. streamingllm B_d 1024, niah_single 2048: {len(right)} of {len(stream)} answered; needle past the "
               f"middle in {len(late)}; answered == past the middle: {right == late}")
    out.append("4. Gemma-3-270m, full cache, B_0 128: entropy's paired wins/losses")
    for task in ("niah_multikey", "niah_multiquery", "niah_multivalue"):
        for length in (8192, 16384):
            base = GEMMA / task / str(length) / "q-outside"
            entropy = records(base / "entropy-b128__full")
            out.append(f"   {task} {length} (n={len(entropy)}): " + "; ".join(
                "vs {} {} wins, {} losses".format(other, *paired(entropy, records(base / f"{other}__full")))
                for other in ("critiprefill-b128", "streaming-b128", "dense")))
    out.append("5. Gemma-3-270m, niah_single 8192, wrong answers that contain the needle's first 3 digits")
    for placement in ("outside", "inside"):
        for policy in ("snapkv-b256", "snapkv-b1024", "adakv-b256", "adakv-b1024"):
            run = records(GEMMA / "niah_single" / "8192" / f"q-{placement}" / f"dense__{policy}")
            wrong = [r for r in run.values() if r["score"] < 1]
            partial = sum(r["answers"][0][:3] in r["prediction"] for r in wrong)
            out.append(f"   q-{placement} {policy}: {len(wrong)} wrong of {len(run)}, {partial} with the first 3")
    text = "\n".join(out) + "\n"
    (HERE / "checks.txt").write_text(text, encoding="utf-8")
    print(text, end="")


if __name__ == "__main__":
    main()
