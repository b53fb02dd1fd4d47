"""`fe.fuse_projections`: q/k/v and gate/up as one product each, the forward unchanged (tiny random-config models)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import flexentropy as fe
from flexentropy.surgery.fusion import FusedLinear, FusedMember

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=512, eos_token_id=None, pad_token_id=0)
ARCHS = {"llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
         "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON))}   # Qwen2: q/k/v with biases


def pair(arch: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = ARCHS[arch]().eval()
    fused = ARCHS[arch]().eval()
    fused.load_state_dict(plain.state_dict())
    return plain, fused


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_model_gives_the_same_logits(arch: str) -> None:
    plain, fused = pair(arch)
    assert fe.fuse_projections(fused) == 2 * COMMON["num_hidden_layers"]
    attention = fused.model.layers[0].self_attn
    assert isinstance(attention.qkv_proj, FusedLinear) and isinstance(attention.k_proj, FusedMember)
    assert attention.k_proj.weight.data_ptr() == attention.qkv_proj.weight[64:].data_ptr()   # a view, no copy
    assert torch.equal(attention.k_proj.weight, plain.model.layers[0].self_attn.k_proj.weight)
    assert (attention.v_proj.bias is not None) == (arch == "qwen2")
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = plain(ids).logits
        torch.testing.assert_close(fused(ids).logits, expected, atol=1e-5, rtol=1e-5)
        compiled = torch.compile(fused, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(ids).logits, expected, atol=1e-5, rtol=1e-5)
    # no activation is held once a forward is done
    assert all(group._input is None and group._output is None
               for group in fused.modules() if isinstance(group, FusedLinear))


def test_a_member_fed_another_input_computes_its_own_product() -> None:
    linears = [nn.Linear(8, n) for n in (4, 2, 2)]
    members = [FusedMember(FusedLinear(linears), i) for i in range(3)]
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    outs = [members[0](x), members[1](y), members[2](x)]
    for out, linear, given in zip(outs, linears, (x, y, x), strict=True):
        torch.testing.assert_close(out, linear(given))


def test_static_latent_decoding_on_a_fused_model() -> None:
    """The captured decode path of issue 17 on a fused model: greedy tokens of the unfused model."""
    config = fe.EntropyConfig(segment_size=128, block_size=64, dense_prefix=128, decode_budget=96, decode_window=16,
                              decode_delay=4, recompress_every=8)
    plain, fused = pair("llama")
    fe.fuse_projections(fused)
    ids = torch.randint(1, 128, (1, 200), generator=torch.Generator().manual_seed(2))
    tokens = [fe.greedy_generate(fe.enable(model, config, prefill="dense"), ids,
                                 fe.StaticLatentKVCache(config, model=model), 24, compiled=False)
              for model in (plain, fused)]
    assert torch.equal(tokens[0], tokens[1])


def test_validation() -> None:
    with pytest.raises(ValueError, match="found no group to fuse"):
        fe.fuse_projections(nn.Sequential(nn.Linear(4, 4)))
    plain, fused = pair("llama")
    fe.fuse_projections(fused)
    # issue 69: "found no group to fuse" for a model fused already
    with pytest.raises(ValueError, match=r"fuse_projections: LlamaForCausalLM is already fused \(4 groups, by an "
                                         r"earlier call\): nothing is left to fuse"):
        fe.fuse_projections(fused)


@pytest.mark.parametrize("fuse", [False, True])
def test_chunked_mlps_give_the_same_logits(fuse: bool) -> None:
    """`fe.chunk_mlp`: a prompt longer than the chunk runs its MLPs chunk by chunk (the chunks' rows fill one output)
    with the whole forward's logits, fused or not; ``None`` restores the whole-sequence MLPs."""
    plain, chunked = pair("llama")
    if fuse:
        fe.fuse_projections(chunked)
    calls: list[int] = []
    mlp = chunked.model.layers[0].mlp
    assert fe.chunk_mlp(chunked, 16) == COMMON["num_hidden_layers"]
    mlp.down_proj.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[-2]))  # the chunks
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = plain(ids).logits
        torch.testing.assert_close(chunked(ids).logits, expected, atol=1e-5, rtol=1e-5)
        assert calls == [16, 16, 8]
        torch.testing.assert_close(chunked(ids[:, :12]).logits, plain(ids[:, :12]).logits, atol=1e-5, rtol=1e-5)
        assert calls[3:] == [12]                                                          # short: whole
        assert fe.chunk_mlp(chunked, None) == COMMON["num_hidden_layers"]
        assert "forward" not in mlp.__dict__
        torch.testing.assert_close(chunked(ids).logits, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="chunk_mlp.tokens must be"):
        fe.chunk_mlp(chunked, 0)
    with pytest.raises(ValueError, match="found no MLP in Linear"):
        fe.chunk_mlp(nn.Linear(2, 2), 8)


def test_chunked_mlps_keep_a_wrapper_and_trace_as_one_function() -> None:
    """An MLP whose instance ``forward`` is another library's wrapper runs it on each chunk, and gets it back when
    the chunks are undone. Every chunked MLP's forward is one function bound to it, its chunk size an int on it: a
    compiled decoder layer then serves every layer with one graph (an object per MLP was guarded by identity: a
    graph per layer, the recompile limit at 64 layers)."""
    plain, model = pair("llama")
    first, second = (layer.mlp for layer in model.model.layers)
    wrapped: list[int] = []

    def wrapper(x: torch.Tensor) -> torch.Tensor:
        wrapped.append(x.shape[-2])
        return type(first).forward(first, x)

    first.forward = wrapper
    fe.chunk_mlp(model, 16)
    x = torch.randn(1, 40, COMMON["hidden_size"])
    with torch.no_grad():
        torch.testing.assert_close(first(x), plain.model.layers[0].mlp(x), atol=1e-6, rtol=1e-6)
    assert wrapped == [16, 16, 8]
    fe.chunk_mlp(model, None)
    assert first.forward is wrapper and "forward" not in vars(second)

    fe.chunk_mlp(plain, 16)
    torch._dynamo.reset()
    step = torch.compile(lambda mlp, x: mlp(x), backend="eager")
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for layer in plain.model.layers:    # one step, as the static decode step runs every layer
            torch.testing.assert_close(step(layer.mlp, x[:, :1]), type(layer.mlp).forward(layer.mlp, x[:, :1]))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_fused_model_saves_and_loads_as_the_unfused_one(arch: str, tmp_path: Path) -> None:
    """``save_pretrained`` of a fused model wrote the stacked ``qkv_proj``/``gate_up_proj``, which
    ``from_pretrained`` dropped, loading q/k/v/gate/up as random weights. The state dict now keeps the unfused names
    (views of the stacked weights), and ``load_state_dict`` stacks them back."""
    plain, fused = pair(arch)
    fe.fuse_projections(fused)
    state = fused.state_dict()
    assert state.keys() == plain.state_dict().keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, plain.state_dict()[name]), name
    fused.save_pretrained(tmp_path / "fused")
    plain.save_pretrained(tmp_path / "plain")
    with safe_open(tmp_path / "fused" / "model.safetensors", "pt") as saved, \
            safe_open(tmp_path / "plain" / "model.safetensors", "pt") as expected:
        assert set(saved.keys()) == set(expected.keys())
    loaded = type(plain).from_pretrained(tmp_path / "fused").eval()
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, plain(ids).logits, atol=0, rtol=0)

    torch.manual_seed(5)
    other = ARCHS[arch]().eval()
    fe.fuse_projections(other)
    other.load_state_dict(plain.state_dict())          # an unfused checkpoint into a fused model
    with torch.no_grad():
        torch.testing.assert_close(other(ids).logits, plain(ids).logits, atol=1e-5, rtol=1e-5)
    restored = copy.deepcopy(other)
    restored.load_state_dict(fused.state_dict())       # and its own state dict back
    assert torch.equal(restored.model.layers[1].self_attn.qkv_proj.weight,
                       fused.model.layers[1].self_attn.qkv_proj.weight)
