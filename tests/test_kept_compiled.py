"""flexentropy's compiled work kept in a folder (`fe.warm_up(..., compiled_dir=...)`, ``FLEXENTROPY_COMPILED_DIR``):
a second process loads the graphs the first compiled ahead of time instead of tracing them again (issue 76)."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexentropy import _compile
from flexentropy._compile import KeptGraphs, environment, environment_folder, keep_compiled
from flexentropy.engine.compiled_layer import LayerStep

ROOT = Path(__file__).resolve().parents[1]


def run_worker(folder: Path, inductor: Path) -> dict:
    """tests/_kept_worker.py in a fresh process, on its own inductor cache folder: its JSON line."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor), "PYTHONPATH": str(ROOT)}
    env.pop(_compile.COMPILED_DIR_VARIABLE, None)
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "_kept_worker.py"), str(folder)], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_is_kept() -> bool:
    """Whether torch can keep the static step's decoder layer of the installed transformers' Llama: with the
    `kernels` package installed (transformers 5.25 requires it) its rotary function is an instance of a class defined
    inside a function, which torch cannot save."""
    from transformers.models.llama import modeling_llama

    rotary = type(modeling_llama.apply_rotary_pos_emb)
    return rotary.__qualname__ == rotary.__name__


@pytest.mark.slow
def test_a_second_process_loads_the_kept_graphs_and_traces_none(tmp_path: Path) -> None:
    """The first process compiles the sparse kernel and both stages of the static step ahead of time and keeps them;
    the second, on an empty inductor cache folder, loads the three and traces nothing; both generate the eager
    tokens. Where the step cannot be kept (`step_is_kept`), both processes say so, the sparse kernel is kept and
    loaded, and the second traces only the step."""
    first = run_worker(tmp_path / "kept", tmp_path / "inductor_first")
    second = run_worker(tmp_path / "kept", tmp_path / "inductor_second")
    unkept = None if step_is_kept() else re.compile(r"run_layer\.\w+ cannot be compiled ahead of time \(PackageError: "
                                                    r"Type .*Func'> cannot be saved .* defined in local scope")
    kept = 3 if unkept is None else 1
    assert first["kept"].get("compiled") == kept and "loaded" not in first["kept"] and first["traced"] >= 3
    assert second["kept"].get("loaded") == kept and "compiled" not in second["kept"]
    assert second["traced"] == (0 if unkept is None else first["traced"] - kept)   # the step's graphs, traced again
    assert second["kept"]["served"] == first["kept"]["served"]
    assert first["tokens"] == first["eager"] and second["tokens"] == first["tokens"]
    for said in (first["warnings"], second["warnings"]):
        assert len(said) == (0 if unkept is None else 1) and all(unkept.search(warning) for warning in said), said


def counts() -> dict[str, float]:
    """The graphs `KeptGraphs` compiled and loaded, and the calls they served, in this process."""
    return {kind: _compile.KEPT[kind] for kind in ("compiled", "loaded", "served")}


def scaled_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x * scale).softmax(dim=-1)


def test_a_call_no_kept_graph_matches_warns_compiles_and_keeps_its_own(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph kept for one softmax scale (a constant of the graph) serves every shape (dynamic sizes, dimension
    marks taken off for its guards) and no other scale: a new one warns with the failing guard, is compiled, kept
    beside, and computes the function; a fresh `KeptGraphs` (as a new process) loads both and compiles nothing."""
    monkeypatch.setattr(_compile, "_CHOSEN", [])
    monkeypatch.setenv(_compile.COMPILED_DIR_VARIABLE, str(tmp_path))
    monkeypatch.setattr(_compile, "KEPT", _compile.Counter())
    x = torch.randn(3, 7)
    first = KeptGraphs(scaled_softmax, {"backend": "aot_eager", "dynamic": True, "fullgraph": True})
    assert torch.allclose(first(x, 0.5), scaled_softmax(x, 0.5))
    wider = torch.randn(5, 9)
    torch._dynamo.maybe_mark_dynamic(wider, 1)
    assert torch.allclose(first(wider, 0.5), scaled_softmax(wider, 0.5))
    assert counts() == {"compiled": 1, "loaded": 0, "served": 2}
    again = KeptGraphs(scaled_softmax, {"backend": "aot_eager", "dynamic": True, "fullgraph": True})
    with pytest.warns(RuntimeWarning, match=r"the 1 graphs kept in .* do not match this call \(.*scale.*\); "
                                            r"compiling it, and keeping it there too"):
        assert torch.allclose(again(wider, 2.0), scaled_softmax(wider, 2.0))
    assert torch.allclose(again(x, 0.5), scaled_softmax(x, 0.5))
    assert counts() == {"compiled": 2, "loaded": 1, "served": 4}
    third = KeptGraphs(scaled_softmax, {"backend": "aot_eager", "dynamic": True, "fullgraph": True})
    assert torch.allclose(third(wider, 2.0), scaled_softmax(wider, 2.0))
    assert counts() == {"compiled": 2, "loaded": 3, "served": 5}


def test_work_kept_for_another_environment_is_left_beside_with_a_warning(tmp_path: Path) -> None:
    """A folder holding only another torch's work: a warning names what differs, and this process keeps its own
    work in a subfolder of its own, leaving the other as it was."""
    foreign = tmp_path / "0123456789abcdef"
    foreign.mkdir()
    (foreign / "environment.json").write_text(json.dumps({**environment(), "torch": "2.11.0"}))
    with pytest.warns(RuntimeWarning, match=r"compiled elsewhere \(torch: kept \['2.11.0'\], here '"):
        folder = environment_folder(str(tmp_path))
    assert folder is not None and folder != foreign and folder.parent == tmp_path
    assert json.loads((folder / "environment.json").read_text()) == environment()
    assert json.loads((foreign / "environment.json").read_text())["torch"] == "2.11.0"


def test_a_kept_graph_that_does_not_load_is_said_and_compiled_again(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compile, "_CHOSEN", [])
    monkeypatch.setenv(_compile.COMPILED_DIR_VARIABLE, str(tmp_path))
    region = KeptGraphs(scaled_softmax, {"backend": "aot_eager", "dynamic": True, "fullgraph": True})
    broken = environment_folder(str(tmp_path)) / region.name / "broken.bin"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"not a graph")
    x = torch.randn(3, 7)
    with pytest.warns(RuntimeWarning, match=r"cannot load the compiled graph .*broken\.bin .*compiling instead"):
        assert torch.allclose(region(x, 0.5), scaled_softmax(x, 0.5))
    assert len(list(broken.parent.glob("*.bin"))) == 2


def test_keep_compiled_refuses_a_file(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(ValueError, match="compiled_dir names a folder to keep compiled work in, got the file"):
        keep_compiled(path)


def test_a_decoder_layers_step_forward_is_saved_as_nothing() -> None:
    """torch saves a kept step graph with the callables of the decoder layer it guards on: the instance ``forward``
    that holds the cache and the compiled region (whose graphs torch cannot pickle) is saved as None."""
    step = LayerStep(print, torch.nn.Linear(1, 1), object(), object())
    assert pickle.loads(pickle.dumps(step)) is None
