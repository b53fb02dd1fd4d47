"""Chunked prefill (design.md §1.7): the queries of positions ``q_start .. q_start + M - 1`` against every key up to
the chunk's last query, planned by the chunk rule, checked against the float64 oracle (`reference.prefill`), against
the whole prompt's plan, and against dense bottom-right causal attention."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import EDGE_LENGTHS, make_qkv, prefill_case
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from test_prefill_properties import _clear_rows, rel_err

import flexentropy as fe
import reference
from flexentropy import EntropyConfig, select_blocks, sparse_prefill_attention
from flexentropy.sparse.kernel import kernel_rows, pad_rows, run_plan
from flexentropy.sparse.plan import causal_blocks

pytestmark = pytest.mark.usefixtures("one_thread")


@st.composite
def chunk_case(draw: st.DrawFn, max_n: int = 2000, dims: tuple[int, ...] = (16, 64)) -> dict:
    """A `prefill_case` of more than 256 tokens and a chunk start ``q_start < n`` (on and off the 128 and segment
    grids): the chunk holds the queries ``q_start .. n - 1`` and the keys ``0 .. n - 1``. Either budget rule (the
    fluctuation recurrence restarts at the chunk)."""
    case = draw(prefill_case(max_n=max_n, dims=dims))
    n = draw(st.one_of(st.sampled_from([n for n in EDGE_LENGTHS if 256 < n <= max_n]), st.integers(257, max_n)))
    segment = case["config"].segment_size
    starts = [s for s in (1, 127, 128, 129, segment - 1, segment, segment + 1, 2 * segment, n - 1) if 0 <= s < n]
    q_start = draw(st.one_of(st.sampled_from(starts or [0]), st.integers(0, n // 2), st.integers(0, n - 1)))
    return {**case, "n": n, "q_start": q_start}


def chunk_qkv(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk's queries ``[B, Hq, n - q_start, D]`` and all ``n`` keys and values."""
    q, k, v = make_qkv(case)
    return q[..., case["q_start"]:, :], k, v


def bottom_right_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 dense attention of the last ``M`` positions' queries over every key up to each (small N only)."""
    m, n = q.shape[-2], k.shape[-2]
    mask = torch.ones(m, n, dtype=torch.bool).tril(n - m)
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                          enable_gqa=q.shape[1] != k.shape[1])


@settings(max_examples=40)
@given(chunk_case())
def test_chunk_plan_matches_reference(case: dict) -> None:
    q, k, _ = chunk_qkv(case)
    cfg, q_start = case["config"], case["q_start"]
    plan = select_blocks(q, k, cfg, q_start=q_start)
    ref = reference.select_blocks(q, k, cfg, q_start=q_start)
    assert plan.blocks.shape == ref.blocks.shape and plan.q_start == q_start and plan.seq_len == case["n"]
    assert plan.density == pytest.approx(ref.density, abs=0.05) or ref.a_obs is not None
    if ref.a_obs is None:
        assert plan.dense and torch.equal(plan.blocks, ref.blocks)
        return
    first_segment = q_start // cfg.segment_size
    segments = (torch.arange(plan.blocks.shape[2]) + q_start // 128) * 128 // cfg.segment_size   # each row's
    dense = torch.tensor([reference.prefill.dense_row(int(s), case["n"], cfg, q_start) for s in segments])
    assert torch.equal(plan.blocks[..., dense, :], ref.blocks[..., dense, :])     # the rule, whatever the scores
    clear = _clear_rows(ref, cfg, q.dtype, first_segment)                              # [B, Hq, C_S]
    rows = clear[..., segments - first_segment]                                       # [B, Hq, C_Q]
    assume(rows.float().mean() > 0.5)       # a saturated observation ties exactly at coverage boundaries
    assert torch.equal(plan.blocks[rows], ref.blocks[rows])
    torch.testing.assert_close(plan.budgets.double(), ref.budgets, atol=1.0, rtol=1e-3)
    assert torch.equal(plan.to_dense_mask(), reference.blocks_to_dense_mask(plan.blocks, case["n"], cfg.block_size,
                                                                             q_start))


@settings(max_examples=25)
@given(chunk_case(max_n=1600))
def test_eager_chunk_attention_matches_its_masked_dense_plan(case: dict) -> None:
    """The kernel on a chunk's plan (its first query block padded to the grid, the diagonal shifted by ``q_start``)
    is the plan's token mask, ``[B, Hq, M, N]``, applied densely."""
    q, k, v = chunk_qkv(case)
    plan = select_blocks(q, k, case["config"], q_start=case["q_start"])
    out = sparse_prefill_attention(q, k, v, case["config"], compiled=False, plan=plan, q_start=case["q_start"])
    assert out.dtype == q.dtype and out.shape == q.shape
    mask = plan.to_dense_mask()
    assert mask.shape == (*q.shape[:3], case["n"])
    ref = reference.masked_attention(q, k, v, mask)
    assert rel_err(out, ref) < (1e-5 if q.dtype == torch.float32 else 2e-2)


@settings(max_examples=25, deadline=None)
@given(prefill_case(max_n=2400, dims=(16, 32)), st.data())
def test_an_aligned_chunk_plans_and_attends_as_the_whole_prompt(case: dict, data: st.DataObject) -> None:
    """A chunk that starts and ends on segment boundaries (or ends with the prompt), under a float coverage and no
    dense last segment, has the whole prompt's rows, budgets and outputs for its queries: its segments' observations
    use their own queries and the keys before them only."""
    size = case["config"].segment_size
    cfg = case["config"].replace(budget_rule="coverage", coverage=data.draw(st.sampled_from([0.6, 0.9, 1.0])),
                                 dense_last_segment=False)
    case = {**case, "dtype": torch.float64, "config": cfg}
    n = case["n"]
    assume(n > size)
    q, k, v = make_qkv(case)
    q_start = data.draw(st.integers(1, (n - 1) // size)) * size
    end = data.draw(st.sampled_from([n, *range(q_start + size, n, size)]))
    whole = select_blocks(q, k, cfg)
    plan = select_blocks(q[..., q_start:end, :], k[..., :end, :], cfg, q_start=q_start)
    rows, blocks = plan.blocks.shape[2:]
    first = q_start // 128
    assert torch.equal(plan.blocks, whole.blocks[..., first:first + rows, :blocks])
    assert not whole.blocks[..., first:first + rows, blocks:].any()
    if not plan.dense:
        segments = q_start // size
        assert torch.equal(plan.budgets, whole.budgets[..., segments:segments + plan.budgets.shape[-1]])
    out = sparse_prefill_attention(q[..., q_start:end, :], k[..., :end, :], v[..., :end, :], cfg, compiled=False,
                                   q_start=q_start)
    expected = sparse_prefill_attention(q, k, v, cfg, compiled=False)[..., q_start:end, :]
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)


@settings(max_examples=25)
@given(chunk_case(max_n=1500), st.sampled_from(["cover", "short", "dense_layer"]))
def test_a_covering_or_dense_chunk_is_bottom_right_causal_attention(case: dict, how: str) -> None:
    """A budget that covers every block, a chunk of at most ``dense_prefix`` keys, and a dense layer all give
    dense causal attention aligned at the bottom right (query i at position q_start + i)."""
    q, k, v = chunk_qkv(case)
    q_start, n = case["q_start"], case["n"]
    cfg = {"cover": case["config"].replace(coverage=1.0, base_budget=float(n), max_budget_factor=1.0),
           "short": case["config"].replace(dense_prefix=n),
           "dense_layer": case["config"].replace(dense_layers=(0, 1))}[how]
    plan = select_blocks(q, k, cfg, 1, q_start=q_start)
    assert torch.equal(plan.to_dense_mask(), torch.ones(n - q_start, n, dtype=torch.bool).tril(q_start)
                       .expand_as(plan.to_dense_mask()))
    out = sparse_prefill_attention(q, k, v, cfg, 1, compiled=False, q_start=q_start)
    assert rel_err(out, bottom_right_causal(q, k, v)) < (1e-5 if q.dtype == torch.float32 else 2e-2)


@settings(max_examples=20, deadline=None)
@given(prefill_case(max_n=1800, dims=(16, 32)), st.lists(st.floats(0.02, 0.98), min_size=1, max_size=4))
def test_consecutive_chunks_concatenate_to_the_whole_prompt(case: dict, cuts: list[float]) -> None:
    """Prefilling a prompt chunk by chunk, each chunk against the keys so far, at any split points and a budget that
    covers every block, gives the dense causal attention of the whole prompt."""
    n = case["n"]
    cfg = case["config"].replace(budget_rule="coverage", coverage=1.0)
    q, k, v = make_qkv(case)
    bounds = sorted({0, n, *(int(c * n) for c in cuts)})
    outs = [sparse_prefill_attention(q[..., a:b, :], k[..., :b, :], v[..., :b, :], cfg, compiled=False, q_start=a)
            for a, b in zip(bounds, bounds[1:], strict=False)]
    out = torch.cat(outs, dim=-2)
    assert rel_err(out, bottom_right_causal(q, k, v)) < (1e-5 if q.dtype == torch.float32 else 2e-2)


def test_the_chunk_rule_on_a_known_geometry() -> None:
    """Segments of 256, blocks of 128, a chunk from 800 to 1900 (keys 0 .. 1899): rows are query blocks 6 .. 14; the
    partial first segment (768 .. 1023: its probes were in the previous chunk) and the last two (holding the last 256
    tokens) attend every causal block; segments 4 and 5 their sink, one chosen block and their own segment."""
    cfg = EntropyConfig(segment_size=256, block_size=128, dense_prefix=256, sink_blocks=1, coverage=1e-6)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 1100, 16, generator=gen), torch.randn(1, 1, 1900, 16, generator=gen)
    plan = select_blocks(q, k, cfg, q_start=800)
    causal = causal_blocks(1900, 128, q_start=800)
    assert plan.blocks.shape == (1, 2, 9, 15) and causal.shape == (9, 15)
    assert (plan.q_start, plan.seq_len, plan.q_len, plan.row_start) == (800, 1900, 1100, 768)
    dense_rows = [0, 1, 6, 7, 8]                     # query blocks 6, 7 (segment 3), 12, 13, 14 (segments 6, 7)
    assert torch.equal(plan.blocks[0, :, dense_rows], causal[dense_rows].expand(2, -1, -1))
    sparse = plan.blocks[0, :, 2:6]                  # query blocks 8 .. 11: segments 4 and 5
    assert (sparse.sum(-1) == torch.tensor([3, 4, 3, 4])).all()             # sink + one chosen + own causal
    assert sparse[..., 0].all() and plan.budgets.shape == (1, 2, 5)
    assert repr(plan).startswith("SparsePlan(batch=1, heads=2, q_start=800, seq_len=1900, q_blocks=9")


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda q, k, v, cfg: sparse_prefill_attention(q, k[..., :-1, :], v[..., :-1, :], cfg, q_start=256),
     ValueError, r"k sequence length \(dim 2\) is 1023 but q_start \+ q's is 256 \+ 768 = 1024"),
    (lambda q, k, v, cfg: select_blocks(q, k[..., :1000, :], cfg, q_start=256), ValueError, "q_start \\+ q's"),
    (lambda q, k, v, cfg: sparse_prefill_attention(q, k, v, cfg, q_start=-1), ValueError, "q_start must be an int"),
    (lambda q, k, v, cfg: select_blocks(q, k, cfg, q_start=256.0), ValueError, "q_start must be an int"),
    (lambda q, k, v, cfg: select_blocks(q, k, cfg, q_start=True), ValueError, "q_start must be an int"),
    (lambda q, k, v, cfg: sparse_prefill_attention(q, k, v, cfg, q_start=256,
                                                   plan=select_blocks(q, k[..., 256:, :], cfg)),
     ValueError, "plan is for q_start=0, N=768"),
])
def test_bad_chunks_raise_clear_errors(call, error: type, match: str) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 768, 16, generator=gen)
    k, v = torch.randn(1, 2, 1024, 16, generator=gen), torch.randn(1, 2, 1024, 16, generator=gen)
    cfg = EntropyConfig(segment_size=256, block_size=64, dense_prefix=256)
    with pytest.raises(error, match=match):
        call(q, k, v, cfg)


def test_the_whole_prompt_fluctuation_rule_still_plans() -> None:
    q, k, _ = make_qkv({"batch": 1, "hq": 2, "hkv": 1, "n": 2048, "d": 16, "dtype": torch.float32, "seed": 1})
    plan = select_blocks(q, k, EntropyConfig.paper(dense_prefix=0, base_budget=128, max_budget_factor=1.0),
                         q_start=0)
    assert plan.q_start == 0 and 0 < plan.density < 1


def test_pad_rows_keeps_the_layout() -> None:
    """The kernel and the selection pad a chunk's queries at the front in their own stride order: a compiled graph
    that took a transposed view serves the padded copy (a contiguous copy would compile a graph of its own)."""
    x = torch.randn(2, 300, 4, 8).transpose(1, 2)            # [B, H, M, D] view of [B, M, H, D]
    padded = pad_rows(x, 44)
    assert padded.shape == (2, 4, 344, 8) and padded.transpose(1, 2).is_contiguous()
    assert torch.equal(padded[..., 44:, :], x) and not padded[..., :44, :].any()
    assert pad_rows(x, 0) is x


def test_a_one_row_plan_runs_with_an_empty_row_before_it() -> None:
    """A chunk inside one query block: the compiled kernel sees two rows (a count of 1 would be specialised), the
    first empty; the output is the plan's."""
    q, k, v = make_qkv({"batch": 1, "hq": 2, "hkv": 1, "n": 1100, "d": 16, "dtype": torch.float32, "seed": 2})
    q, k, v = q[..., 1024:1060, :], k[..., :1060, :], v[..., :1060, :]
    cfg = EntropyConfig(segment_size=128, block_size=64, dense_prefix=0, dense_last_segment=False, coverage=0.5)
    plan = select_blocks(q, k, cfg, q_start=1024)
    assert plan.blocks.shape[2] == 1 and 0 < plan.density < 1
    start, blocks = kernel_rows(plan)
    assert blocks.shape[2] == 2 and start == 896 and not blocks[..., 0, :].any()
    assert torch.equal(blocks[..., 1:, :], plan.blocks)
    out = run_plan(q, k, v, plan, compiled=False)
    assert rel_err(out, reference.masked_attention(q, k, v, plan.to_dense_mask())) < 1e-5


@pytest.mark.slow
def test_a_new_chunk_start_or_length_compiles_nothing() -> None:
    """The compiled selection and kernel (CPU Inductor here; the CUDA default) built by a whole prompt serve chunks
    at other starts and lengths, on and off the 128 grid, one segment or one query block long, sparse and dense,
    with queries that are transposed views (as a model's are): ``error_on_recompile`` around them. Their plans are
    the eager ones, their outputs eager flex's. Past the recompile limit, a chunk raises as a whole prompt does."""
    cfg = EntropyConfig(segment_size=256, block_size=64, dense_prefix=512, dense_last_segment=False, dense_layers=())
    gen = torch.Generator().manual_seed(0)

    def inputs(q_start: int, m: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        n = q_start + m
        q = torch.randn(1, m, 4, 32, generator=gen).transpose(1, 2)          # [B, Hq, M, D] views
        k, v = (torch.randn(1, n, 2, 32, generator=gen).transpose(1, 2) for _ in range(2))
        return tuple(t.to(dtype) for t in (q, k, v))

    def run(q_start: int, m: int, strict: bool) -> None:
        q, k, v = inputs(q_start, m)
        with torch._dynamo.config.patch(error_on_recompile=True) if strict else contextlib.nullcontext():
            plan = select_blocks(q, k, cfg, compiled=True, q_start=q_start)
            out = sparse_prefill_attention(q, k, v, cfg, q_start=q_start, plan=plan)
            dense = sparse_prefill_attention(q, k, v, cfg.replace(dense_prefix=q_start + m), q_start=q_start)
        eager = select_blocks(q, k, cfg, compiled=False, q_start=q_start)
        assert torch.equal(plan.blocks, eager.blocks), (q_start, m)
        torch.testing.assert_close(plan.budgets, eager.budgets)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)          # eager flex: "called without torch.compile()"
            assert rel_err(out, run_plan(q, k, v, plan, compiled=False)) < 1e-5, (q_start, m)
        assert rel_err(dense, bottom_right_causal(q, k, v)) < 1e-5, (q_start, m)
        assert m < 600 or plan.density < 1, (q_start, m, plan)

    run(0, 1500, strict=False)
    for q_start, m in ((700, 900), (300, 1700), (1280, 640), (1000, 1000), (1300, 100), (1030, 300), (1100, 1),
                       (0, 2000)):
        run(q_start, m, strict=True)
    q, k, v = inputs(700, 900, torch.bfloat16)
    with torch._dynamo.config.patch(recompile_limit=1), pytest.MonkeyPatch.context() as patch:
        patch.setattr("flexentropy._compile.RECOMPILE_LIMIT", 1)
        with pytest.raises(fe.RecompileLimitError, match="recompile limit"):
            sparse_prefill_attention(q, k, v, cfg, q_start=700)                # dtype change: a recompile


@pytest.mark.slow
def test_chunked_prefill_benchmark_runs_tiny_on_cpu(tmp_path: Path) -> None:
    """``profiling/chunked_prefill.py --device cpu --tiny``: every row timed, the chunked output the whole one's."""
    path = Path(__file__).resolve().parents[1] / "profiling" / "chunked_prefill.py"
    spec = importlib.util.spec_from_file_location("profiling_chunked_prefill", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "chunked.json"
    bench.main(["--device", "cpu", "--tiny", "--out", str(out)])
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [r["chunk"] for r in rows] == report["args"]["chunks"] and len(rows) == 2
    for row in rows:
        assert row["chunks"] >= 2 and all(row[key] > 0 for key in ("chunked_ms", "whole_ms", "dense_ms",
                                                                   "dense_chunked_ms", "flex_dense_chunked_ms"))
        assert 0 < row["whole_density"] < 1 and len(row["chunk_densities"]) == row["chunks"]
        assert min(row["chunk_densities"]) < 1 or not row["aligned_to_segments"]
        assert row["rel_l2_chunked_vs_whole"] < 0.05
        assert max(row["rel_l2_dense_chunked_vs_dense"], row["rel_l2_flex_dense_chunked_vs_dense"]) < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_cuda_chunks_compile_once_and_run_their_plans(backend: str) -> None:
    """On the GPU, the default path (the probe kernel, the compiled selection and kernel; FLASH under ``"auto"`` where
    flash-attn-4 is installed, its ``mask_mod`` reading a chunk's rows' positions from a device vector and a whole
    prompt's from nothing, a graph each; Triton's a 0-d device tensor, one graph: `kernel_offset`): after two whole
    prompts (the probe kernel's warm-up, `test_cuda_probe_kernel_compiles_once_for_every_length`) and one chunk,
    chunks at new starts and lengths compile nothing, and every chunk's output is its plan's masked attention."""
    cfg = EntropyConfig(segment_size=256, block_size=128, dense_prefix=1024, dense_last_segment=False,
                        dense_layers=(), backend=backend)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q_all = torch.randn(1, 8, 9000, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k_all, v_all = (torch.randn(1, 2, 9000, 128, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))

    def run(q_start: int, end: int, strict: bool) -> None:
        q, k, v = q_all[..., q_start:end, :], k_all[..., :end, :], v_all[..., :end, :]
        with torch._dynamo.config.patch(error_on_recompile=True) if strict else contextlib.nullcontext():
            plan = select_blocks(q, k, cfg, q_start=q_start)
            out = sparse_prefill_attention(q, k, v, cfg, q_start=q_start, plan=plan)
            dense = sparse_prefill_attention(q, k, v, cfg.replace(dense_prefix=end), q_start=q_start)
        ref = reference.masked_attention(q.cpu(), k.cpu(), v.cpu(), plan.to_dense_mask().cpu())
        assert rel_err(out.cpu(), ref) < 2e-2, (q_start, end)
        assert rel_err(dense.cpu(), bottom_right_causal(q.cpu(), k.cpu(), v.cpu())) < 2e-2, (q_start, end)

    run(0, 6000, strict=False)
    run(0, 4500, strict=False)
    run(3000, 6000, strict=False)
    for q_start, end in ((2900, 7900), (5000, 5064), (4100, 4800), (0, 9000), (8192, 9000)):
        run(q_start, end, strict=True)


def test_the_fluctuation_recurrence_restarts_at_each_chunk() -> None:
    """Alg. 3's budgets over a chunk start from ``B_0`` at its first two segments, whatever came before."""
    q, k, _ = make_qkv({"batch": 1, "hq": 2, "hkv": 1, "n": 3072, "d": 16, "dtype": torch.float32, "seed": 2})
    cfg = EntropyConfig(segment_size=256, block_size=128, dense_prefix=0, dense_last_segment=False,
                        budget_rule="fluctuation", base_budget=256, budget_alpha=1.0, fluctuation_threshold=0.0)
    plan = select_blocks(q[..., 1024:, :], k, cfg, q_start=1024)
    ref = reference.select_blocks(q[..., 1024:, :], k, cfg, q_start=1024)
    assert torch.equal(plan.budgets[..., :2], torch.full_like(plan.budgets[..., :2], 256.0))
    torch.testing.assert_close(plan.budgets.double(), ref.budgets, atol=1.0, rtol=1e-3)
    assert plan.budgets.amax() > 256     # the recurrence moves them after the restart


# --------------------------------------------------------------------------------------------------------------
# every prefill rule at an offset (issue 74)

RULE_KNOBS = {"streaming": {"window": 128}, "flexprefill": {"gamma": 0.7, "tau": 0.0, "min_budget": 64},
              "xattention": {"threshold": 0.7}, "vertical_slash": {"vertical": 96, "slash": 96}}
"""Knobs that leave each rule sparse at these lengths (FlexPrefill's ``tau=0``: every head vertical-slash, the
pattern its last queries give)."""

LAST_QUERIES = {"flexprefill": 128, "vertical_slash": 64}
"""Rules that read their pattern off their queries' last ones: a chunk of at least that many has the prompt's."""


def covering(name: str, config: EntropyConfig, n: int) -> fe.policies.PrefillPolicy:
    """Rule ``name`` with knobs that keep every causal block of an ``n``-token prompt."""
    knobs = {"streaming": {"window": n}, "flexprefill": {"gamma": 1.0}, "xattention": {"threshold": 1.0},
             "vertical_slash": {"vertical": n, "slash": n}}.get(name, {})
    return fe.make_prefill(name, config.replace(coverage=1.0, base_budget=float(n), max_budget_factor=1.0), **knobs)


@settings(max_examples=30, deadline=None)
@given(prefill_case(max_n=1400, dims=(16,)), st.sampled_from(list(fe.PREFILL_POLICIES)), st.data())
def test_every_rule_plans_a_chunk_as_the_prompt_so_far(case: dict, name: str, data: st.DataObject) -> None:
    """A chunk's plan (its queries from ``q_start``, every key up to its last) is the rows of the prompt's plan up to
    the chunk's end, for every rule, in the segments the chunk holds whole; a segment it starts inside attends every
    causal block (its start was the previous chunk's). Where each rule makes it so: the entropy rules' segments are
    observed on their own queries and earlier keys (the fluctuation recurrence restarts at a chunk: with every head
    rigid, budgets ``B_0``, nothing recurs); XAttention's rows read only their own queries; FlexPrefill's and
    vertical-slash's pattern is read off the chunk's last 128 / 64 queries, the prompt's own for its last chunk
    (FlexPrefill's query-aware heads choose among the chunk's pairs: ``tau=0`` here keeps every head
    vertical-slash). float64: the mass thresholds decide alike."""
    cfg = case["config"].replace(entropy_threshold=1e30) if case["config"].budget_rule == "fluctuation" else (
        case["config"])
    n = case["n"]
    queries = LAST_QUERIES.get(name, 1)
    assume(n > queries + 1)
    q, k, _ = make_qkv({**case, "dtype": torch.float64})
    q_start = data.draw(st.integers(1, n - queries), label="q_start")
    policy = fe.make_prefill(name, cfg, **RULE_KNOBS.get(name, {}))
    whole = policy.plan(q, k, 1)
    chunk = policy.plan(q[..., q_start:, :], k, 1, q_start=q_start)
    assert (chunk.q_start, chunk.seq_len, chunk.dense) == (q_start, n, whole.dense)
    rows = whole.blocks[..., q_start // 128:, :]
    assert chunk.blocks.shape == rows.shape
    starts = torch.arange(q_start // 128, whole.blocks.shape[2]) * 128 // cfg.segment_size * cfg.segment_size
    held = starts >= q_start
    assert torch.equal(chunk.blocks[..., held, :], rows[..., held, :])
    causal = causal_blocks(n, cfg.block_size, q_start=q_start)
    assert torch.equal(chunk.blocks[..., ~held, :], causal[~held].expand_as(chunk.blocks[..., ~held, :]))
    event(f"{name} {'dense' if chunk.dense else 'sparse'}")


@settings(max_examples=30, deadline=None)
@given(chunk_case(max_n=1400, dims=(16,)), st.sampled_from(list(fe.PREFILL_POLICIES)))
def test_every_rule_runs_a_chunk_as_its_plan_and_covering_knobs_as_dense(case: dict, name: str) -> None:
    """Every rule on a chunk at any offset: the kernel runs the chunk's plan (its token mask applied densely), and
    knobs that cover every block give dense causal attention aligned at the bottom right."""
    q, k, v = chunk_qkv(case)
    q_start, tolerance = case["q_start"], 1e-5 if q.dtype == torch.float32 else 2e-2
    policy = fe.make_prefill(name, case["config"], **RULE_KNOBS.get(name, {}))
    plan = policy.plan(q, k, 1, q_start=q_start)
    out = policy.attention(q, k, v, 1, compiled=False, q_start=q_start)
    assert out.shape == q.shape and rel_err(out, reference.masked_attention(q, k, v, plan.to_dense_mask())) < tolerance
    out = covering(name, case["config"], case["n"]).attention(q, k, v, 1, compiled=False, q_start=q_start)
    assert rel_err(out, bottom_right_causal(q, k, v)) < tolerance
