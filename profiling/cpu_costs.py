"""Host-side costs measured on the CPU (docs/performance.md, "Built, not yet timed on the GPU"; docs/quality.md):

    python profiling/cpu_costs.py --out docs/results/cpu_costs.json

Parts (``--parts``, comma-separated; each merges its rows into ``--out``):

* ``prepare``: the step driver's `begin_step` of a decode step (`StaticPhase.prepare`), the eager work before each
  captured step, on a tiny 32-layer Llama (512-token prompt, budget 64): median and 90th percentile over the steps
  without a decision.
* ``observation``: one layer's probe observation (scored path) against the pooled one, 14 query / 2 KV heads, D 64,
  random inputs, best of 3.
* ``warm_up``: `fe.warm_up` of a tiny Llama of ``--layers`` layers (default 8; inductor, phase 1 captured) in fresh
  processes: an empty inductor cache dir, the same dir again, and an empty dir after loading the first run's
  compiled artifacts; then with ``compiled_dir``: a first process (an empty inductor cache dir, an empty compiled
  dir), a second with both kept, and a third with the compiled dir alone (an empty inductor cache dir). Each row
  lists the graphs dynamo compiled, the seconds each took, how the compilation's seconds split between dynamo's
  bytecode tracing and the backend, what the compiled dir did (graphs loaded, compiled and kept) and the tokens of
  one greedy request after the warm-up (the same in every row). ``--repeats N`` runs the two second processes (the
  kept cache dir, the kept compiled dir) N times each, in turn.

CPU figures: they rank the paths on the host, they are not GPU timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_json  # noqa: E402

import flexentropy as fe  # noqa: E402
from flexentropy.engine import begin_step, compiled_work  # noqa: E402


def tiny_llama(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
                         num_hidden_layers=layers, vocab_size=256, max_position_embeddings=8192)
    return LlamaForCausalLM(config).eval()


def prepare_rows(steps: int = 120) -> list[dict]:
    model = tiny_llama(32)
    cfg = fe.EntropyConfig(decode_budget=64, recompress_every=32, dense_prefix=1 << 20)
    fe.enable(model, cfg, prefill="dense")
    cache = fe.StaticLatentKVCache(cfg, model=model)
    ids = torch.randint(0, 256, (1, 512), generator=torch.Generator().manual_seed(0))

    def request() -> list[float]:
        cache.reset()
        times = []
        with torch.no_grad():
            token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(steps):
                start = time.perf_counter()
                begin_step(cache, 1)
                times.append((time.perf_counter() - start) * 1e3)
                token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        return times

    request()   # warm
    times = request()
    delay, every = cfg.decode_delay, cfg.recompress_every
    steady = sorted(t for i, t in enumerate(times) if i > delay and (i - delay) % every)
    return [{"part": "prepare", "layers": 32, "steps": len(steady), "median_ms": statistics.median(steady),
             "p90_ms": steady[int(0.9 * len(steady))], "first_eviction_ms": times[delay]}]


def observation_rows() -> list[dict]:
    from flexentropy.policies.prefill.entropy.probe_mass import pooled_block_mass, probe_block_mass

    rows = []
    for n in (16384, 32768):
        gen = torch.Generator().manual_seed(0)
        q, k = torch.randn(1, 14, n, 64, generator=gen), torch.randn(1, 2, n, 64, generator=gen)
        for name, fn in (("probe_scored", probe_block_mass), ("pooled", pooled_block_mass)):
            fn(q, k, 256, 128, 16)
            times = []
            for _ in range(3):
                start = time.perf_counter()
                fn(q, k, 256, 128, 16)
                times.append((time.perf_counter() - start) * 1e3)
            rows.append({"part": "observation", "observation": name, "n": n, "best_of_3_ms": min(times)})
    return rows


def compiled_graphs() -> list[dict]:
    """The graphs dynamo compiled in this process so far: function, compile id and seconds (whole frame)."""
    from torch._dynamo.utils import get_compilation_metrics

    return [{"function": m.co_name, "file": Path(m.co_filename or "").name, "compile_id": str(m.compile_id),
             "seconds": m.entire_frame_compile_time_s} for m in get_compilation_metrics()]


def compile_phases() -> dict[str, float]:
    """Seconds this process spent in dynamo's compilation phases so far: the whole of it, dynamo's bytecode tracing,
    and the backend's call (AOTAutograd and inductor, or their caches)."""
    from torch._dynamo.utils import compilation_time_metrics

    names = {"total": "_compile.compile_inner", "bytecode_tracing": "bytecode_tracing",
             "backend": "OutputGraph.call_user_compiler"}
    return {label: sum(compilation_time_metrics.get(name, [])) for label, name in names.items()}


def warm_up_setup(layers: int) -> tuple[torch.nn.Module, fe.StaticLatentKVCache, object]:
    """``(model, cache, compile_config)`` that the warm-up studies run `fe.warm_up` on: the tiny Llama of ``layers``
    layers switched by `fe.enable`, a `StaticLatentKVCache` with phase 1 captured, and transformers' compile config
    made to compile on the CPU too."""
    from transformers.generation import CompileConfig

    model = tiny_llama(layers)
    cfg = fe.EntropyConfig(segment_size=256, block_size=128, dense_prefix=512, decode_budget=96, decode_delay=4,
                           recompress_every=8)
    fe.enable(model, cfg)
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True
    return model, fe.StaticLatentKVCache(cfg, model=model, max_prompt_length=2048), compile_config


WARM_UP_LENGTHS = [900, 1234]


def warm_up_once(mode: str, artifacts: str, layers: int) -> dict:
    """One `fe.warm_up` in this process (``--warm-up-child``) and one greedy request after it: the warm-up's seconds,
    what the compiled dir did, the request's tokens. ``mode="load"`` loads ``artifacts`` first; a ``compiled_dir``
    mode keeps the compiled work in the folder ``compiled`` beside ``artifacts``."""
    if mode == "load":
        torch.compiler.load_cache_artifacts(Path(artifacts).read_bytes())
    model, cache, compile_config = warm_up_setup(layers)
    compiled_dir = Path(artifacts).with_name("compiled") if mode.startswith("compiled_dir") else None
    start = time.perf_counter()
    fe.warm_up(model, WARM_UP_LENGTHS, cache=cache, compile_config=compile_config,
               artifacts=artifacts if mode == "save" else None, compiled_dir=compiled_dir)
    seconds = time.perf_counter() - start
    kept = compiled_work()
    cache.reset()
    ids = torch.randint(3, 256, (1, WARM_UP_LENGTHS[1] - 100), generator=torch.Generator().manual_seed(1))
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                            pad_token_id=0, past_key_values=cache, compile_config=compile_config)
    return {"seconds": seconds, "kept": kept, "tokens": tokens[0, ids.shape[1]:].tolist()}


def run_child(script: str, child_args: list[str], cache_dir: Path) -> dict:
    """Run ``script`` with ``child_args`` in a fresh process on the inductor cache dir ``cache_dir``; the JSON object
    its last line prints."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    out = subprocess.run([sys.executable, script, *child_args], env=env, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


WARM_UP_MODES = (("save", "a"), ("same_cache_dir", "a"), ("load", "b"), ("compiled_dir_first", "c"),
                 ("compiled_dir_second", "c"), ("compiled_dir_only", "d"))
"""The processes of the ``warm_up`` part, in order: (mode, its inductor cache dir)."""

SECOND_PROCESSES = (("same_cache_dir", "a"), ("compiled_dir_second", "c"))
"""The second processes that ``--repeats`` runs again, in turn (the machine's load changes between them)."""


def warm_up_rows(layers: int, repeats: int = 1) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        artifacts = str(Path(tmp) / "artifacts.bin")
        for mode, cache_dir in WARM_UP_MODES + SECOND_PROCESSES * (repeats - 1):
            child = run_child(__file__, ["--warm-up-child", mode, artifacts, "--layers", str(layers)],
                              Path(tmp) / cache_dir)
            kept = Path(tmp) / "compiled"
            rows.append({"part": "warm_up", "layers": layers, "mode": {"save": "cold"}.get(mode, mode),
                         "seconds": child["seconds"], "graphs": child["graphs"], "compile_phases_s": child["phases"],
                         "traced": child["traced"], "kept": child["kept"], "tokens": child["tokens"],
                         "artifacts_bytes": Path(artifacts).stat().st_size,
                         "compiled_dir_bytes": sum(path.stat().st_size for path in kept.rglob("*") if path.is_file())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="prepare,observation,warm_up")
    parser.add_argument("--out", default="docs/results/cpu_costs.json")
    parser.add_argument("--tag", default="", help="label of the rows (e.g. the commit measured)")
    parser.add_argument("--layers", type=int, default=8, help="warm_up: the tiny Llama's layers")
    parser.add_argument("--repeats", type=int, default=1,
                        help="warm_up: processes of each second-process mode (kept cache dir, kept compiled dir)")
    parser.add_argument("--warm-up-child", nargs=2, metavar=("MODE", "ARTIFACTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warm_up_child:
        once = warm_up_once(*args.warm_up_child, args.layers)
        print(json.dumps({**once, "graphs": compiled_graphs(), "phases": compile_phases(),
                          "traced": torch._dynamo.utils.counters["stats"]["unique_graphs"]}))
        return
    parts = {"prepare": prepare_rows, "observation": observation_rows,
             "warm_up": lambda: warm_up_rows(args.layers, args.repeats)}
    path = Path(args.out)
    payload = json.loads(path.read_text()) if path.is_file() else {"benchmark": "cpu_costs", "rows": []}
    for part in args.parts.split(","):
        for row in parts[part]():
            row.update(tag=args.tag, environment=environment())
            payload["rows"].append(row)
            print({key: value for key, value in row.items() if key != "environment"}, flush=True)
            write_json(path, payload)


if __name__ == "__main__":
    main()
