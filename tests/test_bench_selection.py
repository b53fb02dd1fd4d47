"""CPU micro-benchmarks of the selection path (pytest-benchmark). They time, never assert a time.

    python -m pytest tests/test_bench_selection.py --benchmark-only --benchmark-columns=min,median,max
"""

from __future__ import annotations

import pytest
import torch

import flexentropy as fe
from flexentropy.policies.prefill.entropy.budgets import allocate_budgets
from flexentropy.policies.prefill.entropy.entropies import segment_entropy
from flexentropy.policies.prefill.entropy.observation import observation_attention
from flexentropy.policies.prefill.entropy.selection import coverage_budgets
from flexentropy.policies.prefill.fixed import block_table
from flexentropy.sparse.plan import block_mask_tensors

N, HQ, HKV, D = 16384, 8, 2, 64


def _budgets(cfg: fe.EntropyConfig, a_obs: torch.Tensor) -> torch.Tensor:
    if cfg.budget_rule == "coverage":
        return coverage_budgets(a_obs, cfg)
    return allocate_budgets(segment_entropy(a_obs, normalise=cfg.observation in ("probe", "pooled")), cfg)


def _stages(cfg: fe.EntropyConfig, q: torch.Tensor, k: torch.Tensor) -> dict:
    a_obs = observation_attention(q, k, cfg.segment_size, cfg.block_size, observation=cfg.observation,
                                  scale=cfg.observation_scale, probes=cfg.probes)
    entropy = segment_entropy(a_obs, normalise=cfg.observation in ("probe", "pooled"))
    budgets = _budgets(cfg, a_obs)
    blocks = block_table(a_obs, budgets, cfg, N)
    return {"q": q, "k": k, "cfg": cfg, "a_obs": a_obs, "entropy": entropy, "budgets": budgets, "blocks": blocks}


@pytest.fixture(scope="module", params=["default", "paper"])
def inputs(request: pytest.FixtureRequest) -> dict:
    """The stages of the default rule (probe observation, coverage budgets) or of the paper's (Alg. 2-3)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, HQ, N, D, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(1, HKV, N, D, generator=gen, dtype=torch.bfloat16)
    return _stages(fe.EntropyConfig() if request.param == "default" else fe.EntropyConfig.paper(), q, k)


def _bench(benchmark, fn, *args, **kwargs):
    return benchmark.pedantic(fn, args=args, kwargs=kwargs, rounds=3, iterations=1, warmup_rounds=1)


def test_bench_observation(benchmark, inputs: dict) -> None:
    cfg = inputs["cfg"]
    out = _bench(benchmark, observation_attention, inputs["q"], inputs["k"], cfg.segment_size, cfg.block_size,
                 observation=cfg.observation, scale=cfg.observation_scale, probes=cfg.probes)
    assert out.shape == (1, HQ, N // cfg.segment_size, N // cfg.block_size)


def test_bench_entropy_and_budgets(benchmark, inputs: dict) -> None:
    cfg = inputs["cfg"]
    out = _bench(benchmark, _budgets, cfg, inputs["a_obs"])
    assert torch.equal(out, inputs["budgets"])
    assert (out >= (cfg.block_size if cfg.budget_rule == "coverage" else cfg.base_budget)).all()


def test_bench_block_table(benchmark, inputs: dict) -> None:
    out = _bench(benchmark, block_table, inputs["a_obs"], inputs["budgets"], inputs["cfg"], N)
    assert torch.equal(out, inputs["blocks"])


def test_bench_mask_tensors(benchmark, inputs: dict) -> None:
    num, idx, full_num, full_idx = _bench(benchmark, block_mask_tensors, inputs["blocks"], N, 128)
    assert int(num.sum() + full_num.sum()) == int(inputs["blocks"].sum())


def test_bench_select_blocks(benchmark, inputs: dict) -> None:
    plan = _bench(benchmark, fe.select_blocks, inputs["q"], inputs["k"], inputs["cfg"])
    assert torch.equal(plan.blocks, inputs["blocks"])
