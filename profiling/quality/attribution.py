"""Which key blocks around each needle the sparse paths of `paths.py` keep (issue 72, item 2).

    python profiling/quality/attribution.py --out docs/results/quality/paths_1.5b --model qwen2.5-coder-1.5b \\
        --cases niah_multiquery3_lines_131072_0 niah_multiquery3_lines_131072_1 \\
        --paths hf_whole hf_chunks hf_chunks+last_dense hf_chunks+whole_budget hf_chunks+whole_plan \\
        --json docs/results/quality/paths_1.5b/attribution.json

Reads the cases of a `paths.py` folder (``OUT/cases.jsonl``: the needles' key words and values in tokens, where the
question starts) and runs each ``--paths`` (transformers paths and ``hf_chunks`` knobs, in this process) on each case,
generating its reply as `paths.py` does, while it records every plan: ``hf_whole``'s per layer, ``hf_chunks``' per
chunk and layer. ``--paths vllm_plugin`` (alone: the engine takes the GPU's memory) runs the plugin inside vLLM
instead and records the plans its engine's worker makes, per chunk and layer (`record_plans`, through vLLM's
``collective_rpc``; a layer it runs dense keeps every causal block), as it generates the reply.

Per needle, two blocks of keys are followed, the block holding its key word and the one(s) holding its value (a reply
may put the right value under a wrong key), through two sets of query rows (rows of 128 tokens):

* ``question``: the rows holding the question and the answer prefix (from ``question_start`` on);
* ``later``: the rows of the segments after the needle's own, up to the question's rows (the context read after
  the needle), also split by the chunk that planned them (``later_by_chunk``, chunk 0 first).

For each, ``kept``: the mean over layers, query heads and rows of whether the row's plan keeps the block (a layer
run dense keeps every causal block); ``losing``: the (layer, head) pairs keeping it in under half of their rows; and
per layer, the mean over heads and rows (``by_layer``). The JSON holds every case, path and needle, with the path's
reply, scores and densities; the table printed gives the kept shares per needle.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "profiling" / "quality"))

import torch  # noqa: E402
from paths import (  # noqa: E402
    Path_,
    cases_path,
    entropy_fields,
    environment,
    generate_vllm,
    load_hf,
    load_vllm,
    parse_path,
    read_rows,
    rows_path,
    score_reply,
)

from flexentropy import EntropyConfig  # noqa: E402

Q_ROWS = 128
"""Query rows per block of a plan (`flexentropy.config.Q_BLOCK_SIZE`)."""


def block_range(span: list[int], block_size: int) -> list[int]:
    """The key blocks holding the tokens ``span = [start, end)``."""
    return list(range(span[0] // block_size, (span[1] - 1) // block_size + 1))


class NeedleRecorder:
    """Collects, from each plan a path hands it, whether each query row keeps each needle's key and value blocks."""

    def __init__(self, case: dict[str, Any], block_size: int) -> None:
        self.case = case
        self.block_size = block_size
        self.columns = sorted({b for n in case["needles"] if n["fact_tokens"]
                               for part in ("key_tokens", "value_tokens") for b in block_range(n[part], block_size)})
        self.parts: dict[int, list[tuple[int, torch.Tensor, int]]] = {}   # layer -> (first row, kept, chunk)
        self.chunk_of: dict[int, int] = {}                                 # q_start -> chunk index

    def __call__(self, layer_idx: int, plan: Any) -> None:
        chunk = self.chunk_of.setdefault(plan.q_start, len(self.chunk_of))
        present = [c for c in self.columns if c < plan.blocks.shape[-1]]
        kept = torch.zeros(*plan.blocks.shape[1:3], len(self.columns), dtype=torch.bool)   # [Hq, rows, columns]
        index = torch.tensor(present, dtype=torch.long, device=plan.blocks.device)
        kept[..., : len(present)] = plan.blocks[0].index_select(-1, index).cpu()
        self.parts.setdefault(layer_idx, []).append((plan.q_start // Q_ROWS, kept, chunk))

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows [R], kept [Hq, R, columns], chunk [R])`` of a layer over every plan it was given."""
        parts = self.parts[layer_idx]
        rows = torch.cat([torch.arange(first, first + kept.shape[1]) for first, kept, _ in parts])
        chunks = torch.cat([torch.full((kept.shape[1],), chunk) for _, kept, chunk in parts])
        return rows, torch.cat([kept for _, kept, _ in parts], dim=1), chunks

    def needle(self, needle: dict[str, Any], block_size: int, segment_size: int) -> dict[str, Any]:
        """The kept shares of one needle (module docstring)."""
        question = self.case["question_start"] // Q_ROWS
        after = -(-needle["value_tokens"][1] // segment_size) * segment_size // Q_ROWS   # first row past its segment
        out: dict[str, Any] = {"key": needle["key"], "value": needle["value"], "asked": needle["asked"]}
        tables = {layer: self.layer(layer) for layer in sorted(self.parts)}
        for part in ("key", "value"):
            blocks = [self.columns.index(b) for b in block_range(needle[f"{part}_tokens"], block_size)]
            for name in ("question", "later"):
                per_layer, losing, pairs, by_chunk = [], 0, 0, {}
                for rows, kept, chunks in tables.values():
                    chosen = rows >= question if name == "question" else (rows >= after) & (rows < question)
                    if not chosen.any():
                        continue
                    heads = kept[:, chosen][..., blocks].any(-1).float()          # [Hq, chosen rows]
                    per_layer.append(float(heads.mean()))
                    losing += int((heads.mean(dim=1) < 0.5).sum())
                    pairs += heads.shape[0]
                    for chunk in chunks[chosen].unique().tolist():
                        by_chunk.setdefault(chunk, []).append(float(heads[:, chunks[chosen] == chunk].mean()))
                if per_layer:
                    out[f"{name}_{part}"] = {
                        "kept": sum(per_layer) / len(per_layer), "losing": losing, "pairs": pairs,
                        "by_layer": [round(x, 4) for x in per_layer],
                        "by_chunk": {str(c): round(sum(v) / len(v), 4) for c, v in sorted(by_chunk.items())}}
        return out


def attribute(runner: Any, path: Path_, case: dict[str, Any]) -> dict[str, Any]:
    """``path`` on ``case`` with its plans recorded: the reply, scores, densities and each needle's kept shares."""
    config = runner.config
    recorder = NeedleRecorder(case, config.block_size)
    result = runner.run(path, case, on_plan=recorder)
    reply = runner.tokenizer.decode(result.pop("tokens"), skip_special_tokens=True)
    needles = [recorder.needle(n, config.block_size, config.segment_size) for n in case["needles"] if n["fact_tokens"]]
    return {"path": path.label, "id": case["id"], "reply": reply, **score_reply(case, reply), **result,
            "chunks": len(recorder.chunk_of), "needles": needles}


def record_plans(worker: Any, recorder: NeedleRecorder | None) -> None:
    """In vLLM's worker: hand the plan of every long prompt chunk the plugin attends to ``recorder`` (None: stop
    recording), a layer run dense as the plan keeping every causal block, by wrapping the plugin's
    ``SparsePrefillImpl.attend_chunk`` (a lab hook on the class every sparse backend inherits it from)."""
    from types import SimpleNamespace

    from flexentropy.integrations.vllm.backends import SparsePrefillImpl

    plain = getattr(SparsePrefillImpl.attend_chunk, "__wrapped__", SparsePrefillImpl.attend_chunk)
    if recorder is None:
        SparsePrefillImpl.attend_chunk = plain
        return

    def recorded(self: Any, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
                 chunk: Any, layer_idx: int) -> tuple[torch.Tensor, Any]:
        out, plan = plain(self, layer, query, kv_cache, page_table, chunk, layer_idx)
        seen = plan
        if seen is None:   # dense: every causal block of the chunk's rows
            rows = torch.arange(chunk.q_start // Q_ROWS, -(-chunk.key_length // Q_ROWS))
            columns = torch.arange(-(-chunk.key_length // recorder.block_size))
            blocks = columns[None, :] * recorder.block_size < (rows[:, None] + 1) * Q_ROWS
            seen = SimpleNamespace(q_start=chunk.q_start, blocks=blocks.expand(1, query.shape[1], *blocks.shape))
        recorder(layer_idx, seen)
        return out, plan

    recorded.__wrapped__ = plain   # type: ignore[attr-defined]
    recorded.recorder = recorder   # type: ignore[attr-defined]
    SparsePrefillImpl.attend_chunk = recorded


def recorded_plans(worker: Any) -> NeedleRecorder:
    """In vLLM's worker: the recorder `record_plans` installed, with what it collected; recording stops."""
    from flexentropy.integrations.vllm.backends import SparsePrefillImpl

    recorder = SparsePrefillImpl.attend_chunk.recorder
    record_plans(worker, None)
    return recorder


def attribute_vllm(llm: Any, path: Path_, case: dict[str, Any], config: Any) -> dict[str, Any]:
    """`attribute` for the plugin inside vLLM: ``case`` through ``llm`` (`paths.generate_vllm`) with the plans of
    its engine's worker recorded."""
    llm.collective_rpc(record_plans, args=(NeedleRecorder(case, config.block_size),))
    reply, _, measures = generate_vllm(llm, path, case)
    recorder = llm.collective_rpc(recorded_plans)[0]
    needles = [recorder.needle(n, config.block_size, config.segment_size) for n in case["needles"] if n["fact_tokens"]]
    return {"path": path.label, "id": case["id"], "reply": reply, **score_reply(case, reply),
            "plugin_density": measures["density"], "chunks": len(recorder.chunk_of), "needles": needles}


def table(rows: list[dict[str, Any]]) -> str:
    """Per case, path and needle: kept shares of the key and value blocks by the question's rows and the later
    rows, with the (layer, head) pairs losing each."""
    lines = [f"{'case / path':48} {'needle':>12} {'ask':>3}  {'q key':>11} {'q value':>11} "
             f"{'later key':>11} {'later value':>11}"]
    for row in rows:
        lines.append(f"{row['id']} {row['path']}: score {row['score']:.2f}"
                     + (f", bound {row['bound']:.2f}" if "bound" in row else "")
                     + (f", kept share {row['kept_share']:.3f}" if "kept_share" in row
                        else f", the plugin's density {row['plugin_density']:.3f}")
                     + f"; reply {row['reply'].strip()[:60]!r}")
        for n in row["needles"]:
            cells = []
            for name in ("question_key", "question_value", "later_key", "later_value"):
                cell = n.get(name)
                cells.append(f"{cell['kept']:.3f} ({cell['losing']:>2})" if cell else f"{'-':>11}")
            lines.append(f"{'':48} {n['key']:>12} {'yes' if n['asked'] else 'no':>3}  " + " ".join(
                f"{c:>11}" for c in cells))
    return "\n".join(lines)


def worse_cases(out: Path, path: Path_) -> list[str]:
    """Ids of the cases where ``path`` scored below its dense baseline in ``OUT/rows.jsonl``, in id order."""
    rows = [r for r in read_rows(rows_path(out)) if "error" not in r]
    base = {r["id"]: r["score"] for r in rows if r["path"] == path.baseline}
    return sorted(r["id"] for r in rows if r["path"] == path.label and r["id"] in base and r["score"] < base[r["id"]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="a paths.py folder (its rows.jsonl, for --worse)")
    p.add_argument("--cases-file", dest="cases_file", type=Path, help="paths.py's --cases (default OUT/cases.jsonl)")
    p.add_argument("--model", help="the model the cases were made for (paths.py's --model)")
    p.add_argument("--cases", nargs="+", default=[], help="case ids, e.g. niah_multiquery3_lines_131072_0")
    p.add_argument("--worse", help="also the cases where this path of OUT/rows.jsonl scored below its dense baseline, "
                                   "e.g. vllm_plugin@16384 (at most --max-worse, first ids first)")
    p.add_argument("--max-worse", type=int, default=4)
    p.add_argument("--paths", nargs="+", default=["hf_whole", "hf_chunks", "hf_chunks+last_dense",
                                                  "hf_chunks+whole_budget", "hf_chunks+whole_plan"])
    p.add_argument("--chunk", type=int, default=16384)
    p.add_argument("--config", help="EntropyConfig fields, as JSON (as paths.py's)")
    p.add_argument("--yarn", type=float, default=4.0)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--tiny", action="store_true", help="paths.py's --tiny geometry (SmolLM2 cases)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vllm_plugin's engine (paths.py's)")
    p.add_argument("--work", type=Path, default=Path("/tmp/flexentropy_paths"), help="vLLM's scratch folder")
    p.add_argument("--json", type=Path, required=True, help="where the records go (rewritten)")
    a = p.parse_args(argv)
    paths = [parse_path(t, a.chunk) for t in a.paths]
    if any(path.kind in ("hf_dense", "vllm_dense") for path in paths):
        p.error("attribution follows plans: hf_whole, hf_chunks (with knobs) or vllm_plugin, not a dense path")
    plugin = [path for path in paths if path.vllm]
    if plugin and len(paths) > 1:
        p.error("vllm_plugin runs alone (its engine takes the GPU's memory): run the transformers paths in another "
                "call with the same --json folder's cases")
    cases = {c["id"]: c for c in read_rows(cases_path(a.out, a.cases_file))}
    if a.worse:
        a.cases += [i for i in worse_cases(a.out, parse_path(a.worse, a.chunk)) if i not in a.cases][: a.max_worse]
    if not a.cases:
        p.error("no case: name some with --cases, or --worse a path that lost some")
    missing = [i for i in a.cases if i not in cases]
    if missing:
        p.error(f"{cases_path(a.out, a.cases_file)} has no case {missing}: paths.py makes them (its --cases, "
                "--model, --tasks, --lengths and --samples)")
    rows: list[dict[str, Any]] = []
    runners: dict[int, Any] = {}
    if plugin:
        os.environ.update(environment(plugin[0], a) or {})   # before vLLM is imported: its plugins, its workers
    for case_id in a.cases:
        case = cases[case_id]
        length = case["length"]
        if length not in runners:
            runners.clear()   # one model or engine at a time
            runners[length] = load_vllm(a, plugin[0], length, a.out) if plugin else load_hf(a, length)
        for path in paths:
            if plugin:
                rows.append(attribute_vllm(runners[length], path, case, EntropyConfig(**entropy_fields(a))))
            else:
                rows.append(attribute(runners[length], path, case))
            print(table(rows[-1:]), flush=True)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"argv": argv if argv is not None else sys.argv[1:], "rows": rows}, indent=1) + "\n",
                      encoding="utf-8")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
