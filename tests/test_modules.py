"""`flexentropy.entropy_attention.EntropyAttention` and the example model built on it (docs/examples/tiny_lm.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from flexentropy import EntropyConfig
from flexentropy.caches import LatentKVCache
from flexentropy.entropy_attention import EntropyAttention

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "tiny_lm.py"
DENSE = EntropyConfig(dense_prefix=1 << 20, decode_budget=4096)
COVERING = EntropyConfig(segment_size=128, block_size=64, base_budget=4096, coverage=1.0, dense_prefix=128,
                         decode_budget=4096)
SMALL = EntropyConfig(segment_size=128, block_size=64, base_budget=64, dense_prefix=128, decode_budget=160,
                      decode_window=16, decode_delay=4)


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tiny_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_twin(config: EntropyConfig) -> tuple[LlamaAttention, LlamaRotaryEmbedding, EntropyAttention]:
    """HF's LlamaAttention (SDPA) and an EntropyAttention with the same weights: 64 wide, 4 q / 2 kv heads."""
    torch.manual_seed(0)
    hf_config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    hf_config._attn_implementation = "sdpa"
    reference = LlamaAttention(hf_config, layer_idx=1).eval()
    ours = EntropyAttention(64, 4, 2, layer_idx=1, config=config, rope_theta=10000.0).eval()
    ours.load_state_dict(reference.state_dict())
    return reference, LlamaRotaryEmbedding(hf_config), ours


@torch.no_grad()
def test_matches_llama_attention_in_prefill_and_decode() -> None:
    reference, rotary, ours = llama_twin(COVERING)
    x = torch.randn(2, 700, 64)
    ref_cache, our_cache = DynamicCache(), LatentKVCache(COVERING)
    for start, stop in ((0, 640), (640, 641), (641, 642), (642, 700)):  # prompt, two tokens, then a chunk
        step = x[:, start:stop]
        positions = torch.arange(start, stop)[None]
        # HF's SDPA needs an explicit mask for a chunk after a past (its is_causal is top-left aligned)
        mask = None if stop - start == 1 or start == 0 else positions[0, :, None] >= torch.arange(stop)
        expected, _ = reference(step, rotary(step, positions), mask, ref_cache)
        got = ours(step, our_cache)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=f"tokens {start}..{stop}")
    assert our_cache.get_seq_length(1) == 700


@torch.no_grad()
def test_small_budgets_differ_from_dense_but_stay_causal_and_finite() -> None:
    _, _, ours = llama_twin(SMALL)
    x = torch.randn(1, 640, 64)
    out = ours(x)
    assert out.shape == x.shape and torch.isfinite(out).all()
    ours.config = DENSE
    assert not torch.allclose(out, ours(x), atol=1e-4)
    ours.config = SMALL.replace(entropy_threshold=1e-30, dense_last_segment=False)  # plans depend on the past only
    changed = torch.cat([x[:, :384], torch.randn(1, 256, 64)], dim=1)
    torch.testing.assert_close(ours(changed)[:, :384], ours(x)[:, :384])


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        EntropyAttention(64, 4, 3, layer_idx=1)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        EntropyAttention(60, 8, layer_idx=1)
    with pytest.raises(ValueError, match="head_dim must be even"):
        EntropyAttention(64, 4, head_dim=15, layer_idx=1)
    with pytest.raises(ValueError, match="layer_idx"):
        EntropyAttention(64, 4, layer_idx=-1)
    with pytest.raises(TypeError, match="EntropyConfig"):
        EntropyAttention(64, 4, layer_idx=1, config={"base_budget": 64})
    attention = EntropyAttention(64, 4, layer_idx=1)
    with pytest.raises(ValueError, match=r"\[batch, seq_len, hidden_size=64\]"):
        attention(torch.randn(2, 5, 32))
    with pytest.raises(TypeError, match="update\\(\\) and get_seq_length\\(\\)"):
        attention(torch.randn(2, 5, 64), cache={})
    # bf16 states into float32 weights got torch's matmul dtype error
    with pytest.raises(TypeError, match=r"EntropyAttention's weights are torch.float32 but hidden_states are "
                                        r"torch.bfloat16: cast one to the other \(module.to\(torch.bfloat16\) or "
                                        r"hidden_states.to\(torch.float32\)\)"):
        attention(torch.randn(2, 5, 64, dtype=torch.bfloat16))
    # token ids (int64) were told to cast the module to their dtype: module.to(torch.int64)
    with pytest.raises(TypeError, match=r"EntropyAttention takes floating hidden_states \(its weights are "
                                        r"torch.float32\), got torch.int64: embed token ids first"):
        attention(torch.zeros(2, 5, 64, dtype=torch.long))
    sized = EntropyAttention(np.int64(64), np.int64(4), np.int32(2), layer_idx=np.int64(1), head_dim=np.int64(16))
    assert (sized.hidden_size, sized.num_kv_heads, sized.head_dim, sized.layer_idx) == (64, 2, 16, 1)
    assert type(sized.hidden_size) is int
    with torch.no_grad():
        assert attention.to(torch.bfloat16)(torch.randn(2, 5, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
        assert sized(torch.randn(1, 3, 64)).shape == (1, 3, 64)


def test_a_dtype_position_ids_or_flag_it_cannot_take_is_refused() -> None:
    """Issue 77: ``dtype=torch.int64`` got torch's "Only Tensors of floating point ... can require gradients",
    position_ids of the wrong length torch's expand error, and ``compiled="no"`` compiled."""
    with pytest.raises(TypeError, match=r"EntropyAttention's weights take a floating dtype \(torch.float16, "
                                        r"torch.bfloat16, torch.float32 or torch.float64\) or None .*got torch.int64"):
        EntropyAttention(64, 4, 2, layer_idx=0, dtype=torch.int64)
    for name in ("compiled", "bias"):
        with pytest.raises(TypeError, match=rf"EntropyAttention.{name} must be a bool \(True or False\), got str"):
            EntropyAttention(64, 4, 2, layer_idx=0, **{name: "no"})
    attention = EntropyAttention(64, 4, 2, layer_idx=0, compiled=False)
    hidden = torch.randn(2, 10, 64)
    for positions in (torch.arange(7), torch.arange(20).view(2, 10)[:, None], torch.arange(30).view(3, 10)):
        got = re.escape(str(list(positions.shape)))
        with pytest.raises(ValueError, match=r"position_ids must be \[B=2, L=10\] or \[L=10\] \(a position per token "
                                             rf"of hidden_states \[2, 10, 64\]\), got {got}"):
            attention(hidden, position_ids=positions)
    for positions, got in ((torch.arange(10.0), "torch.float32"), (list(range(10)), "list")):
        with pytest.raises(TypeError, match=f"position_ids must be an integer tensor, got {got}"):
            attention(hidden, position_ids=positions)
    with torch.no_grad():
        expected = attention(hidden)
        for positions in (torch.arange(10), torch.arange(10)[None], torch.arange(10).expand(2, 10)):
            assert torch.equal(attention(hidden, position_ids=positions), expected)


def test_an_empty_batch_or_sequence_gives_an_empty_output() -> None:
    """Issue 69: ``[1, 0, D]`` and ``[0, T, D]`` raised torch's reshape error. Each gives an empty output of its
    shape, with or without a cache, and the cache, empty or holding a prompt, is left as it was."""
    attention = EntropyAttention(64, 4, 2, layer_idx=1, head_dim=16, config=EntropyConfig(decode_budget=64,
                                                                                          decode_window=8))
    cache = LatentKVCache(attention.config)
    with torch.no_grad():
        for shape in ((1, 0, 64), (0, 5, 64), (0, 0, 64)):
            for given in (None, cache):
                out = attention(torch.randn(shape), given)
                assert out.shape == shape and out.dtype == torch.float32, (shape, given)
        assert cache.layers == []
        prompt = torch.randn(1, 5, 64)
        expected = attention(prompt, LatentKVCache(attention.config))
        assert torch.equal(attention(prompt, cache), expected)
        assert attention(torch.randn(1, 0, 64), cache).shape == (1, 0, 64)
        assert cache.get_seq_length(1) == 5 and cache.layers[1].observed == 5


def test_example_model_generates_like_dense_and_evicts() -> None:
    example = load_example()
    torch.manual_seed(0)
    prompt = torch.randint(0, 256, (1, 640))
    dense = example.TinyLM(config=DENSE).eval()
    expected = dense.generate(prompt, 12, LatentKVCache(DENSE))
    covering = example.TinyLM(config=COVERING).eval()
    covering.load_state_dict(dense.state_dict())
    assert torch.equal(covering.generate(prompt, 12, LatentKVCache(COVERING)), expected)

    small = example.TinyLM(config=SMALL).eval()
    small.load_state_dict(dense.state_dict())
    cache = LatentKVCache(SMALL)
    tokens = small.generate(prompt, 12, cache)
    assert tokens.shape == (1, 652) and torch.equal(tokens[:, :640], prompt)
    assert cache.stored_length(1) < cache.get_seq_length(1) == 651


def test_example_model_decodes_over_a_ragged_policy_cache() -> None:
    """A cache with ``attend`` (AdaKV: per-head budgets stored ragged) is read through it, not through update()."""
    from flexentropy.caches import make_cache

    example = load_example()
    torch.manual_seed(0)
    model = example.TinyLM(config=SMALL).eval()
    cache = make_cache("adakv", num_layers=2, budget=128)
    with torch.no_grad():
        logits = model(torch.randint(0, 256, (2, 640)), cache)
        for _ in range(3):
            logits = model(logits[:, -1:].argmax(-1), cache)
    assert cache.is_ragged(1) and torch.isfinite(logits).all()


@pytest.mark.slow
def test_example_model_under_torch_compile() -> None:
    example = load_example()
    torch.manual_seed(0)
    model = example.TinyLM(config=SMALL).eval()
    prompt = torch.randint(0, 256, (1, 640))
    compiled = torch.compile(model)
    with torch.no_grad():
        expected = model(prompt)
        torch.testing.assert_close(compiled(prompt), expected, atol=1e-5, rtol=1e-5)
