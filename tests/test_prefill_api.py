"""Public-boundary behaviour of the prefill path: validation, edge lengths, memory and recompiles."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import flexentropy as fe
import reference
from flexentropy import EntropyConfig, sparse_prefill_attention
from flexentropy.sparse.plan import causal_blocks


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"segment_size": 192}, "segment_size"),
        ({"segment_size": 128, "block_size": 256}, "block_size"),
        ({"block_size": 32}, "block_size"),
        ({"base_budget": 0}, "base_budget"),
        ({"base_budget": -5.0}, "base_budget"),
        ({"entropy_threshold": 0.0}, "entropy_threshold"),
        ({"fluctuation_threshold": -0.1}, "fluctuation_threshold"),
        ({"max_budget_factor": 0.5}, "max_budget_factor"),
        ({"fluctuation": "relative"}, "fluctuation"),
        ({"observation": "flash"}, "observation"),
        ({"observation_scale": 0.0}, "observation_scale"),
        ({"sink_blocks": -1}, "sink_blocks"),
        ({"dense_layers": [0]}, "dense_layers"),
        ({"backend": "cuda"}, "backend"),
        ({"decode_budget": 16, "decode_window": 32}, "decode_budget"),
        ({"decode_window": 0}, "decode_window"),
        ({"decode_delay": -1}, "decode_delay"),
        ({"decode_pool": 4}, "decode_pool"),
        ({"recompress_every": 0}, "recompress_every"),
        # infinities passed validation once and gave inf/NaN budgets silently
        *[({name: float("inf")}, f"{name} must be a finite number")
          for name in ("base_budget", "budget_alpha", "fluctuation_threshold", "observation_scale",
                       "max_budget_factor", "entropy_threshold")],
        ({"budget_alpha": float("nan")}, "budget_alpha must be a finite number"),
        # accepted once without a word: a coverage rising with the length, a segment longer than any context
        ({"coverage": (0.6, 0.8)}, r"coverage \(short, long\) must not rise with the prompt's length: expected "
                                   r"short >= long, got \(0.6, 0.8\)"),
        ({"segment_size": 2**40}, r"segment_size must be a positive multiple of 128 and of block_size=128, at most "
                                  r"16777216 tokens, got 1099511627776"),
        # issue 77: accepted, then an OverflowError in the selection (or torch's errors in a cache) at the first call
        *[({name: 2**70}, rf"EntropyConfig.{name} must be in \[0, 262144\], got {2**70}")
          for name in ("sink_blocks", "local_blocks")],
        *[({name: 2**70}, rf"EntropyConfig.{name} must be in \[{low}, 16777216\], got {2**70}")
          for name, low in (("dense_prefix", 0), ("decode_budget", 1), ("decode_delay", 0), ("recompress_every", 1))],
        ({"decode_window": 2**40, "decode_budget": 2**40}, r"decode_window must be in \[1, 16777216\]"),
        ({"decode_pool": 2**40 + 1}, r"decode_pool must be in \[1, 16777216\], got 1099511627777"),
    ],
)
def test_config_rejects_invalid_values(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EntropyConfig(**changes)


def test_config_rejects_wrong_types() -> None:
    with pytest.raises(TypeError, match="segment_size"):
        EntropyConfig(segment_size=512.0)
    for coverage in ([0.8, 0.6], "0.8"):      # a list once said "must be a number" without the pair form
        with pytest.raises(TypeError, match=r"coverage must be a number in \(0, 1\] or a \(short, long\) tuple"):
            EntropyConfig(coverage=coverage)
    with pytest.raises(TypeError, match=r"EntropyConfig.base_budget must be a number, got str '2048'"):
        EntropyConfig(base_budget="2048")
    with pytest.raises(TypeError, match=r"EntropyConfig.budget_alpha must be a number, got bool"):
        EntropyConfig(budget_alpha=True)
    with pytest.raises(TypeError, match="no field"):
        EntropyConfig().replace(segment=3)


def test_numpy_numbers_are_taken_as_python_numbers() -> None:
    """``EntropyConfig(segment_size=np.int64(256))`` was refused (numbers from a numpy sweep or a loaded file): numpy
    integers and floats are taken wherever the library checks numbers, and a config or policy holds them as Python's
    int and float."""
    cfg = EntropyConfig(segment_size=np.int64(256), block_size=np.int32(64), base_budget=np.float32(1024),
                        coverage=(np.float64(0.8), np.float32(0.5)), dense_layers=(np.int64(0), 2),
                        dense_prefix=np.int64(128), decode_budget=np.int64(256), recompress_every=np.int16(8))
    assert cfg == EntropyConfig(segment_size=256, block_size=64, base_budget=1024.0, coverage=(0.8, 0.5),
                                dense_layers=(0, 2), dense_prefix=128, decode_budget=256, recompress_every=8)
    assert [type(v) for v in (cfg.segment_size, cfg.base_budget, cfg.coverage[1], cfg.dense_layers[0])] == \
        [int, float, float, int]
    json.dumps(dataclasses.asdict(cfg))
    with pytest.raises(TypeError, match="EntropyConfig.segment_size must be an int, got float 256.0"):
        EntropyConfig(segment_size=np.float64(256))
    with pytest.raises(TypeError, match="EntropyConfig.dense_last_segment must be a bool"):
        EntropyConfig(dense_last_segment=np.int64(1))
    with pytest.raises(ValueError, match=r"EntropyConfig.decode_window must be in \[1, 16777216\], got 0"):
        EntropyConfig(decode_window=np.int64(0))
    policy = fe.make_prefill("xattention", cfg, threshold=np.float32(0.5), stride=np.int64(8))
    assert (type(policy.threshold), type(policy.stride)) == (float, int)
    snap = fe.make_cache("snapkv", budget=np.int64(128), window=np.int64(16)).policy
    assert (snap.budget, type(snap.budget), type(snap.window)) == (128, int, int)
    q, k, v = _qkv(n=640, d=32)
    expected = sparse_prefill_attention(q, k, v, cfg.replace(segment_size=128), 1, scale=0.25, compiled=False)
    got = sparse_prefill_attention(q, k, v, cfg.replace(segment_size=np.int64(128)), np.int64(1),
                                   scale=np.float32(0.25), compiled=False)
    assert torch.equal(got, expected)
    observed = fe.observation_attention(q, k, np.int64(128), np.int64(64))
    assert torch.equal(observed, fe.observation_attention(q, k, 128, 64))


def test_config_defaults_are_the_spec() -> None:
    cfg = EntropyConfig()
    assert (cfg.segment_size, cfg.block_size, cfg.base_budget, cfg.entropy_threshold) == (256, 128, 2048, 1e-5)
    assert (cfg.budget_alpha, cfg.fluctuation_threshold, cfg.max_budget_factor) == (0.5, 0.4, 3.0)
    assert (cfg.fluctuation, cfg.observation, cfg.observation_scale, cfg.probes) == ("abs", "probe", 1.0, 16)
    assert (cfg.budget_rule, cfg.coverage) == ("coverage", (0.8, 0.6))
    paper = EntropyConfig.paper()
    assert (paper.observation, paper.budget_rule, paper.base_budget, paper.segment_size) == (
        "paper", "fluctuation", 2048, 512)
    assert (cfg.sink_blocks, cfg.local_blocks, cfg.dense_prefix, cfg.dense_last_segment) == (1, 0, 4096, True)
    assert cfg.dense_layers == (0,)
    assert cfg.probe_kernel is None      # auto: the kernel on CUDA outside an enclosing compile
    assert (cfg.decode_budget, cfg.decode_window, cfg.decode_delay, cfg.decode_pool) == (1024, 32, 16, 5)
    assert (cfg.decode_score, cfg.recompress_every) == ("softmax", 32)  # the budget bounds memory (None: paper)
    assert cfg.decode_span == 16      # the continuation of a value being read is kept (0: the paper)


def _qkv(b: int = 1, hq: int = 4, hkv: int = 2, n: int = 300, d: int = 16, dtype: torch.dtype = torch.float32):
    return torch.randn(b, hq, n, d, dtype=dtype), torch.randn(b, hkv, n, d, dtype=dtype), \
        torch.randn(b, hkv, n, d, dtype=dtype)


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda q, k, v: (q, k[:, :, :-1], v), ValueError, "sequence length"),
        (lambda q, k, v: (q, k, v[..., :-1]), ValueError, "head dim"),
        (lambda q, k, v: (q[:1].expand(2, -1, -1, -1), k, v), ValueError, "batch size"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, "multiple of key/value heads"),
        (lambda q, k, v: (q, k.double(), v), TypeError, "dtype"),
        (lambda q, k, v: (q.long(), k, v), TypeError, "floating"),
        (lambda q, k, v: (q[0], k, v), ValueError, "4-D"),
        (lambda q, k, v: (q, k, v.to("meta")), ValueError, "device"),
        (lambda q, k, v: (q.tolist(), k, v), TypeError, "torch.Tensor"),
    ],
)
def test_bad_tensors_raise_clear_errors(mutate, error: type, match: str) -> None:
    q, k, v = mutate(*_qkv(b=1))
    cfg = EntropyConfig(segment_size=128, block_size=128, dense_prefix=0)
    with pytest.raises(error, match=match):
        sparse_prefill_attention(q, k, v, cfg)


def test_meta_tensors_give_the_shapes_of_the_outputs() -> None:
    """Issue 77: meta tensors (shapes without data) got dynamo's "Observed exception" from the compiled kernel (eager:
    FlexAttention's "only supported on CUDA, CPU, ..."), and a selection with ``probe_kernel=True`` the same; each
    public function gives its output's shape on meta, as torch's ops and the dense fallback do."""
    q, k, v = (t.to("meta") for t in _qkv(n=640, d=32))
    cfg = EntropyConfig(segment_size=128, block_size=64, dense_prefix=128, dense_layers=())
    for compiled in (True, False):
        out = sparse_prefill_attention(q, k, v, cfg, compiled=compiled)
        assert (out.device.type, out.shape) == ("meta", q.shape), compiled
    for probe_kernel in (None, True, False):
        plan = fe.select_blocks(q, k, cfg.replace(probe_kernel=probe_kernel))
        assert (plan.blocks.device.type, plan.blocks.shape) == ("meta", (1, 4, 5, 10)), probe_kernel
    a_obs = fe.observation_attention(q, k, 128, 64)
    assert fe.segment_entropy(a_obs, normalise=True).shape == (1, 4, 5)
    assert fe.decode_attention(q[..., -1:, :], k, v).shape == (1, 4, 1, 32)


def test_a_plan_on_meta_tensors_prints_its_shapes() -> None:
    """Its repr read the density with ``.item()``, which meta tensors (shapes without data) cannot give."""
    plan = fe.SparsePlan(torch.zeros(2, 4, 5, 10, dtype=torch.bool, device="meta"), seq_len=640, block_size=64)
    assert repr(plan) == ("SparsePlan(batch=2, heads=4, seq_len=640, q_blocks=5, kv_blocks=10, block_size=64, "
                          "density=? (meta tensors))")
    causal = causal_blocks(640, 64).expand(2, 4, 5, 10)
    assert repr(fe.SparsePlan(causal, seq_len=640, block_size=64)).endswith("block_size=64, density=1.000)")


@pytest.mark.parametrize(("call", "match"), [
    (lambda q, k, v, cfg: sparse_prefill_attention(q, k, v, cfg, scale=float("nan")), "scale must be a finite number"),
    (lambda q, k, v, cfg: sparse_prefill_attention(q, k, v, cfg, scale=float("inf")), "scale must be a finite number"),
    # scale 0 gave a uniform average on the sparse path and NaN on the dense one
    *[(lambda q, k, v, cfg, s=scale, n=n: sparse_prefill_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], cfg, scale=s),
       r"sparse_prefill_attention.scale must be a finite number > 0, got -?0.0")
      for scale in (0.0, -0.0) for n in (100, 640)],
    (lambda q, k, v, cfg: sparse_prefill_attention(q[:0], k[:0], v[:0], cfg), "batch size must be >= 1"),
    (lambda q, k, v, cfg: fe.select_blocks(q[:0], k[:0], cfg), "batch size must be >= 1"),
    (lambda q, k, v, cfg: sparse_prefill_attention(q[..., :0], k[..., :0], v[..., :0], cfg), "head dim must be >= 1"),
    (lambda q, k, v, cfg: fe.observation_attention(q[..., :0], k[..., :0], 128, 64), "head dim must be >= 1"),
])
def test_degenerate_inputs_raise_at_the_boundary(call, match: str) -> None:
    """A scale of nan/inf, batch 0 and head dim 0 crashed deep in torch (Inductor's CppCompileError, a
    ZeroDivisionError in the estimate, dynamo's Unsupported)."""
    q, k, v = _qkv(n=640, d=32)
    cfg = EntropyConfig(segment_size=128, block_size=64, dense_prefix=128, dense_layers=())
    with pytest.raises(ValueError, match=match):
        call(q, k, v, cfg)


@pytest.mark.parametrize("compiled", [False, True])
def test_inputs_that_require_grad_run_detached_where_no_graph_is_built(compiled: bool) -> None:
    """Issue 69: q with ``requires_grad=True`` inside ``torch.no_grad()`` or ``torch.inference_mode()`` gave
    FlexAttention's NotImplementedError (eager) or a long dynamo traceback (compiled): flex attention refuses such
    inputs on CPU whatever the grad mode. No graph is built there, so they run detached, with the output of inputs
    that do not require grad; with grad enabled the CPU's inference-only message stays."""
    q, k, v = _qkv(n=640, d=32)
    cfg = EntropyConfig(segment_size=128, block_size=64, dense_prefix=128, dense_layers=())
    expected = sparse_prefill_attention(q, k, v, cfg, compiled=compiled)
    q.requires_grad_()
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            got = sparse_prefill_attention(q, k, v, cfg, compiled=compiled)
        assert not got.requires_grad and torch.equal(got, expected), mode.__name__
    with pytest.raises(ValueError, match=r"inference-only on CPU .* call it under torch.no_grad\(\)"):
        sparse_prefill_attention(q, k, v, cfg, compiled=compiled)


def test_a_huge_budget_keeps_every_block() -> None:
    """``base_budget=1e30`` once overflowed int64 in the block count and gave the sparsest plan (only the forced
    blocks); any budget past the prompt keeps every causal block."""
    q, k, _ = _qkv(n=640, d=32)
    cfg = EntropyConfig(segment_size=128, block_size=64, dense_prefix=128, dense_layers=(), budget_rule="fluctuation")
    for budget in (1e12, 1e30, 3e38):
        assert fe.select_blocks(q, k, cfg.replace(base_budget=budget)).density == 1.0, budget


@pytest.mark.slow
@pytest.mark.parametrize("where", ["k", "v"])
def test_a_nan_key_or_value_gives_nan_where_dense_does(where: str) -> None:
    """A NaN key (or value) makes every later query of its group NaN in dense attention. The compiled sparse path
    gave finite rows where the plan or the CPU kernel passed over it. For a NaN value, kernels that multiply masked
    weights (0 * NaN: CPU SDPA, eager and compiled flex) make earlier rows NaN too; the rows that attend it are NaN
    in all."""
    q, k, v = _qkv(b=2, n=640, d=32)
    {"k": k, "v": v}[where][1, 0, 5, 3] = float("nan")
    reach = torch.zeros(2, 4, 640, dtype=torch.bool)
    reach[1, :2, 5:] = True                                   # query heads 0-1 read KV head 0; queries 5..639
    cfg = EntropyConfig(segment_size=128, block_size=64, dense_prefix=128, dense_layers=())
    with torch.no_grad():
        if where == "k":
            dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            assert torch.equal(dense.isnan().any(dim=-1), reach)
        for compiled in (True, False):
            nan = sparse_prefill_attention(q, k, v, cfg, compiled=compiled).isnan().any(dim=-1)
            assert torch.equal(nan, reach) if where == "k" else bool(nan[reach].all()), compiled


def test_bad_arguments_raise_clear_errors() -> None:
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="EntropyConfig"):
        sparse_prefill_attention(q, k, v, {"segment_size": 128})
    with pytest.raises(ValueError, match="layer_idx"):
        sparse_prefill_attention(q, k, v, EntropyConfig(), layer_idx=-1)
    with pytest.raises(ValueError, match="segment_size"):
        fe.observation_attention(q, k, 192, 64)
    with pytest.raises(ValueError, match="observation"):
        fe.observation_attention(q, k, 128, 64, observation="nope")
    with pytest.raises(ValueError, match="a_obs"):
        fe.segment_entropy(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="plan is for"):
        plan = fe.select_blocks(q, k, EntropyConfig(segment_size=128, dense_prefix=0))
        sparse_prefill_attention(q[..., :200, :], k[..., :200, :], v[..., :200, :], EntropyConfig(), plan=plan)


def test_flags_take_bools_and_entropies_real_rows() -> None:
    """Issue 77: ``compiled="no"`` compiled (a string is true), ``normalise="no"`` normalised, and a complex a_obs lost
    its imaginary part without a word: a flag takes True or False (None too where None picks the default), and
    `segment_entropy` refuses complex rows."""
    q, k, v = _qkv(n=640, d=32)
    cfg = EntropyConfig(segment_size=128, block_size=64, dense_prefix=128, dense_layers=())
    policy = fe.make_prefill("streaming", cfg)
    calls = [
        (r"sparse_prefill_attention.compiled must be a bool \(True or False\)",
         lambda flag: sparse_prefill_attention(q, k, v, cfg, compiled=flag)),
        (r"StreamingPrefill.attention.compiled must be a bool \(True or False\)",
         lambda flag: policy.attention(q, k, v, compiled=flag)),
        (r"StreamingPrefill.plan.compiled must be a bool or None \(None: the default's choice\)",
         lambda flag: policy.plan(q, k, compiled=flag)),
        (r"select_blocks.compiled must be a bool or None \(None: the default's choice\)",
         lambda flag: fe.select_blocks(q, k, cfg, compiled=flag)),
        (r"segment_entropy.normalise must be a bool \(True or False\)",
         lambda flag: fe.segment_entropy(torch.rand(1, 4, 3, 5), normalise=flag)),
        (r"EntropyConfig.probe_kernel must be a bool or None \(None: the default's choice\)",
         lambda flag: EntropyConfig(probe_kernel=flag)),
        (r"EntropyConfig.dense_last_segment must be a bool \(True or False\)",
         lambda flag: EntropyConfig(dense_last_segment=flag)),
    ]
    for message, call in calls:
        for flag in ("no", 0):
            with pytest.raises(TypeError, match=rf"{message}, got {type(flag).__name__} {flag!r}"):
                call(flag)
    with pytest.raises(TypeError, match=r"a_obs must be real .* got torch.complex64: its imaginary part would be "
                                        r"dropped; pass its .abs\(\) or .real"):
        fe.segment_entropy(torch.rand(1, 4, 3, 5, dtype=torch.complex64))


@pytest.mark.parametrize("n", [4 * 128, 4 * 128 + 1, 4 * 128 + 100])
def test_the_dense_tail_holds_the_last_segment_size_tokens(n: int) -> None:
    """A prompt one token past a segment boundary left the question in a sparse segment (its last segment held one
    token): every query among the last ``segment_size`` now attends to every earlier key."""
    q, k, _ = _qkv(n=n)
    cfg = EntropyConfig(segment_size=128, block_size=64, base_budget=64, dense_prefix=128, dense_layers=())
    dense = fe.select_blocks(q, k, cfg).to_dense_mask()[..., n - 128 :, :]
    assert bool(dense.equal(torch.ones(n, n, dtype=torch.bool).tril()[n - 128 :].expand_as(dense)))
    sparse = fe.select_blocks(q, k, cfg.replace(dense_last_segment=False)).to_dense_mask()[..., n - 128 :, :]
    assert not bool(sparse.all(dim=-1).any())  # without the dense tail these queries skip some keys


def test_float64_gets_a_clear_error_compiled_and_runs_eagerly() -> None:
    q, k, v = (t.double() for t in _qkv(n=512))
    cfg = EntropyConfig(segment_size=128, block_size=128, base_budget=128, dense_prefix=128, dense_layers=())
    with pytest.raises(TypeError, match=r"takes float16, bfloat16 or float32 inputs, got torch.float64.*compiled"):
        sparse_prefill_attention(q, k, v, cfg)
    with torch.no_grad():
        out = sparse_prefill_attention(q, k, v, cfg, compiled=False)
    assert out.dtype == torch.float64 and bool(out.isfinite().all())


@pytest.mark.slow
def test_a_nan_query_gives_a_nan_row_not_zeros() -> None:
    """Dense and eager attention give NaN for a query holding NaN; the compiled CPU kernel gave zeros."""
    q, k, v = _qkv(n=1024)
    q[0, 1, 700, 3] = float("nan")
    cfg = EntropyConfig(segment_size=128, block_size=128, base_budget=128, dense_prefix=256, dense_layers=())
    with torch.no_grad():
        plan = fe.select_blocks(q, k, cfg)
        outs = [sparse_prefill_attention(q, k, v, cfg, plan=plan, compiled=c) for c in (True, False)]
    for out in outs:
        bad = out.isnan().any(dim=-1)
        assert bad[0, 1, 700] and int(bad.sum()) == 1  # that row only
    ok = ~outs[1].isnan()
    torch.testing.assert_close(outs[0][ok], outs[1][ok], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_empty_and_single_token(compiled: bool) -> None:
    cfg = EntropyConfig(segment_size=128, block_size=128, dense_prefix=0)
    q, k, v = _qkv(n=0)
    out = sparse_prefill_attention(q, k, v, cfg, compiled=compiled)
    assert out.shape == (1, 4, 0, 16)
    q, k, v = _qkv(n=1)
    out = sparse_prefill_attention(q, k, v, cfg, compiled=compiled)
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1))   # one key: output is its value


def test_plan_for_32k_stays_small_in_memory() -> None:
    """Plan + BlockMask at N=32768 (B 1, Hq 8, D 64): an N x N float32 mask alone would be 32 GiB."""
    code = textwrap.dedent("""
        import json, resource, torch
        import flexentropy as fe
        n = 32768
        q = torch.randn(1, 8, n, 64); k = torch.randn(1, 2, n, 64)
        cfg = fe.EntropyConfig()
        fe.select_blocks(q[..., :8192, :], k[..., :8192, :], cfg).to_block_mask()   # warm allocator/imports
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        plan = fe.select_blocks(q, k, cfg)
        mask = plan.to_block_mask()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"delta_kib": after - before, "density": plan.density, "shape": list(mask.shape)}))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["shape"] == [1, 8, 32768, 32768]
    assert 0 < report["density"] < 1   # random inputs spread attention: coverage keeps ~80% of the blocks
    assert report["delta_kib"] < 1024 * 1024, f"plan + mask raised peak RSS by {report['delta_kib'] / 1024:.0f} MiB"


@pytest.mark.slow
def test_a_block_count_equal_to_the_head_dim_stays_dynamic() -> None:
    """1000 tokens in 64-token blocks are 16 blocks, as many as the head dim: dynamo gives equal sizes one symbol,
    flex keeps the head dim static, and the block count would be static too (a recompile at every new count)."""
    from torch._dynamo.utils import counters

    cfg = EntropyConfig(segment_size=256, block_size=64, base_budget=64, dense_prefix=256)
    graphs_before = counters["stats"]["unique_graphs"]
    for n in (1000, 926, 1300):  # 16, 15 and 21 key blocks
        q, k, v = _qkv(n=n, d=16)
        assert torch.isfinite(sparse_prefill_attention(q, k, v, cfg)).all()
    assert counters["stats"]["unique_graphs"] - graphs_before <= 1, "a new block count recompiled the kernel"


@pytest.mark.slow
def test_a_first_length_whose_counts_equal_static_sizes_compiles_for_every_length() -> None:
    """Flex keeps head counts and the head dim static, and dynamo gives equal sizes one symbol. With 8 query heads
    and head dim 8, 900 tokens are 8 query and 8 key blocks of 128, and 2 probes a segment give 8 probe rows: the
    first call's graphs (kernel, selection, probe scores) must still serve the next lengths."""
    cfg = EntropyConfig(segment_size=256, block_size=128, dense_prefix=512, probes=2)

    def run(n: int) -> None:
        q, k, v = _qkv(hq=8, n=n, d=8)
        fe.select_blocks(q, k, cfg, compiled=True)
        assert torch.isfinite(sparse_prefill_attention(q, k, v, cfg)).all()

    torch._dynamo.reset()
    run(900)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (1234, 1500):
            run(n)


@pytest.mark.slow
def test_twelve_lengths_compile_once_and_never_fall_back() -> None:
    from torch._dynamo.utils import counters

    cfg = EntropyConfig(segment_size=256, block_size=128, base_budget=256, dense_prefix=256)
    graphs_before = counters["stats"]["unique_graphs"]
    for n in (300, 513, 640, 777, 900, 1024, 1100, 1300, 1555, 1800, 2049, 2500):
        q, k, v = _qkv(n=n, d=32)
        out = sparse_prefill_attention(q, k, v, cfg)
        assert out.shape == q.shape and torch.isfinite(out).all()
    # one graph (none if an earlier test built it): a block count that changes is dynamic from the first compile
    assert counters["stats"]["unique_graphs"] - graphs_before <= 1, "lengths must not trigger recompiles"


@pytest.mark.slow
def test_hitting_the_recompile_limit_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = EntropyConfig(segment_size=256, block_size=128, base_budget=256, dense_prefix=256)
    q, k, v = _qkv(n=600, d=32)
    sparse_prefill_attention(q, k, v, cfg)                        # the cached float32 graph
    monkeypatch.setattr("flexentropy._compile.RECOMPILE_LIMIT", 1)
    # torch's own patch: monkeypatch's undo deleted the config attribute (pytest 9.2), which hides it for good
    with torch._dynamo.config.patch(recompile_limit=1), pytest.raises(fe.RecompileLimitError, match="recompile limit"):
        sparse_prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cfg)   # dtype change: a recompile


@pytest.mark.slow
def test_compiled_selection_equals_eager_across_lengths_without_recompiles() -> None:
    """The selection graph (the default on CUDA) is length-generic: no guard on N, segment count or divisibility.

    Dynamo specialises size-1 dimensions, so a last segment of exactly one token (N % L_S == 1) has a graph of
    its own, and Inductor picks the probe's softmax reduction by size (one graph up to 4096 tokens, one above):
    those variants are warmed first, then no length may add a graph."""
    from torch._dynamo.utils import counters

    cfg = EntropyConfig(segment_size=256, block_size=64, base_budget=128, dense_prefix=256, local_blocks=1)
    graphs = None
    for i, n in enumerate((1500, 2049, 4609, 1536, 2000, 2048, 2700, 3000, 3328, 4097, 5000)):
        q, k, _ = _qkv(n=n, d=32)
        fast = fe.select_blocks(q, k, cfg, compiled=True)
        eager = fe.select_blocks(q, k, cfg, compiled=False)
        assert torch.equal(fast.blocks, eager.blocks), n
        torch.testing.assert_close(fast.budgets, eager.budgets)
        if i == 2:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "selection recompiled for a new length"
    pooled = cfg.replace(observation="pooled")     # its observation runs eagerly, the rest in the selection graph
    for n in (1500, 3000):
        q, k, _ = _qkv(n=n, d=32)
        assert torch.equal(fe.select_blocks(q, k, pooled, compiled=True).blocks,
                           fe.select_blocks(q, k, pooled, compiled=False).blocks), n


def test_failed_selection_compile_warns_once_and_selects_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    import flexentropy.policies.prefill.entropy.selection as selection

    def broken(*args: object, **kwargs: object) -> None:
        raise torch._inductor.exc.InductorError(RuntimeError("codegen failed"), None)

    monkeypatch.setattr(selection, "_compiled_plan_tensors", broken)
    monkeypatch.setattr(selection, "_compiled_select", broken)        # the probe observation's compiled part
    monkeypatch.setattr(selection, "_compile_failed", [])
    cfg = EntropyConfig(segment_size=256, block_size=64, base_budget=128, dense_prefix=256)
    q, k, _ = _qkv(n=1500, d=32)
    with pytest.warns(RuntimeWarning, match="selecting eagerly"):
        plan = fe.select_blocks(q, k, cfg, compiled=True)
    assert torch.equal(plan.blocks, fe.select_blocks(q, k, cfg, compiled=False).blocks)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fe.select_blocks(q, k, cfg, compiled=True)              # no second warning


def test_block_mask_indices_are_contiguous() -> None:
    """flex's GPU lowering rejects strided index tensors (an inductor error seen on the H200)."""
    from flexentropy.sparse.plan import block_mask_tensors

    q, k, _ = _qkv(n=1500, d=32)
    plan = fe.select_blocks(q, k, EntropyConfig(segment_size=256, block_size=64, base_budget=128, dense_prefix=256))
    assert all(t.is_contiguous() for t in block_mask_tensors(plan.blocks, plan.seq_len, plan.block_size))


def test_cpu_autograd_gets_a_clear_error() -> None:
    q, k, v = _qkv(n=300)
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="no_grad"):
        sparse_prefill_attention(q, k, v, EntropyConfig(segment_size=128, dense_prefix=0))


def test_probe_kernel_knob_selects_the_same_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``probe_kernel=True`` routes the probe through `probe_mass_kernel` (eager flex off CUDA): same masses to float
    rounding, so the same plan here. The default (``None``, auto) takes the scored path on CPU."""
    from flexentropy.policies.prefill.entropy import probe_mass

    calls = []
    kernel_fn = probe_mass.probe_mass_kernel
    monkeypatch.setattr(probe_mass, "probe_mass_kernel", lambda *a, **kw: calls.append(1) or kernel_fn(*a, **kw))
    with pytest.raises(TypeError, match="probe_kernel must be a bool or None"):
        EntropyConfig(probe_kernel=1)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 1500, 32, generator=gen)
    k = torch.randn(1, 2, 1500, 32, generator=gen) * 2
    cfg = EntropyConfig(segment_size=256, block_size=64, dense_prefix=256)
    scored = fe.select_blocks(q, k, cfg, compiled=False)
    assert not calls                     # auto on CPU: the scored path
    kernel = fe.select_blocks(q, k, cfg.replace(probe_kernel=True), compiled=False)
    assert 0 < scored.density < 1
    assert calls and torch.equal(kernel.blocks, scored.blocks)
    torch.testing.assert_close(kernel.budgets, scored.budgets)


def test_coverage_pair_follows_the_prompt_length() -> None:
    """``(short, long)``: short up to 32k tokens, long from 128k, linear in log2(N) between; a float everywhere."""
    from flexentropy.config import coverage_at

    assert [coverage_at((0.8, 0.6), n) for n in (1, 4096, 32768, 131072, 1 << 20)] == [0.8, 0.8, 0.8, 0.6, 0.6]
    assert coverage_at((0.8, 0.6), 65536) == pytest.approx(0.7)
    values = [coverage_at((0.8, 0.6), n) for n in range(30000, 140000, 5000)]
    assert values == sorted(values, reverse=True)
    assert coverage_at(0.7, 1 << 20) == 0.7
    for bad in ((0.8,), (0.8, 0.6, 0.5), (0.8, 1.5), (0.0, 0.6)):
        with pytest.raises(ValueError, match="coverage"):
            EntropyConfig(coverage=bad)


@pytest.mark.parametrize("blocks", [256, 512, 1024])        # 32k, 64k, 128k tokens in blocks of 128
def test_coverage_pair_budgets_are_the_reference_and_the_single_value_at_its_ends(blocks: int) -> None:
    """The budgets of the pair are the float64 reference's at every length, and those of the single value at the
    two ends (0.8 at 32k, 0.6 at 128k), on observation rows at the lengths the pair changes over."""
    from flexentropy.config import coverage_at
    from flexentropy.policies.prefill.entropy.selection import coverage_budgets

    pair = EntropyConfig(segment_size=1024, block_size=128)
    segments = blocks * 128 // pair.segment_size
    gen = torch.Generator().manual_seed(blocks)
    causal = torch.arange(blocks)[None, :] < (torch.arange(segments)[:, None] + 1) * 8
    a_obs = torch.rand(1, 2, segments, blocks, generator=gen, dtype=torch.float64) ** 8 * causal
    a_obs = a_obs / a_obs.sum(-1, keepdim=True) * 0.9          # a probe row: its rest is on the segment's own keys
    budgets = coverage_budgets(a_obs, pair)
    torch.testing.assert_close(budgets.double(), reference.coverage_budgets(a_obs, pair), atol=0, rtol=0)
    single = pair.replace(coverage=coverage_at(pair.coverage, blocks * 128))
    if blocks in (256, 1024):
        assert torch.equal(budgets, coverage_budgets(a_obs, single))
    shorter = coverage_budgets(a_obs, pair.replace(coverage=0.8))
    assert (shorter >= budgets).all() and (blocks == 256 or (shorter > budgets).any())


def test_coverage_pair_compiles_once_across_the_lengths_it_changes_over() -> None:
    """The pair's share is a tensor computed from the block count: budgets compiled with dynamic shapes at one
    length serve lengths below, inside and above the 32k-128k ramp without a new graph, and match eager ones."""
    from torch._dynamo.utils import counters

    from flexentropy.policies.prefill.entropy.selection import coverage_budgets

    cfg = EntropyConfig(segment_size=1024, block_size=128)
    compiled = torch.compile(coverage_budgets, dynamic=True, fullgraph=True)
    graphs = None
    for i, blocks in enumerate((200, 240, 300, 700, 1024, 1500)):     # 25.6k, 30.7k, 38.4k, 89.6k, 128k, 192k tokens
        gen = torch.Generator().manual_seed(blocks)
        a_obs = torch.rand(1, 2, blocks * 128 // cfg.segment_size, blocks, generator=gen) ** 8
        a_obs = a_obs / a_obs.sum(-1, keepdim=True) * 0.9
        torch.testing.assert_close(compiled(a_obs, cfg), coverage_budgets(a_obs, cfg), atol=cfg.block_size, rtol=0)
        if i == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "a new length compiled the coverage budgets again"


def test_the_old_prefill_paths_still_import_with_a_warning_naming_the_new_place() -> None:
    """``flexentropy.prefill`` (the entropy rule's stages before they moved beside the other rules) keeps every name
    it had, each the moved object itself, with a ``DeprecationWarning`` that says where to import it from."""
    import importlib

    import flexentropy as fe
    from flexentropy.policies.prefill import fixed, ranking
    from flexentropy.policies.prefill.entropy import selection

    for module, name, new, obj in [
        ("flexentropy.prefill", "select_blocks", "flexentropy", fe.select_blocks),
        ("flexentropy.prefill", "SparsePlan", "flexentropy", fe.SparsePlan),
        ("flexentropy.prefill.selection", "mass_cover", "flexentropy.policies.prefill.ranking", ranking.mass_cover),
        ("flexentropy.prefill.selection", "fixed_blocks", "flexentropy.policies.prefill.fixed", fixed.fixed_blocks),
        ("flexentropy.prefill.selection", "plan_blocks", "flexentropy.policies.prefill.entropy.selection",
         selection.plan_blocks),
        ("flexentropy.prefill.observation", "candidate_blocks", "flexentropy.policies.prefill.fixed",
         fixed.candidate_blocks),
    ]:
        with pytest.warns(DeprecationWarning, match=f"{module}.{name} has moved: import it from {new} "):
            assert getattr(importlib.import_module(module), name) is obj
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        _ = importlib.import_module("flexentropy.prefill.selection").nothing


def test_no_layer_given_lets_only_the_length_decide() -> None:
    """``layer_idx`` left out is "no layer": only the length decides (a layer of ``dense_layers`` is dense whatever
    its length); it used to default to layer 1, which ran a call dense where ``dense_layers`` held 1."""
    q, k, v = _qkv()
    cfg = EntropyConfig(segment_size=128, block_size=64, dense_prefix=0, dense_layers=(1,))
    assert not fe.select_blocks(q, k, cfg).dense and fe.select_blocks(q, k, cfg, 1).dense
    assert not fe.make_prefill("xattention", cfg).plan(q, k).dense
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(sparse_prefill_attention(q, k, v, cfg, 1, compiled=False), dense)
    policy = fe.make_prefill("entropy", cfg)
    assert policy.runs_dense(None, 1000) is False and policy.runs_dense(1, 1000) is True
    assert policy.runs_dense(None, 0) is True
    assert torch.equal(policy.runs_dense(None, torch.tensor([0, 5, 1000])), torch.tensor([True, False, False]))
    assert fe.make_prefill("dense", cfg).runs_dense(None, 1000) is True


def test_every_front_door_asks_the_policy_whether_to_run_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dense-or-sparse decision is one function, `PrefillPolicy.runs_dense`: told "dense", every front door of
    the prefill runs dense attention (``fe.select_blocks``, ``fe.sparse_prefill_attention`` whole and chunked, a
    policy's ``plan`` and ``attention``, `fe.EntropyAttention`, the vLLM plugin's routing of a step)."""
    from flexentropy.integrations.vllm.routing import route
    from flexentropy.policies import PrefillPolicy

    asked: list[tuple[object, object]] = []

    def dense(self: PrefillPolicy, layer_idx: int | None, key_length: object) -> object:
        asked.append((layer_idx, key_length))
        return key_length >= 0
    monkeypatch.setattr(PrefillPolicy, "runs_dense", dense)
    q, k, v = _qkv(n=1000)
    cfg = EntropyConfig(segment_size=128, block_size=64, dense_prefix=0, dense_layers=())
    reference_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert fe.select_blocks(q, k, cfg, 1).dense and fe.make_prefill("streaming", cfg).plan(q, k).dense
    torch.testing.assert_close(sparse_prefill_attention(q, k, v, cfg, compiled=False), reference_out)
    chunk = sparse_prefill_attention(q[..., 300:, :], k, v, cfg, compiled=False, q_start=300)
    torch.testing.assert_close(chunk, reference_out[..., 300:, :])
    torch.testing.assert_close(fe.make_prefill("xattention", cfg).attention(q, k, v, compiled=False), reference_out)
    layer = fe.EntropyAttention(64, 4, 2, layer_idx=1, config=cfg, compiled=False)
    with torch.no_grad():
        layer(torch.randn(1, 600, 64))
    routing = route(torch.tensor([0, 600, 1200]), torch.tensor([600, 900]), fe.make_prefill("entropy", cfg), 1)
    assert routing.chunks == ()
    assert len(asked) == 7 and asked[-1][0] is None


SMALL_SPARSE = EntropyConfig(segment_size=128, block_size=64, dense_prefix=128, dense_layers=())
"""The geometry of the compiled tests above (640 tokens, head dim 32): one graph for them all."""


def test_keys_and_values_in_the_queries_memory_run_compiled() -> None:
    """Issue 77, item 3: keys and values given as head slices of the queries' tensor (``x, x[:, :2], x[:, 2:]``) made
    Inductor's CPU code fail to compile (CppCompileError: 's24' was not declared); the one path copies them, and the
    output is that of separate tensors."""
    x = _qkv(n=640, d=32)[0]
    out = sparse_prefill_attention(x, x[:, :2], x[:, 2:], SMALL_SPARSE)
    torch.testing.assert_close(out, sparse_prefill_attention(x, x[:, :2].clone(), x[:, 2:].clone(), SMALL_SPARSE))


def test_a_numpy_scale_reaches_the_kernel_as_a_python_float() -> None:
    """Issue 77, item 4: ``scale=np.float64(0.25)`` (or np.float32, np.int64) passed the check, then failed to compile
    (BackendCompilerFailed: FakeTensorMode should not be set)."""
    q, k, v = _qkv(n=640, d=32)
    for scale, value in ((np.float64(0.25), 0.25), (np.float32(0.25), 0.25), (np.int64(1), 1.0)):
        torch.testing.assert_close(sparse_prefill_attention(q, k, v, SMALL_SPARSE, scale=scale),
                                   sparse_prefill_attention(q, k, v, SMALL_SPARSE, scale=value))


@pytest.mark.parametrize(("scale", "error", "match"), [
    (float("inf"), ValueError, "observation_attention.scale must be a finite number > 0, got inf"),
    (float("nan"), ValueError, "observation_attention.scale must be a finite number > 0, got nan"),
    (None, TypeError, "observation_attention.scale must be a number, got NoneType None"),
    ("1", TypeError, "observation_attention.scale must be a number, got str '1'"),
])
def test_observation_attention_refuses_a_scale_it_cannot_use(scale: object, error: type, match: str) -> None:
    """Issue 77, item 9: ``scale=inf`` returned non-finite values, ``scale=None`` a raw TypeError."""
    q, k, _ = _qkv()
    with pytest.raises(error, match=match):
        fe.observation_attention(q, k, 128, 64, scale=scale)
    assert fe.observation_attention(q, k, 128, 64, scale=np.float32(0.5)).isfinite().all()


@pytest.mark.parametrize(("edit", "error", "match"), [
    (lambda plan: dataclasses.replace(plan, blocks=plan.blocks[..., 1:, :]), ValueError,
     r"plan.blocks is \(1, 4, 4, 10\) but these queries need .* = \[1, 4, 5, 10\]"),
    (lambda plan: dataclasses.replace(plan, blocks=plan.blocks[:, :2]), ValueError, r"plan.blocks is \(1, 2, 5, 10\)"),
    (lambda plan: dataclasses.replace(plan, blocks=plan.blocks.float()), TypeError,
     "plan.blocks must be a bool tensor .* got torch.float32"),
    (lambda plan: "plan", TypeError, "plan must be a SparsePlan .* got str 'plan'"),
    (lambda plan: dataclasses.replace(plan, seq_len=-5), ValueError, "plan.seq_len must be an int >= 0, got -5"),
    (lambda plan: dataclasses.replace(plan, block_size=32), ValueError, "plan.block_size must be 64 or 128"),
    (lambda plan: dataclasses.replace(plan, dense="no"), TypeError, "plan.dense must be a bool"),
])
def test_a_plan_is_checked_where_it_enters(edit, error: type, match: str) -> None:
    """Issue 77, item 11: a `SparsePlan` handed to the prefill is checked against the queries and keys: a table of the
    wrong shape ran silently (densely), a float table, ``plan="plan"`` and ``seq_len=-5`` gave raw errors or were
    taken."""
    q, k, v = _qkv(n=640, d=32)
    plan = fe.select_blocks(q, k, SMALL_SPARSE)
    for call in (lambda p: sparse_prefill_attention(q, k, v, SMALL_SPARSE, plan=p, compiled=False),
                 lambda p: fe.make_prefill("streaming", SMALL_SPARSE).attention(q, k, v, plan=p, compiled=False)):
        with pytest.raises(error, match=match):
            call(edit(plan))
