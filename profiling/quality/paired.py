"""Paired comparison of finished eval runs on the same samples: per sample, which of two runs scored higher.

    python profiling/quality/paired.py RUNS_ROOT/model/task/length/q-outside  [baseline-folder]

Prints, for every run folder against the baseline (default ``dense__full``): samples in common, mean scores, how
many samples each got better, on how many both generated the same tokens, the share of values found in each turn
of a multi-turn task (``turns``), and the run's mean prefill density, overall and per layer (from its predictions).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def scores(folder: Path) -> dict[int, dict]:
    lines = (folder / "predictions.jsonl").read_text(encoding="utf-8").splitlines()
    return {record["index"]: record for record in map(json.loads, lines)}


def main(root: Path, baseline: str = "dense__full") -> None:
    base = scores(root / baseline)
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name != baseline):
        run = scores(folder)
        common = sorted(set(run) & set(base))
        better = sum(run[i]["score"] > base[i]["score"] for i in common)
        worse = sum(run[i]["score"] < base[i]["score"] for i in common)
        same = sum(run[i]["new_token_ids"] == base[i]["new_token_ids"] for i in common)
        layers = [r["layer_density"] for r in run.values() if r.get("layer_density")]
        per_layer = [statistics.fmean(x for x in col if x is not None) for col in zip(*layers, strict=True)]
        print(f"{folder.name}\n  n={len(common)} score {statistics.fmean(run[i]['score'] for i in common):.3f} vs "
              f"{statistics.fmean(base[i]['score'] for i in common):.3f}; better on {better}, worse on {worse}; "
              f"same tokens on {same}")
        turns = [[statistics.fmean(turn["hits"]) for turn in run[i]["turns"]] for i in common if "turns" in run[i]]
        if turns:
            base_turns = [[statistics.fmean(turn["hits"]) for turn in base[i]["turns"]] for i in common]
            print("  values found per turn " + " / ".join(
                f"{statistics.fmean(col):.3f} vs {statistics.fmean(ref):.3f}"
                for col, ref in zip(zip(*turns, strict=True), zip(*base_turns, strict=True), strict=True)))
        if per_layer:
            density = statistics.fmean(run[i]["density"] for i in common)
            print(f"  density {density:.3f}; per layer " + " ".join(f"{d:.2f}" for d in per_layer))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
