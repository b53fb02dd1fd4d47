"""The GPU scripts of issue 57 on the CPU: ``profiling/memory.py`` (one request's peak memory, dense against each
flexentropy path) and the warm-up's attribution in ``profiling/decode_timeline.py``'s ``coldstart`` part."""

from __future__ import annotations

import gzip
import importlib.util
import json
import pickle
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

PROFILING = Path(__file__).resolve().parents[1] / "profiling"


def script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"profiling_{name}", PROFILING / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_memory_benchmark_runs_tiny_on_cpu(tmp_path: Path) -> None:
    """``profiling/memory.py --device cpu --tiny``: a row per part and length, dense on whole MLPs and the flexentropy
    paths on `fe.enable`'s chunks, the latent and static requests past their first eviction; no peaks off CUDA."""
    from flexentropy.surgery.chunked_mlp import MLP_CHUNK

    memory = script("memory")
    out = tmp_path / "memory.json"
    memory.main(["--device", "cpu", "--tiny", "--layers", "2", "--lengths", "1500", "--new-tokens", "24",
                 "--warm-lengths", "300", "--parts", "batch,static,latent,dense", "--out", str(out)])
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [row["part"] for row in rows] == ["dense", "latent", "static", "batch"]
    assert not any("error" in row for row in rows)
    assert all(row["n"] == 1500 and row["new_tokens"] == 24 and row["cache_gib"] > 0 for row in rows)
    assert [row["mlp_chunk"] for row in rows] == [None, MLP_CHUNK, MLP_CHUNK, MLP_CHUNK]
    assert rows[1]["evictions"] == 1 and rows[2]["evictions"] == 1 and rows[2]["max_prompt_length"] == 1500
    assert all("peak_allocated_gib" not in row for row in rows)
    assert report["weights_gib"] > 0
    assert rows[0]["kv_gib"] == pytest.approx(1500 / 1024 * report["kv_gib_per_1k_tokens"])


def test_memory_snapshot_is_cut_to_its_latest_events_until_it_fits(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot a GPU run brings back must stay under its limit: the oldest events go first."""
    memory = script("memory")
    cuda = torch.device("cuda")
    events = [{"action": "alloc", "addr": i, "size": i * 7919 % 104729, "frames": [{"name": f"f{i}"}]}
              for i in range(4000)]
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": [], "device_traces": [events]})
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *args, **kwargs: None)
    thousand = len(gzip.compress(pickle.dumps({"segments": [], "device_traces": [events[-1000:]]})))
    monkeypatch.setattr(memory, "SNAPSHOT_LIMIT", thousand - 1)   # the last 1000 events do not fit, 500 do
    snapshot = memory.Snapshot(tmp_path / "snap.pickle.gz", "static", 4096, 10)
    assert not snapshot.wanted("static", 4096, torch.device("cpu")) and not snapshot.wanted("latent", 4096, cuda)
    assert not snapshot.wanted("static", 2048, cuda) and snapshot.wanted("static", 4096, cuda)
    row = snapshot.stop()
    saved = pickle.loads(gzip.decompress((tmp_path / "snap.pickle.gz").read_bytes()))
    assert row["snapshot_events"] == 500 and saved["device_traces"][0] == events[-500:]
    assert row["snapshot_mib"] * 2**20 <= memory.SNAPSHOT_LIMIT and snapshot.done


def test_warm_up_attribution_buckets_a_stack_by_its_innermost_compile_frame() -> None:
    """The sampler gives every moment inside it to one bucket (they sum to the time inside); a compile's tracing goes
    to dynamo's bucket, a module's body run by an import to the imports', plain Python to the rest."""
    timeline = script("decode_timeline")
    assert timeline.frame_bucket(sys._getframe()) == timeline.REST
    torch._dynamo.reset()

    def fresh(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2 + x.cos().sum()

    start = time.perf_counter()
    with timeline.StackSampler(interval=0.001) as sampler:
        torch.compile(fresh, backend="aot_eager")(torch.randn(8))
    elapsed = time.perf_counter() - start
    assert sum(sampler.seconds.values()) == pytest.approx(elapsed, rel=0.05)
    assert sampler.seconds.get("dynamo tracing", 0.0) > 0.3 * elapsed
    assert set(sampler.seconds) <= {bucket for bucket, _, _ in timeline.BUCKETS} | {timeline.REST, timeline.IMPORTS}


def test_a_module_body_run_by_an_import_is_an_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timeline = script("decode_timeline")
    (tmp_path / "planted_module.py").write_text("import sys\nFRAME = sys._getframe()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    planted = importlib.import_module("planted_module")
    assert timeline.frame_bucket(planted.FRAME) == timeline.IMPORTS


@pytest.mark.slow
def test_coldstart_row_attributes_the_warm_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``decode_timeline.py --parts coldstart --device cpu --tiny``: the warm-up's buckets sum to its time, the
    compiled frames and compile counters are in the row, the cProfile's top functions too and its listing beside the
    JSON; flash-attn-4's kernel cache variable as it was before and after ``fe.warm_up``."""
    from flexentropy.engine.warm_up import FLASH_KERNEL_CACHE

    monkeypatch.delenv(FLASH_KERNEL_CACHE, raising=False)
    monkeypatch.delitem(sys.modules, "flash_attn.cute", raising=False)
    timeline = script("decode_timeline")
    out = tmp_path / "cold.json"
    timeline.main(["--parts", "coldstart", "--device", "cpu", "--tiny", "--layers", "2", "--context", "700",
                   "--new-tokens", "24", "--warm-lengths", "300", "500", "--tag", "second", "--out", str(out)])
    row = json.loads(out.read_text())["rows"][-1]
    assert "error" not in row and row["profiled"] and row["variant"] == "second"
    assert sum(row["warm_up_buckets_s"].values()) == pytest.approx(row["warm_up_s"], rel=0.1)
    assert row["graphs"] == len(row["frames"]) and isinstance(row["counters"], dict)
    functions = [entry["function"] for entry in row["top_cumulative"]]
    assert any(function.endswith("(warm_up)") for function in functions) and row["top_own"]
    assert (tmp_path / "cold_second_warm_up.txt").read_text().count("warm_up") >= 1
    assert row["flash_attn_cache_env"] == {"before": None, "after": "1"}


@pytest.mark.slow
def test_gpu_smoke_runs_every_path_tiny_on_cpu(tmp_path: Path) -> None:
    """``profiling/gpu_smoke.py --device cpu --tiny``: the environment line, then a covering and a defaults row for
    every path (the CPU's one kernel, every prefill policy), all green; the covering rows equal dense, the defaults
    ran sparse layers and evicted."""
    import flexentropy as fe

    smoke = script("gpu_smoke")
    out = tmp_path / "smoke.jsonl"
    code = smoke.main(["--device", "cpu", "--tiny", "--length", "2000", "--layers", "2", "--new-tokens", "20",
                       "--no-vllm", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 0 and rows[0]["path"] == "environment" and rows[0]["card"] == "cpu"
    paths = ["kernel/auto", "enable/auto", "latent", "static", "batch", "module",
             *(f"policy/{name}" for name in fe.PREFILL_POLICIES)]
    assert [(r["path"], r["variant"]) for r in rows[1:]] == [(p, v) for p in paths for v in ("covering", "defaults")]
    assert all(r["ok"] for r in rows)
    by = {(r["path"], r["variant"]): r for r in rows[1:]}
    assert by["enable/auto", "covering"]["density"] == 1.0 and by["enable/auto", "defaults"]["density"] < 1.0
    assert by["latent", "covering"]["evicted"] is False and by["latent", "defaults"]["evicted"] is True
    assert max(by["enable/auto", "defaults"]["attention_rel_err"]) > 0     # the comparison sees a sparse plan


def test_gpu_smoke_reports_a_mismatch_as_a_failed_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A covering path that differs from dense is a failed row with its numbers, and the run's status is 1."""
    smoke = script("gpu_smoke")
    monkeypatch.setattr(smoke, "OUTPUT_TOL", -1.0)
    out = tmp_path / "smoke.jsonl"
    code = smoke.main(["--device", "cpu", "--tiny", "--length", "1200", "--layers", "2", "--paths", "kernel",
                       "--no-vllm", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 1
    assert [(r["path"], r["variant"], r["ok"]) for r in rows[1:]] == [("kernel/auto", "covering", False),
                                                                      ("kernel/auto", "defaults", True)]
    assert rows[1]["error"].startswith("Mismatch: covering plans differ from dense attention")
    assert rows[1]["frames"]


def test_gpu_smoke_runs_the_plugin_with_the_default_rule_and_two_peers(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The smoke's vLLM paths (engines stood in for): ``vllm`` then ``vllm/<peer>`` for each of `VLLM_PEERS`, each
    covering and at its defaults; the peers' entries name their rule (and its covering knobs), and vLLM's own backend
    runs once, its row reused by the peers' covering rows."""
    smoke = script("gpu_smoke")
    calls: list[tuple[str, list[str], dict | None]] = []

    def engines(_smoke: object, name: str, sides: list[str], config: dict | None) -> dict[str, dict]:
        calls.append((name, sides, config))
        return {side: {"tokens": [3, 4], "logprobs": [-0.5, -0.25], "counters": {"sparse_chunks": 2}, "chunk": 512,
                       "start_s": 1.0} for side in sides}

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(smoke, "vllm_rows", engines)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    out = tmp_path / "smoke.jsonl"
    assert smoke.main(["--device", "cpu", "--tiny", "--paths", "vllm", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()][1:]
    paths = ["vllm", *(f"vllm/{peer}" for peer in smoke.VLLM_PEERS)]
    assert [(r["path"], r["variant"], r["ok"]) for r in rows] == [(p, v, True) for p in paths
                                                                  for v in ("covering", "defaults")]
    assert [sides for _, sides, _ in calls] == [["vllm", "flexentropy"], *[["flexentropy"]] * (2 * len(paths) - 1)]
    for peer in smoke.VLLM_PEERS:
        by = {name: config for name, _, config in calls if peer in name}
        assert by[f"vllm_{peer}_defaults"] == {"prefill": peer}
        covering = by[f"vllm_{peer}_covering"]
        assert covering["prefill"] == peer and covering["prefill_knobs"] == smoke.PEER_COVERING[peer]
    assert dict((name, config) for name, _, config in calls)["vllm_defaults"] is None
