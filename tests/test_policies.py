"""Every prefill and cache policy (flexentropy.policies, design.md §3) against its dense twin in reference/policies.py.

Kept sets and compressed tensors step by step, budgets per head and layer, decode attention (rectangular and
ragged), memory bounds over 500 generated tokens for the decode-time policies, model signals (InfoKV) and
`forward_influence` on a tiny random Llama.
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from conftest import HEADS, make_qkv, prefill_case
from hypothesis import event, given, settings
from hypothesis import strategies as st

from bench.diagnostics import forward_influence
from flexentropy import EntropyConfig
from flexentropy.caches import PolicyCache, make_cache
from flexentropy.kv import ragged_decode_attention
from flexentropy.policies import (
    CACHE_POLICIES,
    H2O,
    PREFILL_POLICIES,
    AdaKV,
    BoundedCache,
    CachePolicy,
    InfoKV,
    LatentPolicy,
    PrefillPolicy,
    PyramidKV,
    SnapKV,
    StreamingLLM,
    StreamingPrefill,
    make_cache_policy,
    make_prefill,
)
from flexentropy.policies.cache.infokv import restricted_entropy
from flexentropy.policies.cache.pyramidkv import pyramid_budgets
from flexentropy.settings import parse_settings
from reference import policies as ref
from reference.prefill import blocks_to_dense_mask, masked_attention

F64 = torch.float64
DOCS = Path(__file__).resolve().parents[1] / "docs" / "policies.md"


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------------------------------
# registries and knobs
# --------------------------------------------------------------------------------------------------------------


def test_registries_hold_every_policy_of_spec_3():
    assert list(PREFILL_POLICIES) == ["dense", "entropy", "entropy_paper", "critiprefill", "streaming", "flexprefill",
                                     "xattention", "vertical_slash"]
    assert list(CACHE_POLICIES) == ["full", "latent", "snapkv", "adakv", "pyramidkv", "streamingllm", "h2o", "infokv",
                                    "bounded"]
    for name, cls in PREFILL_POLICIES.items():
        assert issubclass(cls, PrefillPolicy) and cls.name == name and cls.paper and cls.keeps
        assert isinstance(cls(), cls)  # every knob has a default
    for name, cls in CACHE_POLICIES.items():
        assert issubclass(cls, CachePolicy) and cls.name == name and cls.paper and cls.keeps and cls.decides
        assert isinstance(cls(), cls)


def test_docs_table_lists_every_policy_and_knob():
    text = DOCS.read_text()
    for name, cls in {**PREFILL_POLICIES, **CACHE_POLICIES}.items():
        assert f"`{name}`" in text, name
        for knob in (f.name for f in fields(cls) if f.name != "config"):
            assert f"`{knob}`" in text, (name, knob)


def test_docs_give_the_shared_geometry_at_its_defaults() -> None:
    """Issue 77: policies.md gave ``segment_size`` 512 (it is 256)."""
    text, defaults = " ".join(DOCS.read_text().split()), EntropyConfig()
    shared = text.split("dense fallbacks from the `EntropyConfig` (", 1)[1].split("kernel", 1)[0]
    names = ("segment_size", "block_size", "sink_blocks", "local_blocks", "dense_prefix", "dense_last_segment",
             "dense_layers", "base_budget")
    assert shared == ", ".join(f"`{name}` {getattr(defaults, name)}" for name in names) + ", "


def test_make_prefill_splits_policy_knobs_from_config_knobs():
    policy = make_prefill("streaming", window=256, base_budget=512, segment_size=256)
    assert isinstance(policy, StreamingPrefill) and policy.window == 256
    assert policy.config == EntropyConfig(base_budget=512, segment_size=256)
    config = EntropyConfig(block_size=64)
    assert make_prefill("critiprefill", config).config is config
    assert make_prefill(policy) is policy
    with pytest.raises(ValueError, match="unknown prefill policy 'sparse'; choose one of dense, entropy"):
        make_prefill("sparse")
    with pytest.raises(TypeError, match="either a PrefillPolicy"):
        make_prefill(policy, window=3)


def test_a_misspelt_prefill_knob_is_named_with_the_policys_knobs() -> None:
    """Issue 77: ``make_prefill("xattention", cfg, treshold=0.5)`` blamed "EntropyConfig has no field(s)", and the
    record ``{"prefill": "xattention", "prefill_knobs": {"treshold": 0.5}}`` was accepted, to fail at the first
    forward; both name the policy's knobs now, and the record's knob values are checked when it is read."""
    with pytest.raises(TypeError, match=r"prefill policy 'xattention' has no knob\(s\) \['treshold'\]; its knobs: "
                                        r"threshold, stride; EntropyConfig's fields are taken too"):
        make_prefill("xattention", EntropyConfig(), treshold=0.5)
    with pytest.raises(TypeError, match=r"prefill policy 'dense' has no knob\(s\) \['nonsense'\]; it takes no knobs"):
        make_prefill("dense", nonsense=1)
    with pytest.raises(ValueError, match=r"config.flexentropy\['prefill_knobs'\]: prefill policy 'xattention' has "
                                         r"no knob\(s\) \['treshold'\]; its knobs: threshold, stride"):
        parse_settings({"prefill": "xattention", "prefill_knobs": {"treshold": 0.5}})
    with pytest.raises(ValueError, match=r"\['prefill_knobs'\]: prefill policy 'entropy' has no knob\(s\) "
                                         r"\['segment_size'\]; it takes no knobs \(EntropyConfig's fields go beside"):
        parse_settings({"prefill_knobs": {"segment_size": 512}})
    with pytest.raises(TypeError, match="config.flexentropy: XAttention.threshold must be a number, got str"):
        parse_settings({"prefill": "xattention", "prefill_knobs": {"threshold": "high"}})
    read = parse_settings({"prefill": "xattention", "segment_size": 512, "prefill_knobs": {"threshold": 0.5}})
    assert make_prefill(read.prefill, read.config, **read.knobs).threshold == 0.5


def test_make_cache_builds_a_policy_cache():
    cache = make_cache("snapkv", budget=128, window=16)
    assert isinstance(cache, PolicyCache) and cache.policy == SnapKV(budget=128, window=16)
    assert make_cache_policy("h2o", budget=64).recent_tokens == 32
    assert type(make_cache("latent", budget=64, window=8)).__name__ == "LatentKVCache"
    with pytest.raises(TypeError, match=r"cache policy 'snapkv' has no knob\(s\) \['sinks'\]"):
        make_cache("snapkv", sinks=4)
    with pytest.raises(TypeError, match=r"cache policy 'full' has no knob\(s\) \['foo'\]; it takes no knobs$"):
        make_cache("full", foo=1)   # issue 69: "its knobs: " and an empty list
    with pytest.raises(ValueError, match="unknown cache policy 'lru'"):
        make_cache("lru")


@pytest.mark.parametrize(("build", "message"), [
    (lambda: SnapKV(window=0), r"SnapKV.window must be >= 1"),
    # "must be >= 64" did not say that 64 was the window
    (lambda: SnapKV(budget=8, window=16), r"SnapKV.budget must be >= 16 \(window=16: the window's own entries are "
                                          r"always kept; a smaller budget needs a smaller window=\), got 8"),
    (lambda: make_cache("snapkv", budget=10), r"SnapKV.budget must be >= 64 \(window=64: "),
    (lambda: InfoKV(budget=10), r"InfoKV.budget must be >= 64 \(window=64: "),
    (lambda: SnapKV(pool=4), r"SnapKV.pool must be odd"),
    (lambda: AdaKV(safeguard=1.5), r"AdaKV.safeguard must be a finite number in \[0.0, 1.0\]"),
    (lambda: PyramidKV(beta=0.5), r"PyramidKV.beta must be a finite number >= 1.0"),
    (lambda: StreamingLLM(budget=4, sinks=4), r"StreamingLLM.budget must be >= 5 \(sinks=4 \+ 1: "),
    (lambda: H2O(budget=64, recent=64), r"H2O.recent \(64\) must be < budget \(64\)"),
    (lambda: InfoKV(alpha=2.0), r"InfoKV.alpha must be a finite number in \[0.0, 1.0\]"),
    (lambda: BoundedCache(recent=8, chunk=16), r"BoundedCache.recent must be >= 16 \(chunk=16: "),
    # issue 69: named EntropyConfig.decode_budget and decode_window, not the knobs passed
    (lambda: LatentPolicy.from_knobs(budget=8, window=16), r"^LatentPolicy.budget \(8\) must be >= window \(16\)"),
    (lambda: make_cache("latent", budget=10), r"^LatentPolicy.budget \(10\) must be >= window \(32\): the window's "),
    (lambda: make_cache("latent", window=0), r"^LatentPolicy.window must be in \[1, 16777216\], got 0"),
    (lambda: make_cache("latent", delay=1.5), r"^LatentPolicy.delay must be an int, got float 1.5"),
    (lambda: StreamingPrefill(window=-1), r"StreamingPrefill.window must be >= 0"),
    (lambda: make_prefill("critiprefill", observation="max"), r"CritiPrefill.observation must be one of"),
])
def test_bad_knobs_are_rejected_on_construction(build, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build()


def test_policies_are_frozen_and_typed():
    with pytest.raises(TypeError, match="must be an int"):
        SnapKV(budget=10.5)
    with pytest.raises(AttributeError):
        SnapKV().budget = 3  # frozen


# --------------------------------------------------------------------------------------------------------------
# prefill policies against the reference block tables
# --------------------------------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(case=prefill_case(max_n=1100, dims=(16,)), name=st.sampled_from(list(PREFILL_POLICIES)),
       window=st.sampled_from([None, 0, 64, 200, 512]), observation=st.sampled_from(["paper", "critiprefill"]),
       layer_idx=st.sampled_from([0, 1]))
def test_prefill_plans_match_reference(case, name, window, observation, layer_idx):
    q, k, _ = make_qkv(case)
    if name in ("flexprefill", "xattention", "vertical_slash"):  # mass thresholds: decided in float64 on both sides
        q, k = q.double(), k.double()
    config = case["config"]
    knobs = {"streaming": {"window": window}, "critiprefill": {"observation": observation}}.get(name, {})
    plan = make_prefill(name, config, **knobs).plan(q, k, layer_idx)
    want = ref.prefill_blocks(name, q, k, config, layer_idx, **knobs)
    assert plan.blocks.shape == want.shape and torch.equal(plan.blocks, want)
    dense = name == "dense" or layer_idx in config.dense_layers or case["n"] <= config.dense_prefix
    assert plan.dense == dense
    if name == "critiprefill" and not dense:  # the same budget B_0 for every head: all rigid
        assert bool(plan.rigid.all()) and bool((plan.budgets == config.base_budget).all())
    event(f"{name} {'dense' if dense else 'sparse'}")


@pytest.mark.parametrize("name", list(PREFILL_POLICIES))
def test_prefill_attention_equals_masked_reference(name):
    config = EntropyConfig(segment_size=128, block_size=64, base_budget=64, dense_prefix=128, dense_last_segment=False)
    case = {"batch": 1, "hq": 4, "hkv": 2, "n": 600, "d": 16, "dtype": torch.float32, "seed": 3}
    q, k, v = make_qkv(case)
    knobs = {"streaming": {"window": 64}}.get(name, {})
    policy = make_prefill(name, config, **knobs)
    out = policy.attention(q, k, v, layer_idx=1, compiled=False)
    blocks = ref.prefill_blocks(name, q, k, config, 1, **knobs)
    want = masked_attention(q, k, v, blocks_to_dense_mask(blocks, 600, 64))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


# --------------------------------------------------------------------------------------------------------------
# cache policies against the step-by-step oracle
# --------------------------------------------------------------------------------------------------------------


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=dtype)


def _forward(cache: PolicyCache, q, k, v, layer_idx: int = 0, signal=None, hand_over: str = "after",
             attend: bool = True):
    """One forward of a plain attention module: update, hand-over of queries (and signals), decode attention."""
    if hand_over == "before":
        cache.observe_queries(q, layer_idx)
    cache.update(k, v, layer_idx)
    if hand_over == "after":
        cache.observe_queries(q, layer_idx)
    if signal is not None:
        cache.layers[layer_idx].record_signal(signal)
    return cache.attend(q, layer_idx) if attend else None


def _cache_positions(cache: PolicyCache, layer_idx: int) -> list:
    """``[b][h]`` stored positions of a layer, ragged part included."""
    layer = cache.layers[layer_idx]
    tail = layer.positions().tolist()
    if layer.ragged is None:
        return tail
    counts = layer.ragged.counts
    flat = layer.ragged.positions.split(counts.reshape(-1).tolist())
    return [[flat[b * counts.shape[1] + h].tolist() + tail[b][h] for h in range(counts.shape[1])]
            for b in range(counts.shape[0])]


POLICY_KNOBS = {
    "snapkv": lambda d: dict(budget=d(st.integers(4, 14)), window=d(st.integers(1, 4)),
                             pool=d(st.sampled_from([1, 3, 5]))),
    "pyramidkv": lambda d: dict(budget=d(st.integers(6, 14)), window=d(st.integers(1, 4)),
                                pool=d(st.sampled_from([1, 3])), beta=d(st.sampled_from([2.0, 20.0]))),
    "adakv": lambda d: dict(budget=d(st.integers(4, 14)), window=d(st.integers(1, 4)),
                            pool=d(st.sampled_from([1, 3])), safeguard=d(st.sampled_from([0.0, 0.2, 0.5]))),
    "streamingllm": lambda d: dict(budget=d(st.integers(6, 16)), sinks=d(st.integers(0, 4))),
    "h2o": lambda d: dict(budget=d(st.integers(6, 16)), recent=d(st.sampled_from([None, 1, 3])),
                          chunk=d(st.sampled_from([3, 256]))),
    "infokv": lambda d: dict(budget=d(st.integers(4, 14)), window=d(st.integers(1, 4)),
                             alpha=d(st.sampled_from([0.0, 0.5, 0.9, 1.0])),
                             compress_every=d(st.integers(1, 6))),
    "bounded": lambda d: dict(sinks=d(st.integers(0, 3)), anchors=d(st.integers(0, 6)),
                              chunk=(chunk := d(st.integers(1, 4))), recent=d(st.integers(chunk, 8)),
                              window=d(st.integers(1, 4)), alpha=d(st.sampled_from([0.0, 0.9, 1.0]))),
}


@st.composite
def _policy_cases(draw, name: str) -> dict:
    return dict(name=name, knobs=POLICY_KNOBS[name](draw), batch=draw(st.integers(1, 2)),
                heads=draw(st.sampled_from(HEADS)), dim=draw(st.sampled_from([2, 4])),
                prompt=draw(st.integers(1, 30)), steps=draw(st.integers(0, 14)), num_layers=draw(st.integers(1, 4)),
                layer=draw(st.integers(0, 3)), seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("name", list(POLICY_KNOBS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_cache_policies_match_oracle(name, data):
    """Kept positions and tensors per head (and per layer for PyramidKV, per head count for AdaKV) and the decode
    attention equal the oracle's after every forward: prompt, then single tokens."""
    case = data.draw(_policy_cases(name))
    knobs = case["knobs"]
    layer_idx = min(case["layer"], case["num_layers"] - 1)
    (q_heads, kv_heads), batch, dim = case["heads"], case["batch"], case["dim"]
    cache = make_cache(name, num_layers=case["num_layers"], **knobs)
    oracle = ref.PolicyOracle(name, knobs, layer_idx, case["num_layers"])
    gen = torch.Generator().manual_seed(case["seed"])
    for step in range(case["steps"] + 1):
        length = case["prompt"] if step == 0 else 1
        q, k, v = (_randn(gen, batch, q_heads, length, dim), _randn(gen, batch, kv_heads, length, dim),
                   _randn(gen, batch, kv_heads, length, dim))
        signal = 3 * torch.rand(batch, length, generator=gen, dtype=F64) if cache.policy.needs_signals else None
        out = _forward(cache, q, k, v, layer_idx, signal, attend=step > 0)  # a prompt attends to itself in full
        oracle.step(q, k, v, signal)
        assert _cache_positions(cache, layer_idx) == oracle.positions(), f"step {step}"
        if step > 0:
            torch.testing.assert_close(out, oracle.attend(q), rtol=1e-9, atol=1e-9)
        layer = cache.layers[layer_idx]
        if layer.ragged is None:
            want = torch.stack([torch.stack([torch.stack([e.key for e in head]) for head in row])
                                for row in oracle.heads])
            assert torch.equal(layer.keys, want)
        assert cache.get_seq_length(layer_idx) == oracle.seen
    assert cache.layers[layer_idx].evictions == oracle.evictions
    event(f"{name}: {min(oracle.evictions, 2)}{'+' if oracle.evictions >= 2 else ''} evictions")


@pytest.mark.parametrize("name", ["snapkv", "h2o", "infokv", "streamingllm", "adakv"])
def test_hand_over_before_or_after_update_is_the_same(name):
    """flexentropy's HF attention hands queries over after ``update``, EntropyAttention before: policies deciding once
    the forward is settled (or without queries) decide the same. (Decisions before an append, as latent's and
    bounded's, score with the last handed-over queries, the current token's included when it came first.)"""
    knobs = {"snapkv": dict(budget=8, window=3), "h2o": dict(budget=8), "infokv": dict(budget=8, window=3,
             compress_every=3), "streamingllm": dict(budget=8, sinks=2), "adakv": dict(budget=8, window=3)}[name]
    caches = [make_cache(name, **knobs) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    for step in range(12):
        length = 20 if step == 0 else 1
        q, k, v = _randn(gen, 2, 4, length, 4), _randn(gen, 2, 2, length, 4), _randn(gen, 2, 2, length, 4)
        signal = torch.rand(2, length, generator=gen, dtype=F64) if caches[0].policy.needs_signals else None
        outs = [_forward(c, q, k, v, signal=signal, hand_over=order, attend=step > 0)
                for c, order in zip(caches, ("after", "before"), strict=True)]
        if step > 0:
            torch.testing.assert_close(outs[0], outs[1])
        assert _cache_positions(caches[0], 0) == _cache_positions(caches[1], 0)


@pytest.mark.parametrize("name", ["adakv", "h2o", "bounded"])
def test_beam_reorder_and_padding_masks_follow_each_row(name):
    """``reorder_cache`` moves every row's entries, statistics and (ragged) counts; ``attend`` with a logical padding
    mask equals a per-head softmax over the unmasked kept entries."""
    knobs = {"adakv": dict(budget=6, window=2), "h2o": dict(budget=6), "bounded": dict(sinks=1, anchors=2, recent=4,
             chunk=2, window=2, alpha=1.0)}[name]
    gen = torch.Generator().manual_seed(13)
    together, alone = make_cache(name, **knobs), [make_cache(name, **knobs) for _ in range(3)]
    for step in range(6):
        length = 20 if step == 0 else 1
        q, k, v = _randn(gen, 3, 4, length, 4), _randn(gen, 3, 2, length, 4), _randn(gen, 3, 2, length, 4)
        _forward(together, q, k, v, attend=False)
        for row, cache in enumerate(alone):
            _forward(cache, q[row : row + 1], k[row : row + 1], v[row : row + 1], attend=False)
    together.reorder_cache(torch.tensor([2, 0]))
    query = _randn(gen, 2, 4, 1, 4)
    mask = torch.rand(2, 1, 1, together.get_seq_length(0), generator=gen) > 0.4
    mask[..., -1] = True
    out = together.attend(query, 0, mask)
    for row, beam in enumerate([2, 0]):
        assert _cache_positions(together, 0)[row] == _cache_positions(alone[beam], 0)[0]
        layer = alone[beam].layers[0]
        positions = _cache_positions(alone[beam], 0)[0]
        keys = [torch.cat([layer.ragged.keys[layer.ragged.counts[0, :h].sum():][: int(layer.ragged.counts[0, h])],
                           layer.keys[0, h]]) if layer.ragged is not None else layer.keys[0, h] for h in range(2)]
        values = [torch.cat([layer.ragged.values[layer.ragged.counts[0, :h].sum():][: int(layer.ragged.counts[0, h])],
                             layer.values[0, h]]) if layer.ragged is not None else layer.values[0, h] for h in range(2)]
        for hq in range(4):
            h = hq // 2
            keep = mask[row, 0, 0, positions[h]]
            weights = (keys[h][keep] @ query[row, hq, 0] / 2.0).softmax(-1)
            torch.testing.assert_close(out[row, hq, 0], weights @ values[h][keep])


# --------------------------------------------------------------------------------------------------------------
# budgets per head and layer
# --------------------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(budget=st.integers(8, 4096), window=st.integers(1, 8), layers=st.integers(1, 40),
       beta=st.sampled_from([1.0, 2.0, 20.0]), prompt=st.one_of(st.none(), st.integers(1, 10000)))
def test_pyramid_budgets_match_reference_and_keep_the_mean(budget, window, layers, beta, prompt):
    got = pyramid_budgets(budget, window, layers, beta, prompt)
    assert got == ref.pyramid_budgets(budget, window, layers, beta, 10**9 if prompt is None else prompt)
    if prompt is None or prompt - window > 2 * (budget - window):
        assert all(a >= b for a, b in zip(got, got[1:], strict=False))  # large at the bottom, small at the top
        assert budget - 1 <= sum(got) / layers <= budget  # the uniform budget's mean, up to rounding


def test_adakv_stores_per_head_budgets_and_saves_real_memory():
    budget, window, prompt, dim = 16, 4, 128, 8
    gen = torch.Generator().manual_seed(5)
    q, k, v = _randn(gen, 2, 8, prompt, dim), _randn(gen, 2, 4, prompt, dim), _randn(gen, 2, 4, prompt, dim)
    k[:, 0] *= 6  # head 0 concentrated (peaked attention), the others dispersed
    cache, snap = make_cache("adakv", budget=budget, window=window), make_cache("snapkv", budget=budget, window=window)
    for c in (cache, snap):
        _forward(c, q, k, v, attend=False)
    lengths = cache.head_lengths(0)
    assert cache.is_ragged(0) and not snap.is_ragged(0)
    assert lengths.sum(-1).tolist() == [4 * budget] * 2  # the layer's total, shared out across heads
    assert bool((lengths >= max(window, math.floor(0.2 * budget))).all()) and len(set(lengths.flatten().tolist())) > 1
    layer = cache.layers[0]
    kv_bytes = 8 * (2 * dim + 1)  # float64 key + value + int64 position per entry
    assert cache.nbytes() == int(lengths.sum()) * kv_bytes + layer.ragged.counts.numel() * 8 + layer.window.numel() * 8
    assert cache.nbytes() == snap.nbytes() + layer.ragged.counts.numel() * 8  # as many entries as SnapKV's, unpadded
    keys, values = layer._readable()
    assert keys.shape == (2, 4, int(lengths.max()), dim) and keys.stride() == (0, 0, 0, 0) and torch.isnan(keys).all()
    with pytest.raises(ValueError, match="ragged"):
        cache.kept_positions(0)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3]), q_len=st.integers(1, 3),
       tail=st.integers(0, 4), masked=st.booleans(), seed=st.integers(0, 2**16))
def test_ragged_attention_matches_per_head_softmax(batch, kv_heads, group, q_len, tail, masked, seed):
    gen = torch.Generator().manual_seed(seed)
    dim = 4
    counts = torch.randint(0, 6, (batch, kv_heads), generator=gen)
    total, tail = int(counts.sum()), tail + q_len
    query = _randn(gen, batch, kv_heads * group, q_len, dim)
    keys, values = _randn(gen, total, dim), _randn(gen, total, dim)
    tail_keys, tail_values = _randn(gen, batch, kv_heads, tail, dim), _randn(gen, batch, kv_heads, tail, dim)
    ragged_allowed = torch.rand(total, q_len, generator=gen) > 0.3 if masked else None
    tail_allowed = torch.rand(batch, kv_heads, q_len, tail, generator=gen) > 0.3 if masked else None
    out = ragged_decode_attention(query, keys, values, counts, tail_keys, tail_values, ragged_allowed=ragged_allowed,
                                  tail_allowed=tail_allowed)
    starts = (counts.flatten().cumsum(0) - counts.flatten()).tolist()
    for b in range(batch):
        for hq in range(kv_heads * group):
            h = hq // group
            seg = slice(starts[b * kv_heads + h], starts[b * kv_heads + h] + int(counts[b, h]))
            for i in range(q_len):
                visible = torch.arange(tail) <= tail - q_len + i
                ragged_ok = torch.ones(seg.stop - seg.start, dtype=torch.bool)
                if masked:
                    visible &= tail_allowed[b, h, i]
                    ragged_ok = ragged_allowed[seg, i]
                k_all = torch.cat([keys[seg][ragged_ok], tail_keys[b, h][visible]])
                v_all = torch.cat([values[seg][ragged_ok], tail_values[b, h][visible]])
                if k_all.shape[0] == 0:
                    assert bool((out[b, hq, i] == 0).all())
                    continue
                weights = (k_all @ query[b, hq, i] / math.sqrt(dim)).softmax(-1)
                torch.testing.assert_close(out[b, hq, i], weights @ v_all)


# --------------------------------------------------------------------------------------------------------------
# memory bounds over 500 generated tokens
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "knobs"), [
    ("streamingllm", dict(budget=24, sinks=4)),
    ("h2o", dict(budget=24, recent=8)),
    ("infokv", dict(budget=16, window=4, compress_every=8)),
    ("bounded", dict(sinks=2, anchors=8, recent=12, chunk=4, window=4)),
    ("latent", dict(budget=16, window=4, delay=2, recompress_every=8)),
])
def test_decode_time_policies_stay_bounded_over_500_tokens(name, knobs):
    cache = make_cache(name, **knobs)
    capacity = {"latent": 16 + 8}.get(name) or cache.policy.capacity()
    gen = torch.Generator().manual_seed(7)
    batch, q_heads, kv_heads, dim, prompt = 1, 4, 2, 8, 100
    entry_bytes = 2 * dim * 4 + 8 + 4 * len(cache.policy.stats)  # keys, values (float32), position, stats
    window_bytes = batch * q_heads * cache.policy.query_window * dim * 4
    for step in range(501):
        length = prompt if step == 0 else 1
        q, k, v = (_randn(gen, batch, q_heads, length, dim, dtype=torch.float32),
                   _randn(gen, batch, kv_heads, length, dim, dtype=torch.float32),
                   _randn(gen, batch, kv_heads, length, dim, dtype=torch.float32))
        signal = torch.rand(batch, length, generator=gen) if cache.policy.needs_signals else None
        cache.update(k, v, 0)
        if step > 0 and name != "latent":
            assert cache.stored_length(0) <= capacity, f"step {step}: {cache.stored_length(0)} > {capacity}"
        cache.observe_queries(q, 0)
        if signal is not None:
            cache.layers[0].record_signal(signal)
        if step > 2:  # the latent cache evicts after `delay` = 2 generated tokens
            assert cache.stored_length(0) <= capacity
            assert cache.nbytes() <= batch * kv_heads * capacity * entry_bytes + window_bytes
    assert cache.get_seq_length(0) == prompt + 500 and cache.layers[0].evictions > 10


def test_bounded_never_exceeds_its_size_and_keeps_sinks_and_recent_chunks():
    policy = BoundedCache(sinks=3, anchors=5, recent=8, chunk=4, window=2, alpha=1.0)
    cache = make_cache(policy)
    gen = torch.Generator().manual_seed(8)
    for step in range(200):
        length = 37 if step == 0 else 1
        q, k, v = _randn(gen, 2, 4, length, 4), _randn(gen, 2, 2, length, 4), _randn(gen, 2, 2, length, 4)
        cache.update(k, v, 0)
        cache.observe_queries(q, 0)
        stored = cache.stored_length(0)
        assert stored <= policy.size == 16
        positions = cache.kept_positions(0)
        start = policy.window_start(cache.get_seq_length(0))
        assert start % 4 == 0
        for row in positions.view(-1, stored).tolist():
            assert row[:3] == [0, 1, 2]  # sinks
            assert [p for p in row if p >= start] == list(range(start, cache.get_seq_length(0)))  # recent, whole
            assert len([p for p in row if 3 <= p < start]) <= 5  # anchors


# --------------------------------------------------------------------------------------------------------------
# signals (InfoKV) and forward influence on a tiny random Llama
# --------------------------------------------------------------------------------------------------------------


def _tiny_llama(layers: int = 2, vocab: int = 300):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                      max_position_embeddings=512, eos_token_id=None, initializer_range=0.2)
    return transformers.LlamaForCausalLM(config).eval()


def test_restricted_entropy_matches_reference():
    gen = torch.Generator().manual_seed(9)
    logits = _randn(gen, 3, 5, 40) * 3
    for top_k in (1, 7, 40, 256):
        torch.testing.assert_close(restricted_entropy(logits, top_k), ref.restricted_entropy(logits, top_k))
    assert bool((restricted_entropy(logits, 1) == 0).all())


def test_infokv_reads_hidden_states_and_logits_of_the_forward_without_rerunning_the_model():
    from flexentropy.integrations.hf import enable

    model = _tiny_llama(layers=3)
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(10))
    hidden, calls = {}, []

    def record(index):
        def hook(module, args, output):
            hidden[index] = output
            calls.append(index)
        return hook

    hooks = [layer.register_forward_hook(record(i)) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        logits = model(ids).logits
    calls.clear()
    enable(model, EntropyConfig(dense_prefix=4096), prefill="dense")
    cache = make_cache("infokv", model=model, budget=64, window=8, top_k=17, tau=0.5)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    for hook in hooks:
        hook.remove()
    assert calls == [0, 1, 2]  # one pass of every decoder layer: nothing recomputed
    entropy = ref.restricted_entropy(logits, 17)
    for layer_idx in range(3):
        want = ref.entropy_signal(hidden[layer_idx], hidden[2], entropy, 0.5)
        got = cache.layers[layer_idx].stats["signal"]                        # [B, Hkv, 40], no eviction yet
        torch.testing.assert_close(got.double(), want[:, None].expand_as(got), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.layers[2].stats["signal"].double(), 0.5 * entropy[:, None].expand(2, 2, 40),
                               rtol=1e-4, atol=1e-4)  # last layer: D = tau


def test_infokv_without_the_model_says_how_to_attach_it():
    cache = make_cache("infokv", budget=4, window=2)
    gen = torch.Generator().manual_seed(11)
    _forward(cache, _randn(gen, 1, 2, 6, 4), _randn(gen, 1, 1, 6, 4), _randn(gen, 1, 1, 6, 4))
    with pytest.raises(RuntimeError, match=r"fe.enable\(model\)"):
        cache.update(_randn(gen, 1, 1, 1, 4), _randn(gen, 1, 1, 1, 4), 0)


def test_query_scoring_policies_without_hand_over_raise():
    cache = make_cache("snapkv", budget=4, window=2)
    cache.update(torch.zeros(1, 1, 6, 4), torch.zeros(1, 1, 6, 4), 0)
    with pytest.raises(RuntimeError, match=r"call cache.observe_queries\(query_states, layer_idx\)"):
        cache.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), 0)


def test_forward_influence_matches_brute_force_reference():
    model = _tiny_llama().double()
    ids = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(12))
    positions = [0, 3, 11, 21]
    widths: list[int] = []  # the context's prefill needs its cache only, not its [1, N, V] logits
    handle = model.get_output_embeddings().register_forward_hook(lambda _m, _a, out: widths.append(out.shape[1]))
    try:
        got = forward_influence(model, ids, positions, horizon=8, batch_size=3)
    finally:
        handle.remove()
    assert widths[0] == 1 and set(widths[1:]) == {8}
    want = ref.forward_influence(model, ids, positions, horizon=8)
    assert got.shape == (4,) and bool((got > 0).all())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-9)
    with pytest.raises(ValueError, match=r"positions must lie in the cached context \[0, 22\)"):
        forward_influence(model, ids, [22], horizon=8)
    with pytest.raises(ValueError, match="horizon must be an int"):
        forward_influence(model, ids, [0], horizon=30)
