"""Small, hand-checkable tests of the dense reference oracle itself (reference/prefill.py, design.md §1)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flexentropy.config import EntropyConfig
from reference import (
    allocate_budgets,
    masked_attention,
    observation_attention,
    rigid_heads,
    segment_entropy,
    segment_representatives,
    select_blocks,
    sparse_prefill_attention,
)


def _softmax(xs: list[float]) -> list[float]:
    exps = [math.exp(x) for x in xs]
    return [e / sum(exps) for e in exps]


def _col(values: list[float]) -> torch.Tensor:
    """A ``[1, 1, N, 1]`` tensor (D = 1) from a list of token values."""
    return torch.tensor(values, dtype=torch.float64).view(1, 1, -1, 1)


def test_segment_representatives_partial_chunk():
    x = torch.tensor([[1.0, -1.0], [3.0, 0.0], [2.0, 5.0], [-4.0, 2.0], [7.0, -7.0]]).view(1, 1, 5, 2)
    xmax, xmin = segment_representatives(x, 2)
    assert xmax.shape == (1, 1, 3, 2)
    assert xmax[0, 0].tolist() == [[3.0, 0.0], [2.0, 5.0], [7.0, -7.0]]
    assert xmin[0, 0].tolist() == [[1.0, -1.0], [-4.0, 2.0], [7.0, -7.0]]


# Two segments of 4 tokens, key blocks of 2 tokens, D = 1.
#   keys  [0, 1 | 2, 0 | ...]: Kmax = [1, 2], Kmin = [0, 0] for the candidate blocks 0 and 1 of segment 1;
#   queries of segment 1 [3, -1, 0, 0]: Qmax = 3, Qmin = -1.
# S1 = 3 * [1, 2] = [3, 6], S2 = 3 * [0, 0] = [0, 0], S3 = -[1, 2] = [-1, -2], S4 = -[0, 0] = [0, 0].
_Q_HAND = [0.0, 0.0, 0.0, 0.0, 3.0, -1.0, 0.0, 0.0]
_K_HAND = [0.0, 1.0, 2.0, 0.0, 5.0, 5.0, 5.0, 5.0]


def test_observation_attention_paper_by_hand():
    a = observation_attention(_col(_Q_HAND), _col(_K_HAND), 4, 2)
    assert a.shape == (1, 1, 2, 4) and a.dtype == torch.float64
    p1, p2, p3, p4 = _softmax([3, 6]), _softmax([0, 0]), _softmax([-1, -2]), _softmax([0, 0])
    expected = [max((p1[j] + p2[j]) / 2, (p3[j] + p4[j]) / 2) for j in range(2)]  # ~ [0.616, 0.726]
    assert a[0, 0, 1, :2].tolist() == pytest.approx(expected, rel=1e-12)
    assert a[0, 0, 0].tolist() == [0.0] * 4  # segment 0 has no candidates
    assert a[0, 0, 1, 2:].tolist() == [0.0, 0.0]  # blocks 2, 3 are not candidates of segment 1
    assert a[0, 0, 1].sum().item() != pytest.approx(1.0)  # no renormalisation after the max


def test_observation_attention_critiprefill_by_hand():
    a = observation_attention(_col(_Q_HAND), _col(_K_HAND), 4, 2, observation="critiprefill", scale=0.5)
    # logits max(mean(S1, S3), mean(S2, S4)) * 0.5 = max([1, 2], [0, 0]) * 0.5 = [0.5, 1.0]
    assert a[0, 0, 1, :2].tolist() == pytest.approx(_softmax([0.5, 1.0]), rel=1e-12)
    assert a[0, 0, 1, 2:].tolist() == [0.0, 0.0]


def test_segment_entropy_by_hand():
    a = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.25, 0.25, 0.5]]).view(1, 1, 4, 3)
    e = segment_entropy(a)
    assert e.shape == (1, 1, 4)
    assert e[0, 0].tolist() == pytest.approx([0.0, 0.0, math.log(2), 1.5 * math.log(2)], abs=1e-15)


def _one_hot_head(n: int, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query is ``c * e0``; keys of block 0 (64 tokens) are ``c * e0``, all other keys 0."""
    q = torch.zeros(n, 4, dtype=torch.float64)
    q[:, 0] = c
    k = torch.zeros(n, 4, dtype=torch.float64)
    k[:64, 0] = c
    return q, k


def test_rigid_head_when_every_query_attends_one_block():
    n = 512
    cfg = EntropyConfig.paper(segment_size=128, block_size=64, base_budget=256, dense_prefix=0, dense_layers=(),
                        dense_last_segment=False)
    q0, k0 = _one_hot_head(n, 30.0)  # logits 900 vs 0: exp(-900) underflows, A_obs is exactly one-hot
    gen = torch.Generator().manual_seed(0)
    q = torch.stack([q0, torch.randn(n, 4, generator=gen, dtype=torch.float64)]).unsqueeze(0)  # [1, 2, N, 4]
    k = k0.view(1, 1, n, 4)  # GQA: one kv head for both query heads
    a = observation_attention(q, k, cfg.segment_size, cfg.block_size)
    assert a[0, 0, 1:, 0].tolist() == [1.0, 1.0, 1.0]
    e = segment_entropy(a)
    assert e[0, 0].tolist() == [0.0] * 4
    assert rigid_heads(e, cfg.entropy_threshold).tolist() == [[True, False]]
    budgets = allocate_budgets(e, cfg)
    assert budgets[0, 0].tolist() == [256.0] * 4
    # Rigid head, k = 256 / 64 = 4 blocks: segment 3 (first block 6) sees sink 0 plus the 4 best others of 1..5;
    # all of them tie at A_obs = 0, so they go to the lowest indices 1..4 and block 5 is left out.
    plan = select_blocks(q, k, cfg)
    assert plan.blocks[0, 0, 3].tolist() == [True] * 5 + [False] + [True, True]


def test_single_segment_head_is_rigid():
    assert rigid_heads(torch.tensor([[[5.0]]]), 1e-5).tolist() == [[True]]


def test_budgets_hand_made_entropy_hit_clamps():
    cfg = EntropyConfig(base_budget=100, budget_alpha=0.5, fluctuation_threshold=0.4, max_budget_factor=3.0)
    e = torch.tensor([[[0.0, 1.0, 3.0, 3.0, 30.0, 30.0, 3.0], [0.0, 1e-6, 0.0, 0.0, 0.0, 0.0, 0.0]]])
    budgets = allocate_budgets(e, cfg)
    assert budgets.dtype == torch.float64 and budgets.shape == (1, 2, 7)
    # s=2: r = 2 -> 100 + 50 * 1.6 = 180; s=3: r = 0 -> 160; s=4: r = 9 -> 590 -> clamp 300; s=5: r = 0 -> 280;
    # s=6: r = 0.9 -> 280 + 25 = 305 -> clamp 300.
    assert budgets[0, 0].tolist() == pytest.approx([100, 100, 180, 160, 300, 280, 300], rel=1e-8)
    assert budgets[0, 1].tolist() == [100.0] * 7  # max entropy 1e-6 < 1e-5: rigid

    signed = allocate_budgets(torch.tensor([[[0.0, 1.0, 0.1, 5.0, 5.0]]]), cfg.replace(fluctuation="signed"))
    # s=2: r = clamp(-0.9, 0, 1.4) = 0 -> 80 -> clamp 100; s=3: r = clamp(49, 0, 1.4) = 1.4 -> 150; s=4: 130.
    assert signed[0, 0].tolist() == pytest.approx([100, 100, 100, 150, 130], rel=1e-8)
    low = allocate_budgets(torch.tensor([[[0.0, 1.0, 1.0, 1.0]]]), cfg)
    assert low[0, 0].tolist() == [100.0] * 4  # r = 0 every step: 80 clamped back to B_0


@pytest.mark.parametrize("n", [512, 450])
def test_dense_mask_is_causal_when_budget_covers_everything(n):
    cfg = EntropyConfig.paper(segment_size=128, block_size=64, base_budget=1e6, dense_prefix=0,
                        dense_last_segment=False, dense_layers=())
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, n, 8, generator=gen)
    k = torch.randn(1, 2, n, 8, generator=gen)
    plan = select_blocks(q, k, cfg)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(plan.dense_mask, causal.expand(1, 4, n, n))
    assert plan.density == 1.0
    assert plan.budgets is not None and plan.a_obs is not None and plan.entropy is not None


def test_dense_layer_and_short_prompt():
    cfg = EntropyConfig(segment_size=128, block_size=128, dense_prefix=256)
    q, k = torch.randn(1, 2, 300, 4), torch.randn(1, 2, 300, 4)
    causal = torch.ones(300, 300, dtype=torch.bool).tril().expand(1, 2, 300, 300)
    for plan in (select_blocks(q, k, cfg, layer_idx=0), select_blocks(q[:, :, :256], k[:, :, :256], cfg)):
        assert plan.a_obs is None and plan.budgets is None and plan.entropy is None
        m = plan.dense_mask.shape[-1]
        assert torch.equal(plan.dense_mask, causal[..., :m, :m])
    assert select_blocks(q, k, cfg, layer_idx=1).a_obs is not None


def test_select_blocks_top_k_ties_sinks_and_dense_rows():
    """A_obs points every query at key block 3; budget one block; sinks off."""
    n = 640
    cfg = EntropyConfig.paper(segment_size=128, block_size=64, base_budget=64, sink_blocks=0, dense_prefix=0,
                        dense_last_segment=False, dense_layers=())
    q = torch.zeros(1, 1, n, 2)
    q[..., 0] = 10.0
    k = torch.zeros(1, 1, n, 2)
    k[0, 0, 192:256, 0] = 10.0  # key block 3
    plan = select_blocks(q, k, cfg)
    assert plan.budgets[0, 0].tolist() == pytest.approx([64, 64, 83.2, 70.4, 64], rel=1e-9)
    rows = [[j for j in range(10) if plan.blocks[0, 0, qb, j]] for qb in range(5)]
    assert rows[0] == [0, 1]  # segment 0: own blocks only
    assert rows[1] == [0, 2, 3]  # candidates 0, 1 tie at 1/2: the lower one wins
    assert rows[2] == [3, 4, 5]
    assert rows[3] == [3, 6, 7]
    assert rows[4] == [3, 8, 9]
    # sink + local blocks are forced, the budget picks among the rest; the last segment dense when asked.
    plan = select_blocks(q, k, cfg.replace(sink_blocks=1, local_blocks=1, dense_last_segment=True))
    rows = [[j for j in range(10) if plan.blocks[0, 0, qb, j]] for qb in range(5)]
    assert rows[1] == [0, 1, 2, 3]
    assert rows[2] == [0, 1, 3, 4, 5]  # forced 0 (sink) and 3 (local); one more: 1 and 2 tie, 1 wins
    assert rows[3] == [0, 3, 5, 6, 7]  # forced 0 and 5; the top one of 1..4 is 3
    assert rows[4] == list(range(10))


def test_select_blocks_own_segment_is_causal_within_query_blocks():
    n = 512
    cfg = EntropyConfig.paper(segment_size=256, block_size=64, base_budget=64, sink_blocks=0, dense_prefix=0,
                        dense_last_segment=False, dense_layers=())
    q, k = torch.randn(1, 1, n, 4), torch.randn(1, 1, n, 4)
    plan = select_blocks(q, k, cfg)
    # query block 2 (tokens 256..383) of segment 1: own blocks 4, 5; query block 3 also gets 6, 7.
    own2 = plan.blocks[0, 0, 2, 4:].tolist()
    own3 = plan.blocks[0, 0, 3, 4:].tolist()
    assert own2 == [True, True, False, False] and own3 == [True] * 4
    assert plan.blocks[0, 0, 2, :4].sum().item() == 1 == plan.blocks[0, 0, 3, :4].sum().item()
    assert torch.equal(plan.blocks[0, 0, 2, :4], plan.blocks[0, 0, 3, :4])  # one choice per segment
    assert not plan.dense_mask[0, 0].triu(1).any()


def test_masked_attention_matches_sdpa_causal_gqa():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 33, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, 33, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, 33, 8, generator=gen, dtype=torch.float64)
    mask = torch.ones(33, 33, dtype=torch.bool).tril().expand(2, 4, 33, 33)
    out = masked_attention(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_masked_attention_empty_rows_are_zero():
    q = torch.randn(1, 1, 4, 2)
    k = torch.randn(1, 1, 4, 2)
    v = torch.randn(1, 1, 4, 2)
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    mask[0, 0, 2, 1] = True
    out = masked_attention(q, k, v, mask)
    assert out[0, 0, [0, 1, 3]].abs().max().item() == 0.0
    torch.testing.assert_close(out[0, 0, 2], v[0, 0, 1].double())


def test_sparse_prefill_dense_layer_equals_sdpa():
    cfg = EntropyConfig(segment_size=128, block_size=64)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 300, 8, generator=gen)
    k = torch.randn(1, 2, 300, 8, generator=gen)
    v = torch.randn(1, 2, 300, 8, generator=gen)
    out = sparse_prefill_attention(q, k, v, cfg, layer_idx=0)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
