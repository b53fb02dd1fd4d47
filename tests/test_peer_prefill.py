"""The peers' prefill policies (issue 15): ``flexprefill``, ``xattention``, ``vertical_slash`` against their float64
twins in reference/peers.py, their covering settings against dense attention, their coverage invariants, and their
entry points (``make_prefill``, ``fe.enable``, the CLI, the evaluation's budget axis)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import make_qkv, prefill_case
from hypothesis import event, given, settings
from hypothesis import strategies as st

from bench.eval import resolve
from flexentropy import EntropyConfig
from flexentropy.config import Q_BLOCK_SIZE
from flexentropy.policies import FlexPrefill, VerticalSlash, XAttention, make_prefill
from flexentropy.policies.prefill.fixed import fixed_blocks
from flexentropy.policies.prefill.ranking import mass_cover
from flexentropy.policies.prefill.vertical_slash import token_density
from flexentropy.sparse.plan import causal_blocks
from reference import peers
from reference import policies as ref
from reference.prefill import blocks_to_dense_mask, masked_attention

pytestmark = pytest.mark.usefixtures("one_thread")

PEERS = ("flexprefill", "xattention", "vertical_slash")
KNOBS = {
    "flexprefill": st.fixed_dictionaries({"gamma": st.sampled_from([0.0, 0.5, 0.9, 1.0]),
                                          "tau": st.sampled_from([0.0, 0.1, 0.3, 1.0]),
                                          "min_budget": st.sampled_from([None, 0, 64, 300])}),
    "xattention": st.fixed_dictionaries({"threshold": st.sampled_from([0.0, 0.5, 0.9, 1.0]),
                                         "stride": st.sampled_from([1, 4, 8, 16])}),
    "vertical_slash": st.fixed_dictionaries({"vertical": st.sampled_from([0, 40, 200]),
                                             "slash": st.sampled_from([0, 120, 500, 5000])}),
}


def structured(q: torch.Tensor, k: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sink and locality (design.md §6's structured inputs, small): random heads are near uniform and keep
    everything."""
    gen = torch.Generator().manual_seed(seed)
    u = F.normalize(torch.randn(q.shape[-1], generator=gen, dtype=torch.float64), dim=0).to(q.dtype)
    q, k = q + 4 * u, k.clone()
    k[..., :4, :] += 4 * u
    smooth = F.avg_pool1d(torch.randn(1, q.shape[-1], q.shape[-2] + 15, generator=gen, dtype=torch.float64), 16, 1)
    local = (3 * smooth[0].T).to(q.dtype)
    return q + local, k + local


def float64_case(case: dict, shaped: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = make_qkv({**case, "dtype": torch.float64})
    return (*structured(q, k, case["seed"]), v) if shaped else (q, k, v)


# --------------------------------------------------------------------------------------------------------------
# plans against the float64 twins
# --------------------------------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(case=prefill_case(max_n=1100, dims=(16,)), name=st.sampled_from(PEERS), data=st.data(),
       shaped=st.booleans(), layer_idx=st.sampled_from([0, 1, 1]))
def test_peer_plans_match_reference(case, name, data, shaped, layer_idx):
    """float64 inputs: the fast plan computes in float64 too, so decisions match the twin's exactly."""
    knobs = data.draw(KNOBS[name])
    config = case["config"]
    if name == "xattention" and config.block_size % knobs["stride"]:
        knobs["stride"] = 8
    q, k, _ = float64_case(case, shaped)
    plan = make_prefill(name, config, **knobs).plan(q, k, layer_idx)
    want = ref.prefill_blocks(name, q, k, config, layer_idx, **knobs)
    assert plan.blocks.shape == want.shape and torch.equal(plan.blocks, want)
    assert plan.dense == (layer_idx in config.dense_layers or case["n"] <= config.dense_prefix)
    event(f"{name} density {'1' if plan.density == 1 else '<1'}")


def test_xattention_mass_matches_reference():
    gen = torch.Generator().manual_seed(0)
    for n, stride, block in ((1, 1, 64), (300, 8, 64), (700, 16, 128), (1000, 4, 128)):
        q, k = torch.randn(2, 4, n, 8, generator=gen, dtype=torch.float64), torch.randn(2, 2, n, 8, generator=gen,
                                                                                         dtype=torch.float64)
        got = XAttention(EntropyConfig(block_size=block), stride=stride).block_mass(q, k)
        want = peers.xattention_mass(q, k, stride, block)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        tiles = torch.tensor([min(Q_BLOCK_SIZE, n - qb * Q_BLOCK_SIZE) for qb in range(got.shape[2])])
        torch.testing.assert_close(got.sum(-1), (-(-tiles // stride)).double().expand_as(got.sum(-1)))


@settings(max_examples=200, deadline=None)
@given(scores=st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.3, 1.0, 2.5]), min_size=1, max_size=12),
       data=st.data(), fraction=st.sampled_from([0.0, 0.3, 0.5, 0.9, 0.99, 1.0]))
def test_mass_cover_is_the_smallest_best_first_set(scores, data, fraction):
    n = len(scores)
    forced = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    free = [not f and data.draw(st.booleans()) for f in forced]
    scores = [s if f or g else 0.0 for s, f, g in zip(scores, free, forced, strict=True)]  # 0 outside the support
    x = torch.tensor(scores, dtype=torch.float64)
    got = mass_cover(x, torch.tensor(free), torch.tensor(forced), fraction)
    want = peers.cover({i: s for i, s in enumerate(scores) if free[i] or forced[i]},
                       {i for i in range(n) if forced[i]}, fraction)
    assert sorted(torch.nonzero(got).flatten().tolist()) == sorted(want)
    kept = float((x * (got | torch.tensor(forced))).sum())
    assert kept >= fraction * float(x.sum()) - 1e-12 or bool((got == torch.tensor(free)).all())


# --------------------------------------------------------------------------------------------------------------
# covering settings equal dense attention
# --------------------------------------------------------------------------------------------------------------


COVERING = {"flexprefill": {"gamma": 1.0}, "xattention": {"threshold": 1.0},
            "vertical_slash": {"vertical": 5000, "slash": 5000}}


@pytest.mark.parametrize("name", PEERS)
@pytest.mark.parametrize(("n", "block"), [(700, 64), (1000, 128)])
def test_covering_settings_equal_dense_attention(name, n, block):
    config = EntropyConfig(segment_size=256, block_size=block, dense_prefix=0, dense_last_segment=False,
                           sink_blocks=0)
    case = {"batch": 2, "hq": 6, "hkv": 3, "n": n, "d": 16, "dtype": torch.float32, "seed": n}
    q, k, v = make_qkv(case)
    q, k = structured(q, k, 1)
    policy = make_prefill(name, config, **COVERING[name])
    plan = policy.plan(q, k)
    assert torch.equal(plan.blocks, causal_blocks(n, block).expand_as(plan.blocks)) and not plan.dense
    out = policy.attention(q, k, v, compiled=False)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", PEERS)
def test_sparse_plans_run_as_their_masks(name):
    """A sparse plan through eager flex equals float64 attention under the plan's token mask."""
    config = EntropyConfig(segment_size=128, block_size=64, dense_prefix=128, dense_last_segment=False)
    case = {"batch": 1, "hq": 4, "hkv": 2, "n": 900, "d": 16, "dtype": torch.float32, "seed": 5}
    q, k, v = make_qkv(case)
    q, k = structured(q, k, 2)
    knobs = {"flexprefill": {"gamma": 0.5, "tau": 0.2, "min_budget": 64}, "xattention": {"threshold": 0.8},
             "vertical_slash": {"vertical": 20, "slash": 110}}[name]
    policy = make_prefill(name, config, **knobs)
    plan = policy.plan(q, k)
    assert plan.density < 0.9, plan
    out = policy.attention(q, k, v, compiled=False)
    want = masked_attention(q, k, v, blocks_to_dense_mask(plan.blocks, 900, 64))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_compiled_kernel_runs_peer_plans():
    """One fixed shape through the compiled kernel (one CPU compile shared by the three plans)."""
    config = EntropyConfig(segment_size=256, block_size=128, dense_prefix=256, dense_last_segment=False)
    case = {"batch": 2, "hq": 4, "hkv": 2, "n": 1100, "d": 64, "dtype": torch.float32, "seed": 9}
    q, k, v = make_qkv(case)
    q, k = structured(q, k, 3)
    for name, knobs in (("flexprefill", {"min_budget": 128}), ("xattention", {}),
                        ("vertical_slash", {"vertical": 50, "slash": 200})):
        policy = make_prefill(name, config, **knobs)
        plan = policy.plan(q, k)
        compiled = policy.attention(q, k, v)
        want = masked_attention(q, k, v, plan.to_dense_mask())
        assert float((compiled.double() - want).norm() / want.norm()) < 1e-5, name


# --------------------------------------------------------------------------------------------------------------
# coverage invariants
# --------------------------------------------------------------------------------------------------------------


def invariant_case(seed: int, n: int = 1000) -> tuple[EntropyConfig, torch.Tensor, torch.Tensor]:
    config = EntropyConfig(segment_size=256, block_size=64, dense_prefix=0, dense_last_segment=False)
    q, k, _ = make_qkv({"batch": 2, "hq": 8, "hkv": 2, "n": n, "d": 32, "dtype": torch.float32, "seed": seed})
    return config, *structured(q, k, seed)


@pytest.mark.parametrize("threshold", [0.3, 0.7, 0.9])
def test_xattention_rows_hold_the_threshold_and_no_more_than_needed(threshold):
    config, q, k = invariant_case(0)
    policy = XAttention(config, threshold=threshold)
    mass, blocks = policy.block_mass(q, k), policy.plan(q, k).blocks
    fixed = fixed_blocks(q.shape[-2], config)
    kept = (mass * blocks).sum(-1)
    assert bool((kept >= threshold * mass.sum(-1) - 1e-5).all())
    chosen = blocks & ~fixed                                       # dropping the weakest chosen block falls short
    weakest = mass.masked_fill(~chosen, math.inf).amin(-1)
    has = chosen.any(-1)
    assert bool((kept[has] - weakest[has] < threshold * mass.sum(-1)[has] + 1e-5).all())
    assert 0.05 < policy.plan(q, k).density < 1


@pytest.mark.parametrize(("gamma", "tau"), [(0.5, 0.0), (0.9, 0.0), (0.9, 1.0), (0.9, 0.1)])
def test_flexprefill_heads_hold_gamma_of_their_estimate(gamma, tau):
    """Vertical-slash heads: the last query block's row keeps >= gamma of the vertical and of the diagonal mass;
    query-aware heads: the table keeps >= gamma of the pooled estimate's total; every head >= min_budget."""
    config, q, k = invariant_case(1)
    policy = FlexPrefill(config, gamma=gamma, tau=tau, min_budget=256)
    est, blocks = policy.estimate(q, k), policy.plan(q, k).blocks
    assert bool((est.query_aware == (est.divergence < tau)).all())
    last = blocks[..., -1, :]                                      # the row the estimate is about
    num_blocks, own = last.shape[-1], (q.shape[-2] - 1) // 64
    bands = last[..., own - torch.arange(num_blocks).clamp(max=own)] & (torch.arange(num_blocks) <= own)
    vertical_slash = ~est.query_aware
    assert bool(((est.vertical * last).sum(-1)[vertical_slash] >= gamma - 1e-5).all())
    assert bool(((est.slash * bands).sum(-1)[vertical_slash] >= gamma - 1e-5).all())
    aware = (est.block_mass * blocks).sum((-2, -1))[est.query_aware]
    assert bool((aware >= gamma * blocks.shape[-2] - 1e-4).all())
    assert bool((last.sum(-1) >= 4).all())                         # ceil(256 / 64) columns at least
    if tau in (0.0, 1.0):
        assert bool(est.query_aware.all()) == (tau == 1.0)


def test_vertical_slash_blocks_hold_every_selected_pair():
    config, q, k = invariant_case(2, n=900)
    policy = VerticalSlash(config, vertical=40, slash=150)
    columns, diagonals = policy.select_tokens(q, k)
    assert bool((columns.sum(-1) == 40).all()) and bool((diagonals.sum(-1) == 150).all())
    assert bool(columns[..., :30].all()) and bool(diagonals[..., :100].all())   # MInference's sinks and local
    mask = policy.plan(q, k).to_dense_mask()
    i, j = torch.arange(900)[:, None], torch.arange(900)[None, :]
    on_pattern = (j <= i) & (columns[..., None, :] | diagonals[..., (i - j).clamp(min=0)])
    assert bool((mask | ~on_pattern).all())
    density = token_density(columns, diagonals)
    exact = on_pattern.sum((-2, -1)) / (900 * 901 / 2)
    torch.testing.assert_close(density, exact.double())
    assert bool((density < policy.plan(q, k).density).all())      # blocks hold more than the pattern


# --------------------------------------------------------------------------------------------------------------
# knobs and entry points
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("build", "message"), [
    (lambda: FlexPrefill(gamma=1.5), r"FlexPrefill.gamma must be a finite number in \[0.0, 1.0\]"),
    (lambda: FlexPrefill(tau=-0.1), r"FlexPrefill.tau must be a finite number >= 0.0"),
    (lambda: FlexPrefill(min_budget=1.5), r"FlexPrefill.min_budget must be an int"),
    (lambda: XAttention(threshold=2), r"XAttention.threshold must be a finite number in \[0.0, 1.0\]"),
    (lambda: XAttention(stride=0), r"XAttention.stride must be >= 1"),
    (lambda: XAttention(EntropyConfig(block_size=64), stride=128), r"XAttention.stride \(128\) must divide"),
    (lambda: VerticalSlash(vertical=-1), r"VerticalSlash.vertical must be >= 0"),
    (lambda: make_prefill("vertical_slash", slash=True), r"VerticalSlash.slash must be an int"),
])
def test_bad_knobs_are_rejected(build, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build()


def test_make_prefill_and_the_evaluation_budget():
    policy = make_prefill("flexprefill", gamma=0.8, base_budget=512, segment_size=256)
    assert isinstance(policy, FlexPrefill) and policy.gamma == 0.8 and policy.min_tokens == 512
    assert policy.config == EntropyConfig(base_budget=512, segment_size=256)
    assert make_prefill("xattention", stride=16).stride == 16
    config = EntropyConfig(segment_size=256, block_size=64)
    assert resolve.make_prefill_policy("flexprefill", config, 128).min_tokens == 128
    assert resolve.make_prefill_policy("flexprefill:min_budget=64", config, 128).min_tokens == 64
    assert resolve.prefill_has_budget("flexprefill")
    assert not resolve.prefill_has_budget("xattention") and not resolve.prefill_has_budget("vertical_slash")
    assert resolve.make_prefill_policy("xattention:threshold=0.8", config, None).threshold == 0.8


def test_cli_accepts_the_peers():
    from flexentropy.cli import build_parser

    for name in PEERS:
        assert build_parser().parse_args(["--prefill", name]).prefill == name


# --------------------------------------------------------------------------------------------------------------
# the GPU benchmark (profiling/peers.py): CPU smoke run and the adapters' plumbing on stand-ins of the released code
# --------------------------------------------------------------------------------------------------------------


def _bench_module():
    path = Path(__file__).resolve().parents[1] / "profiling" / "peers.py"
    spec = importlib.util.spec_from_file_location("profiling_peers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FAKE_FLEXPREFILL = '''
import torch, torch.nn.functional as F
def get_active_blocks(q, k, v, block_size, gamma, min_budget, max_budget, tau, gqa_interleave):
    c = -(-q.shape[1] // block_size)
    flat = torch.tensor([r * c + j for r in range(c) for j in (0, r)])     # sink column and diagonal
    return [[flat for _ in range(q.shape[2])] for _ in range(q.shape[0])]
def flex_prefill_attention(q, k, v, gamma, tau, min_budget=None, block_size=128):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=True)
    return out.transpose(1, 2)
'''
FAKE_XATTENTION = '''
import torch
def xattn_estimate(q, k, block_size, stride, threshold, chunk_size, use_triton, causal):
    assert q.shape[1] == k.shape[1] and chunk_size % block_size == 0
    c = -(-q.shape[2] // chunk_size) * chunk_size // block_size
    return None, torch.ones(q.shape[0], q.shape[1], c, c, dtype=torch.bool).tril()
'''


def test_peers_benchmark_runs_and_its_adapters_plumb_shapes(tmp_path, monkeypatch):
    bench = _bench_module()
    out = tmp_path / "peers.json"
    bench.main(["--tiny", "--contexts", "900", "--inputs", "structured", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == list(bench.POLICIES)
    assert all(0 < r["density"] <= 1 and r["rel_l2_vs_dense"] < 0.5 for r in rows)

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    absent = bench.load_official(tmp_path / "absent")                            # reported, not raised
    assert isinstance(absent["flexprefill"], str) and isinstance(absent["xattention"], str)
    for folder, text in (("FlexPrefill/flex_prefill/ops/flex_prefill_attention.py", FAKE_FLEXPREFILL),
                         ("x-attention/xattn/src/Xattention.py", FAKE_XATTENTION)):
        (tmp_path / "official" / folder).parent.mkdir(parents=True)
        (tmp_path / "official" / folder).write_text(text)
    found = bench.load_official(tmp_path / "official")
    config = EntropyConfig(segment_size=256, base_budget=256, dense_prefix=512)
    q, k, v = make_qkv({"batch": 1, "hq": 4, "hkv": 2, "n": 700, "d": 16, "dtype": torch.float32, "seed": 0})
    runner = bench.Runner(q, k, v, config, 1)
    flex, xatt = bench.bench_official(runner, found)
    assert flex["density"] == pytest.approx((6 + 5) / 21) and flex["rel_l2_vs_dense"] < 1e-5
    assert 0 < flex["iou_vs_ours"] <= 1 and flex["rel_l2_their_blocks_our_kernel"] > 0
    assert xatt["density"] == 1.0 and xatt["rel_l2_their_blocks_our_kernel"] < 1e-5 and "kernel_ms" not in xatt
    assert 0 < xatt["iou_vs_ours"] <= 1 and 0 < xatt["ours_matched_density"] <= 1
    broken = types.SimpleNamespace(xattn_estimate=lambda *a, **kw: 1 / 0)        # a failing peer is a row, not a crash
    assert bench.bench_official(runner, {**found, "xattention": broken})[1]["error"].startswith("ZeroDivisionError")
