"""Shared fixtures and Hypothesis strategies for flexentropy's tests."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from flexentropy import EntropyConfig

settings.register_profile(
    "ci", deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HEADS = [(1, 1), (4, 2), (8, 2), (6, 3)]
"""(Hq, Hkv) pairs the issue asks for: MHA, GQA 2, GQA 4, GQA 2 with odd head counts."""


EDGE_LENGTHS = (1, 2, 127, 128, 129, 255, 257, 511, 512, 513, 767, 1000, 1025, 1537, 2047, 2500, 2999)
"""Sequence lengths around block and segment boundaries, drawn as often as uniform lengths."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors gain nothing from intra-op threads; on a loaded machine their spin-waits slow each op ~1000x.
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")`` in modules of many tiny ops."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@st.composite
def prefill_case(draw: st.DrawFn, max_n: int = 3000, dims: tuple[int, ...] = (16, 64, 128)) -> dict:
    """Random shapes, dtype and an `EntropyConfig` small enough that every code path fires at small N."""
    hq, hkv = draw(st.sampled_from(HEADS))
    block = draw(st.sampled_from([64, 128]))
    segment = draw(st.sampled_from([s for s in (128, 256, 512) if s % block == 0]))
    config = EntropyConfig(
        segment_size=segment,
        block_size=block,
        base_budget=draw(st.sampled_from([block, 2 * block, 256, 384])),
        budget_alpha=draw(st.sampled_from([0.5, 1.0])),
        max_budget_factor=draw(st.sampled_from([1.0, 3.0])),
        fluctuation=draw(st.sampled_from(["abs", "signed"])),
        budget_rule=draw(st.sampled_from(["fluctuation", "coverage"])),
        # not 0.5: saturated rows are multiples of 1/4; a pair is its first value at these lengths (tensor path)
        coverage=draw(st.sampled_from([0.6, 0.9, 1.0, (0.9, 0.6), (1.0, 0.6)])),
        observation=draw(st.sampled_from(["paper", "critiprefill", "probe", "pooled"])),
        probes=draw(st.sampled_from([4, 8])),
        observation_scale=draw(st.sampled_from([1.0, 0.125])),
        sink_blocks=draw(st.integers(0, 2)),
        local_blocks=draw(st.integers(0, 2)),
        dense_prefix=draw(st.sampled_from([0, segment])),
        dense_last_segment=draw(st.booleans()),
        dense_layers=(0,),
    )
    return {
        "batch": draw(st.integers(1, 2)),
        "hq": hq,
        "hkv": hkv,
        "n": draw(st.one_of(st.sampled_from([n for n in EDGE_LENGTHS if n <= max_n] + [max_n]),
                            st.integers(1, max_n))),
        "d": draw(st.sampled_from(dims)),
        "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "config": config,
    }


def make_qkv(case: dict, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k/v ``[B, H, N, D]`` for a `prefill_case`: N(0, 1) draws from the case's seed, in its dtype."""
    gen = torch.Generator().manual_seed(case["seed"])
    b, hq, hkv, n, d = case["batch"], case["hq"], case["hkv"], case["n"], case["d"]
    q = torch.randn(b, hq, n, d, generator=gen)
    k = torch.randn(b, hkv, n, d, generator=gen)
    v = torch.randn(b, hkv, n, d, generator=gen)
    return tuple(t.to(device=device, dtype=case["dtype"]) for t in (q, k, v))
