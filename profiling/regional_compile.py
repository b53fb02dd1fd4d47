"""Whether compiling one decoder layer as a nested region cuts the decode step's compilation (issue 46's cold
start), on the CPU with the tiny Llama of `cpu_costs.py`:

    python profiling/regional_compile.py --layers 32 --out docs/results/regional_compile.json

Modes, each `fe.warm_up` (prompts of 900 and 1,234 tokens, `StaticLatentKVCache` with phase 1 captured) in a fresh
process, twice on one ``TORCHINDUCTOR_CACHE_DIR`` (``cold``, then ``kept``, as a server's second process):

* ``whole``: the library as it is (dynamo traces the whole forward for each step graph);
* ``region``: transformers' ``LlamaDecoderLayer.forward`` wrapped in ``torch.compiler.nested_compile_region``
  (dynamo still traces every layer, to check that the region may be reused);
* ``region_hash``: the same with ``reuse_hash_fn`` returning one key, so that dynamo reuses the first layer's region
  for every layer without tracing them. Each layer's cache state is reached through Python objects indexed by the
  layer's number, so the reused region reads the first layer's state: its tokens are wrong, which is the point.

Each row: the warm-up's seconds, the compilation's split (dynamo's bytecode tracing, the backend), the graphs
compiled, and the first 24 greedy tokens of a 1,000-token prompt afterwards (the same in every correct mode).
CPU figures: they rank the modes on the host, they are not GPU timings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_json  # noqa: E402
from cpu_costs import WARM_UP_LENGTHS, compile_phases, compiled_graphs, warm_up_setup  # noqa: E402

import flexentropy as fe  # noqa: E402

MODES = ("whole", "region", "region_hash")


def child(mode: str, layers: int) -> dict:
    from transformers.models.llama import modeling_llama

    if mode != "whole":   # a lab experiment: the library patches nothing of transformers outside integrations/
        hashed = {"reuse_hash_fn": lambda *args, **kwargs: 0} if mode == "region_hash" else {}
        layer = modeling_llama.LlamaDecoderLayer
        layer.forward = torch.compiler.nested_compile_region(layer.forward, **hashed)
    model, cache, compile_config = warm_up_setup(layers)
    start = time.perf_counter()
    fe.warm_up(model, WARM_UP_LENGTHS, cache=cache, compile_config=compile_config)
    seconds = time.perf_counter() - start
    phases, graphs = compile_phases(), compiled_graphs()
    ids = torch.randint(0, 250, (1, 1000), generator=torch.Generator().manual_seed(1))
    cache.reset()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=24,
                         do_sample=False, compile_config=compile_config)
    return {"seconds": seconds, "compile_phases_s": phases, "graphs": graphs, "tokens": out[0, -24:].tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out", default="docs/results/regional_compile.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / mode)}
            for run in ("cold", "kept"):
                out = subprocess.run([sys.executable, __file__, "--child", mode, "--layers", str(args.layers)],
                                     env=env, check=True, capture_output=True, text=True).stdout
                rows.append({"mode": mode, "cache_dir": run, "layers": args.layers,
                             **json.loads(out.strip().splitlines()[-1])})
                phases = rows[-1]["compile_phases_s"]
                print(f"{mode:12s} {run:5s} warm-up {rows[-1]['seconds']:6.1f} s, compiling {phases['total']:5.1f} s "
                      f"(tracing {phases['bytecode_tracing']:5.1f}, backend {phases['backend']:5.1f}), "
                      f"tokens {rows[-1]['tokens'][:6]}", flush=True)
                write_json(args.out, {"benchmark": "regional_compile", "environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
