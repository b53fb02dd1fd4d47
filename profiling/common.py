"""Shared helpers of the benchmarks: timing, inputs, JSON output."""

from __future__ import annotations

import functools
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import flexentropy as fe

PROBE_KERNEL = {"auto": None, "on": True, "off": False}
"""``--probe-kernel`` choices of the benchmarks: `EntropyConfig.probe_kernel`'s values."""


dense_flex = torch.compile(flex_attention, dynamic=False)
"""Dense flex attention, compiled per shape: the dense baseline on the FLASH backend (``kernel_options``)."""


@functools.lru_cache(maxsize=2)
def causal_block_mask(n: int, device: torch.device) -> BlockMask:
    """The causal BlockMask of an ``n``-token prompt, built once per length (compiled: no N x N tensor)."""
    return create_block_mask(lambda b, h, q, k: q >= k, None, None, n, n, device=device, _compile=True)


def speed_config(**changes: object) -> fe.EntropyConfig:
    """The default's probe observation with fixed per-head budgets (Alg. 3 from ``B_0 = base_budget``): the
    flexentropy configuration of the speed benchmarks on random weights.

    Random weights spread attention almost evenly, so the default coverage rule would keep most blocks there (it
    keeps what a real model's attention holds: 19.5% of the blocks at 32k on Qwen2.5-Coder-1.5B, docs/quality.md);
    fixed budgets give the random model a density a real model reaches, and keep the probe's cost in the timing.
    """
    return fe.EntropyConfig(budget_rule="fluctuation", **changes)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 2, reps: int = 10) -> float:
    """Median wall time of ``fn`` in ms (CUDA events on GPU, perf_counter on CPU), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def record_graph(step: Callable[[], object], device: torch.device, warmup: int = 2,
                 undo: Callable[[], None] | None = None) -> Callable[[], object]:
    """``step`` recorded as a CUDA graph, after ``warmup`` calls on a side stream and ``undo`` of what they changed;
    returns the graph's replay (off CUDA, ``step`` itself)."""
    if device.type != "cuda":
        return step
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    if undo is not None:
        undo()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def attention_inputs(b: int, hq: int, hkv: int, n: int, d: int, dtype: torch.dtype, device: torch.device,
                     kind: str = "random", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[b, hq, n, d]``, k/v ``[b, hkv, n, d]``.

    ``kind="random"``: N(0, 1) (nearly uniform attention, the hardest case for sparsity).
    ``kind="structured"``: adds an attention sink (a shared unit vector x12 in every query and the first 4 keys,
    projected out of the other keys) and locality (a moving sum over 128 tokens of a random signal added to q
    and k), closer to what real models show (design.md §5).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, hq, n, d, device=device, generator=gen)
    k = torch.randn(b, hkv, n, d, device=device, generator=gen)
    v = torch.randn(b, hkv, n, d, device=device, generator=gen)
    if kind == "structured":
        u = torch.nn.functional.normalize(torch.randn(d, device=device, generator=gen), dim=0)
        k = k - (k @ u)[..., None] * u
        q = q + 12 * u
        k[..., :4, :] += 12 * u
        signal = torch.randn(b, hkv, n + 127, d, device=device, generator=gen) / 128**0.5
        local = signal.cumsum(dim=-2)
        local = local[..., 127:, :] - torch.nn.functional.pad(local, (0, 0, 1, 0))[..., : n, :]
        k = k + local
        q = q + local.repeat_interleave(hq // hkv, dim=1)
    elif kind != "random":
        raise ValueError(f"kind must be 'random' or 'structured', got {kind!r}")
    return q.to(dtype), k.to(dtype), v.to(dtype)


def environment() -> dict[str, str]:
    info = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import flash_attn

        info["flash_attn"] = getattr(flash_attn, "__version__", "present")
    except ImportError:
        info["flash_attn"] = "absent"
    return info


def write_json(path: str | Path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
