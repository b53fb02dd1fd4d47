"""Latent KV-cache eviction (design.md §2, paper Alg. 4): flexentropy.caches against the dense oracle
reference/cache.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from flexentropy.caches import LatentKVCache
from flexentropy.caches.keywords import cache_argument
from flexentropy.config import EntropyConfig
from flexentropy.kv import (
    decode_attention,
    gather_kv,
    keep_indices,
    pool_scores,
    spread_forward,
    window_attention_scores,
)
from reference import cache as ref

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=dtype)


def _token(gen: torch.Generator, batch: int, q_heads: int, kv_heads: int, dim: int, q_len: int = 1, dtype=F64):
    """Random post-RoPE ``(q, k, v)`` of ``q_len`` tokens."""
    return (_randn(gen, batch, q_heads, q_len, dim, dtype=dtype), _randn(gen, batch, kv_heads, q_len, dim, dtype=dtype),
            _randn(gen, batch, kv_heads, q_len, dim, dtype=dtype))


def _step(cache: LatentKVCache, q, k, v, layer_idx: int = 0, hand_over: str = "before"):
    """One forward of a plain attention module over the cache: hand-over, update, attention."""
    if hand_over == "before":
        cache.observe_queries(q, layer_idx)
    keys, values = cache.update(k, v, layer_idx)
    if hand_over == "after":
        cache.observe_queries(q, layer_idx)
    return keys, values, decode_attention(q, keys, values)


def _dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Float64 attention of the last ``L`` tokens over all ``T`` entries, bottom-right causal, per query head."""
    batch, q_heads, q_len, dim = q.shape
    group, length = q_heads // keys.shape[1], keys.shape[2]
    out = torch.empty(batch, q_heads, q_len, values.shape[-1], dtype=F64)
    for hq in range(q_heads):
        for i in range(q_len):
            visible = length - q_len + i + 1
            logits = keys[:, hq // group, :visible].double() @ q[:, hq, i].double().unsqueeze(-1) / math.sqrt(dim)
            out[:, hq, i] = (logits.softmax(dim=1) * values[:, hq // group, :visible].double()).sum(dim=1)
    return out


# --------------------------------------------------------------------------------------------------------------
# score -> keep -> gather, function by function against the oracle
# --------------------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 2), group=st.sampled_from([1, 2, 3, 4]),
       window=st.integers(1, 5), extra=st.integers(0, 20), dim=st.sampled_from([1, 4, 8]),
       kind=st.sampled_from(["softmax", "raw"]), evicted=st.booleans(), masked=st.booleans(),
       group_mode=st.sampled_from(["mean", "max"]), seed=st.integers(0, 2**16))
def test_window_scores_match_reference(batch, kv_heads, group, window, extra, dim, kind, evicted, masked, group_mode,
                                       seed):
    gen = torch.Generator().manual_seed(seed)
    length = window + extra
    q = _randn(gen, batch, kv_heads * group, window, dim)
    k = _randn(gen, batch, kv_heads, length, dim)
    if evicted:  # after an eviction: every head holds its own increasing positions, the window's last
        gaps = torch.randint(1, 4, (batch, kv_heads, length), generator=gen)
        key_positions = gaps.cumsum(-1)
        query_positions = key_positions[0, 0, -window:].clone()
        key_positions[..., -window:] = query_positions
    else:
        key_positions = torch.arange(length)
        query_positions = torch.arange(length - window, length)
    key_mask = torch.rand(batch, kv_heads, length, generator=gen) > 0.4 if masked else None  # e.g. left padding
    got = window_attention_scores(q, k, query_positions=query_positions, key_positions=key_positions, kind=kind,
                                  key_mask=key_mask, group_mode=group_mode)
    want = ref.window_attention_scores(q, k, query_positions, key_positions, kind, key_mask=key_mask,
                                       group_mode=group_mode)
    assert got.shape == (batch, kv_heads, length) and got.dtype == F64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    if masked:
        assert (got[~key_mask] == 0).all()  # a hidden key gets nothing
    elif kind == "softmax" and group_mode == "mean":  # mean of probability rows: the scores of a head sum to 1
        torch.testing.assert_close(got.sum(-1), torch.ones(batch, kv_heads, dtype=F64))


def test_group_max_is_the_best_query_heads_view():
    """``group_mode="max"``: with one query head per KV head it is the mean; with several, a key one head reads alone
    keeps that head's score, where the mean divides it by the group (here 4 heads, one of which reads key 3)."""
    gen = torch.Generator().manual_seed(3)
    q, k = _randn(gen, 1, 2, 3, 4), _randn(gen, 1, 2, 9, 4)
    positions = dict(query_positions=torch.arange(6, 9), key_positions=torch.arange(9))
    torch.testing.assert_close(window_attention_scores(q, k, **positions, group_mode="max"),
                               window_attention_scores(q, k, **positions))
    keys = torch.eye(9, dtype=F64)[None, None, :, :]                                  # [1, 1, 9, 9]: key j = e_j
    reader = 30 * torch.eye(9, dtype=F64)[3]                                          # attends key 3 only
    others = 30 * torch.eye(9, dtype=F64)[5]
    q = torch.stack([reader, others, others, others])[None, :, None, :]               # [1, 4, 1, 9]
    positions = dict(query_positions=torch.tensor([8]), key_positions=torch.arange(9), scale=1.0)
    mean = window_attention_scores(q, keys, **positions)[0, 0]
    best = window_attention_scores(q, keys, **positions, group_mode="max")[0, 0]
    torch.testing.assert_close(best[3], torch.tensor(1.0, dtype=F64), atol=1e-9, rtol=0)
    torch.testing.assert_close(mean[3], torch.tensor(0.25, dtype=F64), atol=1e-9, rtol=0)
    assert mean[5] > mean[3] and torch.isclose(best[5], best[3])


def test_window_scores_float32_for_bf16_inputs():
    gen = torch.Generator().manual_seed(0)
    q, k = _randn(gen, 1, 4, 3, 8, dtype=torch.bfloat16), _randn(gen, 1, 2, 10, 8, dtype=torch.bfloat16)
    got = window_attention_scores(q, k, query_positions=torch.arange(7, 10), key_positions=torch.arange(10))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref.window_attention_scores(q, k, torch.arange(7, 10), torch.arange(10)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compiled_window_scores_match_reference():
    """The compiled scoring pass (what CUDA runs) on the CPU: the reference's scores over evicted positions, hidden
    keys, a query that sees nothing and both group modes, and one graph for every number of keys, rows and window
    queries."""
    from torch._dynamo.utils import get_compilation_metrics

    from flexentropy.kv.scoring import softmax_scores, window_logits

    gen = torch.Generator().manual_seed(5)
    graphs = None
    for rows, window, length in ((2, 4, 40), (3, 3, 77), (2, 6, 130)):
        q = _randn(gen, rows, 8, window, 16, dtype=torch.float32)
        k = _randn(gen, rows, 2, length, 16, dtype=torch.float32)
        key_positions = torch.randint(1, 4, (rows, 2, length), generator=gen).cumsum(-1)
        query_positions = key_positions[0, 0, -window:].clone()
        query_positions[0] = 0                                         # sees no key: adds nothing
        hidden = torch.rand(rows, 2, length, generator=gen) > 0.2
        logits = window_logits(q.reshape(rows * 2, 4 * window, 16), k.flatten(0, 1), torch.float32).view(
            rows * 2, 4, window, length)
        for mode in ("mean", "max"):
            got = softmax_scores(logits, key_positions.flatten(0, 1), query_positions, hidden.flatten(0, 1), 0.25,
                                 mode, compiled=True)
            want = ref.window_attention_scores(q, k, query_positions, key_positions, scale=0.25, key_mask=hidden,
                                               group_mode=mode)
            torch.testing.assert_close(got.view(rows, 2, length).double(), want, rtol=1e-5, atol=1e-6)
        count = len(get_compilation_metrics())
        assert graphs is None or count == graphs, "a new number of keys, rows or queries compiled a new graph"
        graphs = count


@settings(max_examples=30, deadline=None)
@given(width=st.sampled_from([1, 3, 5, 7]), length=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_pool_scores_match_reference(width, length, seed):
    scores = _randn(torch.Generator().manual_seed(seed), 2, 3, length)
    pooled = pool_scores(scores, width)
    torch.testing.assert_close(pooled, ref.pool_scores(scores, width), rtol=1e-12, atol=1e-12)
    if width == 1:
        assert pooled is scores


@settings(max_examples=30, deadline=None)
@given(span=st.integers(0, 20), length=st.integers(1, 20), raw=st.booleans(), seed=st.integers(0, 2**16))
def test_spread_forward_matches_reference(span, length, raw, seed):
    """Each entry scores the max of itself and the ``span`` entries before it (negative raw scores included)."""
    scores = _randn(torch.Generator().manual_seed(seed), 2, 3, length)
    scores = scores if raw else scores.abs()
    spread = spread_forward(scores, span)
    torch.testing.assert_close(spread, ref.spread_forward(scores, span), rtol=0, atol=0, check_dtype=False)
    if span == 0:
        assert spread is scores


def test_a_span_past_the_scores_costs_their_length_and_a_huge_decode_span_is_refused():
    """A span of ``T - 1`` or more is a running max: 10**12 gives that result at the scores' cost (it once padded by
    the span, 24 TB here), and `EntropyConfig` names the range of ``decode_span`` (10**9 was accepted)."""
    scores = _randn(torch.Generator().manual_seed(0), 2, 3, 20)
    running_max = scores.cummax(dim=-1).values
    for span in (19, 20, 10**12):
        torch.testing.assert_close(spread_forward(scores, span), running_max, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"EntropyConfig.decode_span must be in \[0, 16777216\], got 1000000000"):
        EntropyConfig(decode_span=10**9)
    assert EntropyConfig(decode_span=2**24).decode_span == 2**24


@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 30), budget=st.integers(1, 35), forced=st.integers(0, 30), as_mask=st.booleans(),
       ties=st.booleans(), infinite=st.booleans(), seed=st.integers(0, 2**16))
def test_keep_indices_match_reference(length, budget, forced, as_mask, ties, infinite, seed):
    gen = torch.Generator().manual_seed(seed)
    forced = min(forced, length, budget)
    # Integer-valued scores make many exact ties: both sides must break them towards the lower index.
    scores = torch.randint(0, 3, (2, 3, length), generator=gen).double() if ties else _randn(gen, 2, 3, length)
    if infinite:   # padding ranks at -inf; an overflowing score at +inf must not push out a forced entry
        scores[torch.rand(scores.shape, generator=gen) < 0.3] = float("-inf")
        scores[torch.rand(scores.shape, generator=gen) < 0.3] = float("inf")
    if as_mask:
        mask = torch.zeros(2, 3, length, dtype=torch.bool)
        for row in mask.view(-1, length):
            row[torch.randperm(length, generator=gen)[:forced]] = True
    else:
        mask = (torch.arange(length) >= length - forced).expand(2, 3, length)
    got = keep_indices(scores, budget, mask if as_mask else forced)
    assert got.dtype == torch.long and got.shape == (2, 3, min(budget, length))
    assert torch.equal(got, ref.keep_indices(scores, budget, mask))
    assert bool((got.diff(dim=-1) > 0).all())  # original order, no duplicates
    assert bool(mask.gather(-1, got).sum(-1).eq(mask.sum(-1)).all())  # every forced entry kept


def test_gather_kv_gathers_per_head():
    keys = torch.arange(2 * 3 * 5 * 2, dtype=F64).view(2, 3, 5, 2)
    values = -keys[..., :1]
    indices = torch.tensor([[0, 4], [1, 2], [3, 4]]).expand(2, 3, 2)
    kept = gather_kv(keys, values, indices, torch.arange(10, 15))
    assert kept.keys.shape == (2, 3, 2, 2) and kept.values.shape == (2, 3, 2, 1)
    assert kept.keys[1, 2].tolist() == keys[1, 2, [3, 4]].tolist()
    assert kept.values[0, 1, :, 0].tolist() == [-keys[0, 1, 1, 0].item(), -keys[0, 1, 2, 0].item()]
    assert kept.positions[0].tolist() == [[10, 14], [11, 12], [13, 14]]
    assert gather_kv(keys, values, indices).positions is None


# --------------------------------------------------------------------------------------------------------------
# The whole cache against the oracle, step by step
# --------------------------------------------------------------------------------------------------------------


@st.composite
def _schedules(draw) -> dict:
    window = draw(st.integers(1, 6))
    budget = draw(st.integers(window, 16))
    return dict(
        batch=draw(st.integers(1, 2)), kv_heads=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2, 3, 4])),
        dim=draw(st.sampled_from([2, 4])), prompt=draw(st.integers(1, 30)), steps=draw(st.integers(1, 25)),
        hand_over=draw(st.sampled_from(["before", "after"])), seed=draw(st.integers(0, 2**16)),
        turn=draw(st.integers(1, 25)), turn_length=draw(st.integers(2, 5)),
        config=EntropyConfig(
            decode_budget=budget, decode_window=window, decode_delay=draw(st.integers(0, 4)),
            decode_pool=draw(st.sampled_from([1, 3, 5])), decode_score=draw(st.sampled_from(["softmax", "raw"])),
            decode_span=draw(st.sampled_from([0, 2, 16])), recompress_every=draw(st.sampled_from([None, 1, 4])),
            decode_group=draw(st.sampled_from(["mean", "max"])),
        ),
    )


@settings(max_examples=50, deadline=None)
@given(case=_schedules())
def test_cache_matches_oracle(case):
    """Kept entries, compressed keys/values and positions equal the dense twin's at every step (both score kinds,
    pooling on and off, GQA 1-4, batch rows, both hand-over orders, recompression, and a later turn: one step of
    several tokens after decoding began)."""
    config, hand_over = case["config"], case["hand_over"]
    batch, kv_heads, dim = case["batch"], case["kv_heads"], case["dim"]
    gen = torch.Generator().manual_seed(case["seed"])
    cache, oracle = LatentKVCache(config), ref.LatentCacheOracle(config)
    seen = 0
    for step in range(case["steps"] + 1):
        length = case["prompt"] if step == 0 else case["turn_length"] if step == case["turn"] else 1
        q, k, v = _token(gen, batch, kv_heads * case["group"], kv_heads, dim, length)
        seen += length
        mask_sizes = cache.get_mask_sizes(k.shape[2], 0)
        keys, values, _ = _step(cache, q, k, v, hand_over=hand_over)
        want_keys, want_values = oracle.step(q, k, v, hand_over)
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
        assert torch.equal(cache.kept_positions(0), oracle.positions)
        assert cache.get_seq_length() == oracle.seen == seen
        assert mask_sizes == (keys.shape[2], cache.get_seq_length() - keys.shape[2])
    assert cache.layers[0].evictions == len(oracle.evictions)
    event(f"evictions: {min(len(oracle.evictions), 2)}{'+' if len(oracle.evictions) >= 2 else ''}")


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4]),
       prompt=st.integers(1, 24), steps=st.integers(1, 20), chunk=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_within_budget_decoding_is_dense(batch, kv_heads, group, prompt, steps, chunk, seed):
    """``decode_budget >= N + generated``: the cache never evicts and decoding equals an uncompressed cache."""
    config = EntropyConfig(decode_budget=prompt + steps * chunk, decode_window=1, decode_delay=1)
    gen = torch.Generator().manual_seed(seed)
    cache, dense_k, dense_v = LatentKVCache(config), None, None
    for step in range(steps + 1):
        q, k, v = _token(gen, batch, kv_heads * group, kv_heads, 4, prompt if step == 0 else chunk, dtype=torch.float32)
        _, _, out = _step(cache, q, k, v)
        dense_k = k if dense_k is None else torch.cat([dense_k, k], dim=2)
        dense_v = v if dense_v is None else torch.cat([dense_v, v], dim=2)
        assert torch.equal(out, decode_attention(q, dense_k, dense_v))
        torch.testing.assert_close(out.double(), _dense_attention(q, dense_k, dense_v), rtol=1e-5, atol=1e-5)
    assert cache.layers[0].evictions == 0 and cache.stored_length() == cache.get_seq_length() == dense_k.shape[2]


# --------------------------------------------------------------------------------------------------------------
# Properties: budget, window, memory, batch rows, recompression, short prompts
# --------------------------------------------------------------------------------------------------------------


def test_eviction_keeps_budget_and_window_and_frees_memory():
    budget, window, delay, prompt, dim = 16, 4, 3, 64, 8
    config = EntropyConfig(decode_budget=budget, decode_window=window, decode_delay=delay)
    batch, q_heads, kv_heads = 2, 4, 2
    gen = torch.Generator().manual_seed(1)
    cache = LatentKVCache(config)
    _step(cache, *_token(gen, batch, q_heads, kv_heads, dim, prompt, dtype=torch.float32))
    for _ in range(delay):
        _step(cache, *_token(gen, batch, q_heads, kv_heads, dim, dtype=torch.float32))
    full = prompt + delay
    window_bytes = batch * q_heads * window * dim * 4
    assert cache.stored_length() == full and cache.layers[0].evictions == 0
    assert cache.nbytes() == batch * kv_heads * full * 2 * dim * 4 + window_bytes
    for extra in range(1, 6):  # the first step after `delay` generated tokens evicts, then appends
        keys, _, _ = _step(cache, *_token(gen, batch, q_heads, kv_heads, dim, dtype=torch.float32))
        stored = budget + extra
        assert keys.shape == (batch, kv_heads, stored, dim) and cache.stored_length() == stored
        assert cache.layers[0].evictions == 1
        assert cache.get_seq_length() == full + extra  # logical length: the next RoPE position
        positions = cache.kept_positions()
        assert positions.shape == (batch, kv_heads, stored) and bool((positions.diff(dim=-1) > 0).all())
        last = torch.arange(full + extra - window, full + extra)  # the window's own entries are all there
        assert all(bool(torch.isin(last, row).all()) for row in positions.view(-1, stored))
        assert cache.nbytes() == batch * kv_heads * (stored * 2 * dim * 4 + budget * 8) + window_bytes  # + kept pos.
    assert cache.get_mask_sizes(1, 0) == (budget + 6, full + 5 - (budget + 5))


def test_batch_rows_choose_their_own_entries():
    config = EntropyConfig(decode_budget=8, decode_window=3, decode_delay=2, recompress_every=3)
    gen = torch.Generator().manual_seed(2)
    tokens = [_token(gen, 3, 4, 2, 4, 30 if step == 0 else 1) for step in range(12)]
    together = LatentKVCache(config)
    alone = [LatentKVCache(config) for _ in range(3)]
    for q, k, v in tokens:
        _step(together, q, k, v)
        for row, cache in enumerate(alone):
            _step(cache, q[row : row + 1], k[row : row + 1], v[row : row + 1])
    positions = together.kept_positions()
    for row, cache in enumerate(alone):
        assert torch.equal(positions[row : row + 1], cache.kept_positions())
        assert torch.equal(together.layers[0].keys[row : row + 1], cache.layers[0].keys)
    assert not torch.equal(positions[0], positions[1]) or not torch.equal(positions[1], positions[2])
    together.reorder_cache(torch.tensor([2, 0]))  # beam search: rows follow their beams
    assert torch.equal(together.kept_positions(), positions[[2, 0]])
    assert torch.equal(together.layers[0].window, torch.cat([alone[2].layers[0].window, alone[0].layers[0].window]))
    together.reset()
    assert together.get_seq_length() == together.stored_length() == together.nbytes() == 0


def test_recompression_bounds_500_generated_tokens():
    budget, every = 16, 8
    config = EntropyConfig(decode_budget=budget, decode_window=4, decode_delay=2, recompress_every=every)
    gen = torch.Generator().manual_seed(3)
    cache = LatentKVCache(config)
    for layer in range(2):
        _step(cache, *_token(gen, 1, 4, 2, 8, 100, dtype=torch.float32), layer_idx=layer)
    for step in range(1, 501):
        for layer in range(2):
            keys, _, out = _step(cache, *_token(gen, 1, 4, 2, 8, dtype=torch.float32), layer_idx=layer)
            assert out.shape == (1, 4, 1, 8) and (step <= 2 or keys.shape[2] <= budget + every)
            positions = cache.kept_positions(layer)
            assert bool((positions.diff(dim=-1) > 0).all())
            assert bool(torch.isin(torch.arange(100 + step - 4, 100 + step), positions).all())
    assert cache.get_seq_length(1) == 600 and cache.stored_length(1) <= budget + every
    # First eviction at generated == 2, then every `every` appended tokens.
    assert [layer.evictions for layer in cache.layers] == [1 + (500 - 2 - 1) // every] * 2


@pytest.mark.parametrize("recompress_every", [None, 4])
def test_short_prompt_within_budget_is_left_alone(recompress_every):
    config = EntropyConfig(decode_budget=12, decode_window=2, decode_delay=1, recompress_every=recompress_every)
    gen = torch.Generator().manual_seed(4)
    cache = LatentKVCache(config)
    _step(cache, *_token(gen, 1, 2, 1, 4, 5))
    for _ in range(20):
        _step(cache, *_token(gen, 1, 2, 1, 4))
    # Checked once at decode_delay (5 + 1 <= 12 stored: nothing); after that only `recompress_every` evicts.
    # With recompress_every=4: evictions when 16 are stored (steps 11, 15, 19), each leaving 12, plus appends.
    assert cache.stored_length() == (25 if recompress_every is None else 13)
    assert cache.get_seq_length() == 25


def test_decode_attention_matches_dense_math():
    gen = torch.Generator().manual_seed(5)
    for q_len, group in ((1, 1), (1, 4), (3, 3), (5, 2)):
        q, k, v = _randn(gen, 2, 2 * group, q_len, 8), _randn(gen, 2, 2, 11, 8), _randn(gen, 2, 2, 11, 6)
        torch.testing.assert_close(decode_attention(q, k, v), _dense_attention(q, k, v))


# --------------------------------------------------------------------------------------------------------------
# Bad input: clear errors naming what was expected
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "message"), [
    (dict(decode_budget=8, decode_window=16), r"decode_budget \(8\) must be >= decode_window \(16\)"),
    (dict(decode_window=0), r"decode_window must be in \[1, 16777216\], got 0"),
    (dict(decode_delay=-1), r"decode_delay must be in \[0, 16777216\], got -1"),
])
def test_bad_config(changes, message):
    with pytest.raises(ValueError, match=message):
        LatentKVCache(EntropyConfig(**changes))


def test_config_must_be_an_entropy_config():
    with pytest.raises(TypeError, match="config must be an EntropyConfig"):
        LatentKVCache({"decode_budget": 8})


def _primed(q_heads: int = 4, kv_heads: int = 2, dim: int = 8) -> LatentKVCache:
    cache = LatentKVCache(EntropyConfig(decode_budget=4, decode_window=2, decode_delay=1))
    gen = torch.Generator().manual_seed(6)
    _step(cache, *_token(gen, 1, q_heads, kv_heads, dim, 6))
    return cache


@pytest.mark.parametrize(("call", "message"), [
    (lambda c: c.update(torch.zeros(1, 3, 2, 8), torch.zeros(1, 3, 2, 8), 1),
     r"update\(layer_idx=1\).*expected kv_heads 2 \(as in update\(layer_idx=0\)"),
    (lambda c: c.update(torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 2, 16), 1), "expected head_dim 8"),
    (lambda c: c.update(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 4), 1), "expected value_dim 8"),
    (lambda c: c.update(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 3, 8), 1), r"expected value_states \[B, Hkv"),
    (lambda c: c.update(torch.zeros(2, 8), torch.zeros(2, 8), 1), r"key_states \[B, Hkv, q_len >= 1, D\]"),
    (lambda c: c.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), -1), "layer_idx must be an int >= 0"),
    (lambda c: c.observe_queries(torch.zeros(4, 1, 8), 0), r"query_states \[B, Hq, q_len >= 1, D\]"),
    (lambda c: c.observe_queries(torch.zeros(1, 6, 1, 8), 0), "expected query_heads 4"),
    (lambda c: c.observe_queries(torch.zeros(1, 4, 1, 16), 0), "expected head_dim 8"),
    (lambda c: c.observe_queries(torch.zeros(2, 4, 1, 8), 0), "expected batch_size 1"),
])
def test_mismatched_shapes(call, message):
    with pytest.raises(ValueError, match=message):
        call(_primed())


def test_query_heads_must_group_kv_heads():
    cache = LatentKVCache()
    cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 0)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of KV heads \(2\)"):
        cache.observe_queries(torch.zeros(1, 3, 3, 8), 0)


def test_hand_over_of_the_wrong_length():
    cache = _primed()
    cache.observe_queries(torch.zeros(1, 4, 2, 8), 0)
    with pytest.raises(ValueError, match=r"q_len=1.*same q_len as update\(\)'s key_states"):
        cache.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), 0)


def test_a_cache_without_hand_over_fails_at_the_first_forward():
    """Used without fe.enable, the cache once failed only when an eviction was due (16 tokens in)."""
    cache = LatentKVCache(EntropyConfig(decode_budget=4, decode_window=2, decode_delay=1))
    cache.update(torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8), 0)     # layer 0 of the prompt, no queries
    with pytest.raises(RuntimeError, match=r"layer 0 \(latent\).*none were handed over: call flexentropy.enable"):
        cache.update(torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8), 1)  # layer 1 of the same forward
    single = LatentKVCache(EntropyConfig(decode_budget=4, decode_window=2, decode_delay=1))
    single.update(torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8), 0)    # a one-layer model: at its next forward
    with pytest.raises(RuntimeError, match=r"call flexentropy.enable\(model\)"):
        single.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), 0)


@pytest.mark.parametrize("recompress_every", [32, None])
def test_the_default_budget_bounds_memory_over_1100_tokens(recompress_every):
    """decode_budget reads as a bound: by default (recompress_every=32) no head ever holds more than budget + 32
    entries; recompress_every=None is the paper's single eviction, after which the cache grows."""
    config = EntropyConfig(decode_budget=64, decode_window=8, decode_delay=4, recompress_every=recompress_every)
    gen = torch.Generator().manual_seed(11)
    cache = LatentKVCache(config)
    _step(cache, *_token(gen, 1, 4, 2, 8, 300, dtype=torch.float32))
    most = 0  # entries held after the first eviction (before it, the prompt and `decode_delay` tokens)
    for step in range(1, 1101):
        _step(cache, *_token(gen, 1, 4, 2, 8, dtype=torch.float32))
        most = max(most, cache.stored_length()) if step > 4 else 0
    assert cache.get_seq_length() == 1400
    if recompress_every is None:
        assert cache.stored_length() == 64 + 1100 - 4 and cache.layers[0].evictions == 1
    else:
        assert most == 64 + 32 and cache.layers[0].evictions == 1 + (1100 - 4 - 1) // 32


@pytest.mark.parametrize(("call", "message"), [
    (lambda: keep_indices(torch.zeros(1, 1, 5), 2, 3), "3 forced entries in one head exceed the budget of 2"),
    (lambda: keep_indices(torch.zeros(1, 5), 2), r"scores must be \[B, Hkv, T\]"),
    (lambda: pool_scores(torch.zeros(1, 1, 5), 4), "width must be an odd int >= 1"),
    (lambda: window_attention_scores(torch.zeros(1, 3, 2, 4), torch.zeros(1, 2, 5, 4), query_positions=torch.arange(2),
                                     key_positions=torch.arange(5)), r"query heads \(3\) must be a positive multiple"),
    (lambda: window_attention_scores(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 5, 4), query_positions=torch.arange(3),
                                     key_positions=torch.arange(5)), r"query_positions must have shape \[2\]"),
    (lambda: decode_attention(torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8)),
     "3 queries but only 2 cache entries"),
    (lambda: decode_attention(torch.zeros(1, 4, 1, 8), torch.zeros(1, 3, 2, 8), torch.zeros(1, 3, 2, 8)),
     r"query heads \(4\) must be a positive multiple of key/value heads \(3\)"),
])
def test_bad_machinery_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(("scale", "error", "message"), [
    *[(scale, ValueError, "a finite number > 0") for scale in (0.0, -0.0, -0.125, math.nan, math.inf)],
    (True, TypeError, "a number, got bool True"),
])
def test_decode_attention_refuses_a_scale_sparse_prefill_refuses(scale: object, error: type, message: str) -> None:
    """Issue 69: ``decode_attention(scale=0)`` gave the plain mean of the values, NaN an all-NaN output, and negative
    and bool scales went through; it refuses them as `sparse_prefill_attention` does."""
    query, keys, values = _token(torch.Generator().manual_seed(0), 1, 4, 2, 8, q_len=3)
    with pytest.raises(error, match=f"decode_attention.scale must be {message}"):
        decode_attention(query, keys, values, scale=scale)


@pytest.mark.parametrize(("change", "error", "message"), [
    (lambda q, k, v: (q.long(), k.long(), v.long()), TypeError,
     r"query must be a floating tensor \(float16/bfloat16/float32/float64\), got torch.int64"),
    (lambda q, k, v: (q, k, v.to(torch.complex64)), TypeError,
     "values must be a floating tensor .* got torch.complex64"),
    (lambda q, k, v: (q.tolist(), k, v), TypeError, "query must be a torch.Tensor, got list"),
    (lambda q, k, v: (q, k.float(), v), TypeError, r"keys.dtype \(torch.float32\) must equal query.dtype"),
    (lambda q, k, v: (q, k, v.to("meta")), ValueError, "values is on meta but query is on cpu; put them on one device"),
    (lambda q, k, v: (q[0], k, v), ValueError, r"query must be 4-D \[batch, heads, seq_len, head_dim\]"),
])
def test_decode_attention_refuses_what_sdpa_cannot_take(change, error: type, message: str) -> None:
    """Issue 77: int64 tensors got SDPA's "cannot be converted to type int64_t without overflow", complex ones its
    softmax's NotImplementedError, a list an AttributeError: each is refused at the boundary, as
    `sparse_prefill_attention` refuses it."""
    query, keys, values = change(*_token(torch.Generator().manual_seed(0), 1, 4, 2, 8, q_len=3))
    with pytest.raises(error, match=message):
        decode_attention(query, keys, values)


# --------------------------------------------------------------------------------------------------------------
# As ``past_key_values`` of a transformers 5.x model's generate
# --------------------------------------------------------------------------------------------------------------


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=256, eos_token_id=None)
    return transformers.LlamaForCausalLM(config).eval()


def _hand_over_hooks(model) -> list:
    """Stand-in for flexentropy's HF integration (HF's own attention does not hand queries over): a pre-hook on each
    attention module recomputes its post-RoPE queries and hands them to the cache before the module's update()."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    def hook(module, args, kwargs):
        hidden, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
        q = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim).transpose(1, 2)
        cache_argument(kwargs).observe_queries(apply_rotary_pos_emb(q, q, cos, sin)[0], module.layer_idx)

    return [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]


def test_generate_within_budget_equals_dynamic_cache():
    from transformers import DynamicCache

    model = _tiny_llama()
    prompt = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(7))
    cache = LatentKVCache(EntropyConfig(decode_budget=64, decode_window=8, decode_delay=4))
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=30, do_sample=False, past_key_values=DynamicCache())
    hooks = _hand_over_hooks(model)
    try:
        with torch.no_grad():
            got = model.generate(prompt, max_new_tokens=30, do_sample=False, past_key_values=cache)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(got, want) and got.shape == (2, 54)
    assert cache.get_seq_length() == cache.stored_length(1) == 53 and len(cache) == 2


def test_generate_with_eviction_stays_bounded():
    model = _tiny_llama()
    prompt = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(8))
    config = EntropyConfig(decode_budget=16, decode_window=8, decode_delay=4, recompress_every=8)
    hooks = _hand_over_hooks(model)
    try:
        for implementation in ("sdpa", "eager"):  # eager builds its masks from get_mask_sizes
            model.set_attn_implementation(implementation)
            cache = LatentKVCache(config)
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=40, do_sample=False, past_key_values=cache)
            assert out.shape == (2, 88) and cache.get_seq_length() == 87
            assert all(layer.evictions == 1 + (39 - 4 - 1) // 8 for layer in cache.layers)
            assert all(cache.stored_length(i) <= 16 + 8 for i in range(2))
            assert bool(torch.isin(torch.arange(87 - 7, 87), cache.kept_positions(1)[1, 0]).all())
    finally:
        for hook in hooks:
            hook.remove()


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
       capacity=st.integers(1, 40), data=st.data())
def test_prefix_masked_decode_matches_reference(batch: int, kv_heads: int, group: int, capacity: int,
                                                data: st.DataObject) -> None:
    """The static step's SDPA path under a prefix mask (the mask `flash_decode`'s lengths stand for) against the
    reference over each row's first ``lengths[b]`` entries; on CUDA, `flash_decode` is checked against the same
    reference (tests/test_static_latent.py)."""
    from flexentropy.kv.decode_attention import grouped_attention

    lengths = torch.tensor(data.draw(st.lists(st.integers(1, capacity), min_size=batch, max_size=batch)))
    gen = torch.Generator().manual_seed(capacity)
    query = torch.randn(batch, kv_heads * group, 1, 8, generator=gen)
    keys, values = (torch.randn(batch, kv_heads, capacity, 8, generator=gen) for _ in range(2))
    prefix = (torch.arange(capacity) < lengths[:, None, None, None]).expand(batch, kv_heads, 1, capacity)
    got = grouped_attention(query, keys, values, prefix, None).double()
    torch.testing.assert_close(got, ref.prefix_decode_attention(query, keys, values, lengths), atol=1e-5, rtol=1e-5)

