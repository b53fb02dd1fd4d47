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
* ``region_args``: ``region_hash`` with each layer's static buffers handed to its region as arguments (a tuple of
  tensors in the layer's keyword arguments, which transformers passes on to the cache's ``update``), and the
  cache's static-step methods patched to read them there instead of indexing by the layer's number; the counters
  advance after the forward instead of in the last layer (`pass_layer_state`). A sketch of the design
  docs/performance.md names, to see whether it gives the right tokens and the reused region's tracing.

Each row: the warm-up's seconds, the compilation's split (dynamo's bytecode tracing, the backend), the graphs
compiled, and the first 24 greedy tokens of a 1,000-token prompt afterwards (the same in every correct mode).
CPU figures: they rank the modes on the host, they are not GPU timings.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_json  # noqa: E402
from cpu_costs import WARM_UP_LENGTHS, compile_phases, compiled_graphs, run_child, warm_up_setup  # noqa: E402

import flexentropy as fe  # noqa: E402

MODES = ("whole", "region", "region_hash", "region_args")


def pass_layer_state(layer: type) -> None:
    """``region_args``: patch ``layer`` (the decoder layer class) and `StaticLatentKVCache`'s static step so that a
    layer's region takes its buffers as arguments (module docstring). A lab experiment, not the library's code."""
    from flexentropy.caches.static_buffers import StaticBuffers
    from flexentropy.caches.static_latent import StaticLatentKVCache
    from flexentropy.integrations import step_driver

    cache_class = StaticLatentKVCache
    update, attend, observe = cache_class.update, cache_class.attend, cache_class.observe_queries
    step, forward = step_driver.hf_step, layer.forward
    region = torch.compiler.nested_compile_region(forward, reuse_hash_fn=lambda *args, **kwargs: 0)

    def one_layer(state: tuple[torch.Tensor, ...]) -> SimpleNamespace:   # a StaticBuffers of the layer alone
        keys, values, positions, real, _ = state
        return SimpleNamespace(keys=[keys], values=[values], positions=[positions], real=[real],
                               capacity=keys.shape[-2])

    def layer_update(self: Any, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stage is None:
            return update(self, key, value, layer_idx, *args, **kwargs)
        self.current = kwargs["kwargs"]["layer_state"]           # the region's argument, for the calls below
        StaticBuffers.write(one_layer(self.current), 0, key, value, self.counters["slot"], self.counters["position"])
        return self.current[0], self.current[1]

    def layer_attend(self: Any, query: torch.Tensor, layer_idx: int, attention_mask: Any = None,
                     scale: float | None = None) -> torch.Tensor:
        if self.stage is None:
            return attend(self, query, layer_idx, attention_mask, scale)
        return StaticBuffers.attend(one_layer(self.current), 0, query, self.counters["slot"],
                                    self.counters["lengths"], self.flash, scale)

    def layer_observe(self: Any, query: torch.Tensor, layer_idx: int) -> None:
        if self.stage is None:
            return observe(self, query, layer_idx)
        return observe(SimpleNamespace(stage=self.stage, window=[self.current[4]]), query, 0)

    def advancing_step(model: Any, tokens: torch.Tensor, positions: torch.Tensor, cache: Any, *,
                       keyword: str) -> Any:
        out = step(model, tokens, positions, cache, keyword=keyword)
        if cache.stage is not None:                               # what the last layer's attend did
            for counter in cache.counters.values():
                counter.add_(1)
            cache._pending = 0
        return out

    def layer_forward(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        cache = next((v for v in (*args, *kwargs.values()) if isinstance(v, cache_class)), None)
        if cache is None or cache.stage is None:
            return forward(self, hidden_states, *args, **kwargs)
        i, stage = self.self_attn.layer_idx, cache.stage
        kwargs["layer_state"] = (stage.keys[i], stage.values[i], stage.positions[i], stage.real[i], cache.window[i])
        return region(self, hidden_states, *args, **kwargs)

    cache_class.update, cache_class.attend, cache_class.observe_queries = layer_update, layer_attend, layer_observe
    step_driver.hf_step, layer.forward = advancing_step, layer_forward


def child(mode: str, layers: int) -> dict:
    from transformers.models.llama import modeling_llama

    layer = modeling_llama.LlamaDecoderLayer   # a lab experiment: the library patches nothing outside integrations/
    if mode == "region_args":
        pass_layer_state(layer)
    elif mode != "whole":
        hashed = {"reuse_hash_fn": lambda *args, **kwargs: 0} if mode == "region_hash" else {}
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
    out_file = Path(args.out)   # rows of other modes and depths in it are kept
    kept = json.loads(out_file.read_text())["rows"] if out_file.is_file() else []
    rows = [row for row in kept if row["mode"] not in args.modes or row["layers"] != args.layers]
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            for run in ("cold", "kept"):
                child_row = run_child(__file__, ["--child", mode, "--layers", str(args.layers)], Path(tmp) / mode)
                rows.append({"mode": mode, "cache_dir": run, "layers": args.layers, **child_row})
                phases = rows[-1]["compile_phases_s"]
                print(f"{mode:12s} {run:5s} warm-up {rows[-1]['seconds']:6.1f} s, compiling {phases['total']:5.1f} s "
                      f"(tracing {phases['bytecode_tracing']:5.1f}, backend {phases['backend']:5.1f}), "
                      f"tokens {rows[-1]['tokens'][:6]}", flush=True)
                write_json(args.out, {"benchmark": "regional_compile", "environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
