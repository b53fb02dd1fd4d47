"""transformers integration (flexentropy.integrations.hf) on tiny random models of every supported architecture.

Dense twins are the same weights with HF's own ``"sdpa"`` attention. With budgets that cover every key block the
flexentropy model must generate the dense tokens; with small budgets it must run, stay causal and finite, and a
left-padded batch must give each row the tokens of its solo run.
"""

from __future__ import annotations

import copy
import math
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from flexentropy import EntropyConfig, generate_batch, greedy_generate, warm_up
from flexentropy import chunk_mlp as fe_chunk_mlp
from flexentropy.caches import LatentKVCache, StaticLatentKVCache, keywords, make_cache
from flexentropy.caches.conversation import ConversationIds
from flexentropy.integrations import hf
from flexentropy.integrations.hf import enable, prefill_density
from flexentropy.kv.decode_attention import grouped_attention, kept_columns
from flexentropy.policies import PrefillPolicy
from flexentropy.surgery.chunked_mlp import MLP_CHUNK, chunked_tokens

VOCAB = 256
PROMPT = 640  # 5 segments of 128: segment 0 dense (dense_prefix), 1-3 sparse, 4 dense (last)
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=4096, bos_token_id=1, eos_token_id=None, pad_token_id=0)
ARCHS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16)),  # q/k norm
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 4}, head_dim=16, query_pre_attn_scalar=16, sliding_window=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
}
COVERING = EntropyConfig(segment_size=128, block_size=64, base_budget=4096, coverage=1.0, dense_prefix=128,
                         decode_budget=4096)
SMALL = EntropyConfig(segment_size=128, block_size=64, base_budget=64, dense_prefix=128, decode_budget=160,
                      decode_window=16, decode_delay=4)


def twins(arch: str, config: EntropyConfig) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(dense, flexentropy)``: one random model of ``arch`` and a copy enabled with ``config``."""
    torch.manual_seed(0)
    dense = ARCHS[arch]().eval()
    sparse = ARCHS[arch]().eval()
    sparse.load_state_dict(dense.state_dict())
    return dense, enable(sparse, config)


def prompt(length: int = PROMPT, seed: int = 1, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model: torch.nn.Module, ids: torch.Tensor | None, new: int = 8, **kwargs: object) -> torch.Tensor:
    """The ``new`` greedily generated tokens ``[B, new]`` (``ids`` None: the prompt given as ``inputs_embeds``)."""
    out = model.generate(ids, max_new_tokens=new, do_sample=False, **kwargs)
    return out if ids is None else out[:, ids.shape[1]:]


def sparse_layers(model: torch.nn.Module, config: EntropyConfig) -> list[int]:
    """Layers that go sparse: global attention and not in ``config.dense_layers``."""
    return [m.layer_idx for m in hf.attention_modules(model)
            if getattr(m, "sliding_window", None) is None and m.layer_idx not in config.dense_layers]


@pytest.mark.parametrize("arch", ARCHS)
def test_covering_budgets_generate_the_dense_tokens(arch: str) -> None:
    dense, model = twins(arch, COVERING)
    ids = prompt()
    plan = mock.patch.object(PrefillPolicy, "layer_plan", autospec=True, side_effect=PrefillPolicy.layer_plan)
    with plan as planned, torch.no_grad():
        logits = model(ids).logits
        assert sorted(c.args[3] for c in planned.call_args_list) == sparse_layers(model, COVERING)
        torch.testing.assert_close(logits, dense(ids).logits, atol=2e-4, rtol=1e-4)
    assert prefill_density(model) == 1.0
    expected = greedy(dense, ids)
    assert torch.equal(greedy(model, ids), expected)
    # the installed transformers' own keyword (`cache` from 5.24) and `past_key_values` (5.17-5.23; an alias after)
    for keyword in dict.fromkeys((hf.cache_keyword(model), "past_key_values")):
        cache = LatentKVCache(COVERING)
        assert torch.equal(greedy(model, ids, **{keyword: cache}), expected), keyword
        for module in hf.attention_modules(model):  # sliding-window layers keep their window, as transformers' cache
            window = getattr(module, "sliding_window", None)
            stored = cache.stored_length(module.layer_idx)
            assert stored == (PROMPT + 7 if window is None else window), (module.layer_idx, stored)
            assert cache.get_seq_length(module.layer_idx) == PROMPT + 7
            assert cache.layers[module.layer_idx].observed == PROMPT + 7  # the queries were handed over


REUSED_CACHES = {
    "latent": lambda model: LatentKVCache(COVERING),
    "full": lambda model: make_cache("full", model=model),
    "snapkv": lambda model: make_cache("snapkv", model=model, budget=4096, window=16),
}


@pytest.mark.parametrize("name", REUSED_CACHES)
def test_a_new_prompt_on_a_used_cache_asks_for_reset_and_a_later_turn_continues(name: str) -> None:
    """A second ``generate`` with a new prompt on a used cache gave silently wrong tokens (``generate`` fed the new
    prompt's tail after the old conversation); it now raises and says to reset. After ``reset`` the cache gives the
    dense tokens, and a later turn of the same conversation (the whole conversation passed to ``generate``) gives
    the dense model's later turn."""
    dense, model = twins("llama", COVERING)
    enable(model, COVERING, prefill="dense")
    ids, other = prompt(300), prompt(250, seed=2)
    cache = REUSED_CACHES[name](model)
    first = greedy(model, ids, attention_mask=torch.ones_like(ids), past_key_values=cache)
    with pytest.raises(ValueError, match=r"holds a conversation of 307 tokens, and generate's 250 tokens do not go "
                                         r"past them: a new prompt on a used cache: call cache.reset\(\)"):
        greedy(model, other, attention_mask=torch.ones_like(other), past_key_values=cache)
    cache.reset()
    assert torch.equal(greedy(model, other, past_key_values=cache), greedy(dense, other))
    with pytest.raises(ValueError, match=r"start at position 0, not 257"):   # a forward given the prompt's positions
        model(ids, position_ids=torch.arange(300)[None], past_key_values=cache)

    conversation = torch.cat([ids, first, prompt(20, seed=3)], dim=1)
    dense_cache, cache = DynamicCache(config=dense.config), REUSED_CACHES[name](model)
    for net, used in ((dense, dense_cache), (model, cache)):
        assert torch.equal(greedy(net, ids, past_key_values=used), first)
    assert torch.equal(greedy(model, conversation, attention_mask=torch.ones_like(conversation), past_key_values=cache),
                       greedy(dense, conversation, attention_mask=torch.ones_like(conversation),
                              past_key_values=dense_cache))
    assert cache.get_seq_length() == conversation.shape[1] + 7


@pytest.mark.parametrize("arch", ARCHS)
def test_small_budgets_run_finite_and_causal(arch: str) -> None:
    # a tiny entropy threshold makes every head dynamic and the last segment sparse, so the plan of a segment depends
    # on nothing after it: changing the tokens from a segment boundary on must not change the logits before it
    config = SMALL.replace(entropy_threshold=1e-30, dense_last_segment=False)
    _, model = twins(arch, config)
    ids = prompt()
    changed = ids.clone()
    boundary = 3 * config.segment_size
    changed[:, boundary:] = prompt(PROMPT - boundary, seed=2)
    with torch.no_grad():
        logits = model(ids).logits
        density = prefill_density(model)
        other = model(changed).logits
    assert torch.isfinite(logits).all()
    assert density < 1.0
    torch.testing.assert_close(other[:, :boundary], logits[:, :boundary], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(other[:, boundary:], logits[:, boundary:])

    cache = LatentKVCache(config)
    tokens = greedy(model, ids, new=12, past_key_values=cache)
    assert tokens.shape == (1, 12) and ((tokens >= 0) & (tokens < VOCAB)).all()
    assert cache.stored_length(1) < cache.get_seq_length(1)  # evicted: the queries were handed over


def test_keep_plans_false_keeps_the_density_not_the_plans() -> None:
    _, model = twins("llama", SMALL)
    ids = prompt()
    with torch.no_grad():
        logits = model(ids).logits
        kept = [m.layer_idx for m in hf.attention_modules(model) if hf.layer_state(m).plans[0] is not None]
        density = prefill_density(model)
        enable(model, SMALL, keep_plans=False)
        torch.testing.assert_close(model(ids).logits, logits, atol=0, rtol=0)
    states = [hf.layer_state(m) for m in hf.attention_modules(model)]
    assert kept == sparse_layers(model, SMALL) and all(s.plans == [] for s in states)
    assert [d is None for s in states for d in s.densities] == [i not in sparse_layers(model, SMALL)
                                                                 for i in range(len(states))]
    assert prefill_density(model) == pytest.approx(density) and density < 1.0


def left_padded(lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``(ids [B, max], attention_mask [B, max], solo prompts)`` for prompts of ``lengths``, left-padded with 0."""
    solos = [prompt(n, seed=10 + i) for i, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, solo in enumerate(solos):
        ids[row, width - solo.shape[1]:] = solo[0]
        mask[row, width - solo.shape[1]:] = 1
    return ids, mask, solos


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_batch_rows_equal_solo_runs(arch: str) -> None:
    ids, mask, solos = left_padded((PROMPT, 500))
    dense, model = twins(arch, COVERING)
    batch = greedy(model, ids, attention_mask=mask, past_key_values=LatentKVCache(COVERING))
    for row, solo in enumerate(solos):
        assert torch.equal(batch[row], greedy(dense, solo)[0]), f"covering budgets, row {row}"

    enable(model, SMALL)
    with mock.patch.object(PrefillPolicy, "layer_plan", autospec=True, side_effect=PrefillPolicy.layer_plan) as planned:
        batch = greedy(model, ids, attention_mask=mask)
    rows = [c.args[1].shape[2] for c in planned.call_args_list]  # each row's real tokens, planned on their own
    assert rows == [PROMPT, 500] * len(sparse_layers(model, SMALL))
    for row, solo in enumerate(solos):
        assert torch.equal(batch[row], greedy(model, solo)[0]), f"small budgets, row {row}"


PADDED_CACHES = {  # every cache policy evicting well inside the prompt (a 300-token row has 340 padding tokens)
    "latent": lambda model: LatentKVCache(SMALL),
    "snapkv": lambda model: make_cache("snapkv", budget=160, window=16),
    "adakv": lambda model: make_cache("adakv", budget=160, window=16),
    "pyramidkv": lambda model: make_cache("pyramidkv", model=model, budget=160, window=16),
    "h2o": lambda model: make_cache("h2o", budget=160),
    "streamingllm": lambda model: make_cache("streamingllm", budget=160),
    "infokv": lambda model: make_cache("infokv", model=model, budget=160, window=16, compress_every=64),
}  # not `bounded`: its recent window is chunk-aligned on the batch's positions (its docstring)


@pytest.mark.parametrize("name", PADDED_CACHES)
def test_left_padded_batch_with_eviction_equals_solo_runs(name: str) -> None:
    """Padding entries are never scored, never sinks and rank below real entries: each row keeps (and generates)
    what it would alone."""
    ids, mask, solos = left_padded((PROMPT, 300))
    _, model = twins("llama", SMALL)
    cache = PADDED_CACHES[name](model)
    batch = greedy(model, ids, new=12, attention_mask=mask, past_key_values=cache)
    assert cache.stored_length(1) < cache.get_seq_length(1)
    for row, solo in enumerate(solos):
        solo_cache = PADDED_CACHES[name](model)
        alone = greedy(model, solo, new=12, past_key_values=solo_cache)
        assert torch.equal(batch[row], alone[0]), f"{name}, row {row}"
        if not cache.is_ragged(1):  # the same entries kept, counted from the row's first real token
            assert torch.equal(cache.layers[1].row_positions()[row], solo_cache.layers[1].row_positions()[0])


def test_observe_padding_reads_left_padding_only() -> None:
    cache = make_cache("snapkv", budget=160, window=16)
    real = torch.tensor([[False, False, True, True], [True, True, True, True]])
    cache.observe_padding(real, 0)
    assert cache.layers[0].padding.tolist() == [2, 0]
    cache.observe_padding(torch.tensor([[True, False, True, True]]), 1)   # a hole: not left padding, ignored
    assert cache.layers[1].padding is None
    with pytest.raises(ValueError, match="bool"):
        cache.observe_padding(real.long(), 0)
    with pytest.raises(ValueError, match=r"row 1 of the prompt ends in padding \(right padding\).*Pad on the left"):
        cache.observe_padding(torch.tensor([[True, True, True], [True, True, False]]), 0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_right_padded_batch_gives_the_dense_tokens_or_asks_for_left_padding(arch: str) -> None:
    """A right-padded batch through ``generate``: the padded row's tokens follow its padding, as transformers warns.
    With transformers' own cache they are dense's (the sparse prefill gave the padding's queries no attention, so the
    padded row's first token differed); a flexentropy cache, whose evictions read left padding only, refuses the
    batch and says to pad on the left."""
    ids, mask, _ = left_padded((PROMPT, 500))
    ids[1], mask[1] = ids[1].roll(-(PROMPT - 500)), mask[1].roll(-(PROMPT - 500))   # the same row, right-padded
    assert not mask[1, -1]
    dense, model = twins(arch, SMALL)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*right-padding was detected")
        expected = greedy(dense, ids, attention_mask=mask)
        assert torch.equal(greedy(model, ids, attention_mask=mask), expected)
        assert prefill_density(model) < 1.0                                   # the rows went sparse
        for cache in (LatentKVCache(SMALL), make_cache("full", model=model)):
            with pytest.raises(ValueError, match=r"batch row 1 of the prompt ends in padding.*Pad on the left"):
                greedy(model, ids, attention_mask=mask, past_key_values=cache)


def test_a_cache_filled_by_one_model_refuses_a_model_of_another_depth() -> None:
    """A `LatentKVCache` filled on a 3-layer model continued on a 2-layer one: the 2-layer model read the other's
    entries, and the third layer's stayed behind; it now raises and names `reset`, after which the cache serves the
    other model."""
    three = enable(ARCHS["llama"]().eval(), SMALL)
    two = enable(LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": 2})).eval(), SMALL)
    ids, cache = prompt(300), LatentKVCache(SMALL, model=three)
    conversation = three.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=cache)
    with pytest.raises(ValueError, match=r"a model of 2 layers runs on a LatentKVCache that a model of 3 layers "
                                         r"filled.*cache.reset\(\)"):
        two.generate(conversation, max_new_tokens=4, do_sample=False, past_key_values=cache)
    cache.reset()
    assert torch.equal(greedy(two, ids, past_key_values=cache), greedy(two, ids, past_key_values=LatentKVCache(SMALL)))


STATIC_SMALL = SMALL.replace(recompress_every=8)
REFUSING_CACHES = {  # every cache make_cache builds, evicting inside the conversation, and the static cache
    "full": lambda model: make_cache("full", model=model),
    "latent": lambda model: make_cache("latent", model=model, budget=160, window=16, delay=4, recompress_every=8),
    "snapkv": lambda model: make_cache("snapkv", model=model, budget=160, window=16),
    "adakv": lambda model: make_cache("adakv", model=model, budget=160, window=16),
    "pyramidkv": lambda model: make_cache("pyramidkv", model=model, budget=160, window=16),
    "streamingllm": lambda model: make_cache("streamingllm", model=model, budget=160),
    "h2o": lambda model: make_cache("h2o", model=model, budget=160),
    "infokv": lambda model: make_cache("infokv", model=model, budget=160, window=16, compress_every=64),
    "bounded": lambda model: make_cache("bounded", model=model, sinks=4, anchors=64, recent=64, chunk=16, window=16),
    "static": lambda model: StaticLatentKVCache(STATIC_SMALL, model=model),
    "static, prompt buffers": lambda model: StaticLatentKVCache(STATIC_SMALL, model=model, max_prompt_length=400),
}


def held_state(value: object, memo: set[int] | None = None) -> object:
    """Everything ``value`` (a cache) holds, recursively through its objects' attributes: numbers as they are, every
    tensor as its address, dtype, shape and a copy of its contents."""
    memo = set() if memo is None else memo
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), value.dtype, tuple(value.shape), value.detach().clone())
    if isinstance(value, list | tuple):
        return [held_state(item, memo) for item in value]
    if isinstance(value, dict):
        return {key: held_state(item, memo) for key, item in value.items()}
    if not hasattr(value, "__dict__") or id(value) in memo:
        return value if not hasattr(value, "__dict__") else ("object", id(value))
    memo.add(id(value))
    return {name: held_state(item, memo) for name, item in vars(value).items()}


def assert_same_state(got: object, expected: object, path: str = "cache") -> None:
    """`held_state` ``got`` equals ``expected``: the same numbers, tensors at the same addresses with the same bits
    (NaNs of uninitialised buffers included)."""
    assert type(got) is type(expected), path
    if isinstance(got, tuple) and got and got[0] == "tensor":
        assert got[:4] == expected[:4], path
        torch.testing.assert_close(got[4], expected[4], rtol=0, atol=0, equal_nan=True, msg=path)
    elif isinstance(got, list):
        assert len(got) == len(expected), path
        for index, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_same_state(a, b, f"{path}[{index}]")
    elif isinstance(got, dict):
        assert got.keys() == expected.keys(), path
        for key in got:
            assert_same_state(got[key], expected[key], f"{path}.{key}")
    else:
        assert got == expected, path


def used_caches(name: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, object, object]:
    """``(model, ids, first, clean, cache)``: a Llama switched with ``STATIC_SMALL`` (dense prefill), a prompt of 300
    tokens, its 12 greedy tokens, and two caches of `REFUSING_CACHES` ``name`` that each generated them."""
    _, model = twins("llama", STATIC_SMALL)
    enable(model, STATIC_SMALL, prefill="dense")
    keyword = hf.cache_keyword(model)
    ids = prompt(300)
    clean, cache = REFUSING_CACHES[name](model), REFUSING_CACHES[name](model)
    first = greedy(model, ids, new=12, **{keyword: clean})
    assert torch.equal(greedy(model, ids, new=12, **{keyword: cache}), first)
    return model, ids, first, clean, cache


@pytest.mark.parametrize("name", REFUSING_CACHES)
def test_a_refused_forward_leaves_the_cache_as_it_was(name: str) -> None:
    """Issue 69: a new prompt on a used cache, a model of another depth or a batch of another size was refused only
    after layer 0 had stored its tokens, and the conversation the cache held then failed when it went on. Each is
    now refused before anything is written: every cache holds what it held (lengths, entries, counters, the static
    phase's buffers, at their addresses), and the conversation's next turn gets the tokens of a cache that never saw
    the refused forwards."""
    model, ids, first, clean, cache = used_caches(name)
    two = enable(LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": 2})).eval(), STATIC_SMALL,
                 prefill="dense")
    keyword = hf.cache_keyword(model)
    conversation = torch.cat([ids, first, prompt(20, seed=3)], dim=1)
    held = held_state(cache)
    refused = {
        r"holds a conversation of 311 tokens, and generate's 250 tokens do not go past them: a new prompt on a used "
        r"cache": lambda: greedy(model, prompt(250, seed=2), **{keyword: cache}),
        r"start at position 0, not 311": lambda: model(ids, position_ids=torch.arange(300)[None], **{keyword: cache}),
        r"a model of 2 layers runs on a|built for 3 layers, but a model of 2 layers":
            lambda: greedy(two, conversation, **{keyword: cache}),
        r"a forward of 2 batch rows: expected batch_size 1": lambda: greedy(model, conversation.expand(2, -1),
                                                                            **{keyword: cache}),
    }
    for message, run in refused.items():
        with pytest.raises(ValueError, match=message), torch.no_grad():
            run()
        assert_same_state(held_state(cache), held, f"{name} after {message!r}")
    assert torch.equal(greedy(model, conversation, new=12, **{keyword: cache}),
                       greedy(model, conversation, new=12, **{keyword: clean}))


@pytest.mark.parametrize("name", ["latent", "static"])
def test_a_new_prompt_longer_or_shorter_than_the_conversation_is_refused(name: str) -> None:
    """Issue 77: a new prompt longer than the conversation a used cache holds was taken silently (``generate`` fed
    its tokens past the cache's length, after the old conversation's entries), and a shorter one got internal
    errors. The cache now keeps the conversation's ids (``generate``'s, handed over by the hook on
    ``prepare_inputs_for_generation``; decode steps recorded, compared once per ``generate``) and refuses a new
    prompt, naming ``cache.reset()``, before anything is written: one that differs from the first token, from a later
    one, or only in a token the cache generated, and one no longer than the conversation. The later turn then gets the
    tokens of a cache that never saw the refused prompts, whether ``generate`` is given the whole conversation or its
    new tokens with the whole attention mask; a prompt fed by forwards in chunks is known too."""
    model, ids, first, clean, cache = used_caches(name)
    keyword = hf.cache_keyword(model)
    held = held_state(cache)
    changed = torch.cat([ids, first], dim=1)
    changed[0, 305] = (changed[0, 305] + 1) % VOCAB   # a token the cache generated
    refused = {
        "500 tokens differ from them at token 0": prompt(500, seed=2),
        "400 tokens differ from them at token 100": torch.cat([ids[:, :100], prompt(300, seed=2)], dim=1),
        "331 tokens differ from them at token 305": torch.cat([changed, prompt(19, seed=3)], dim=1),
        "150 tokens do not go past them": prompt(150, seed=2),
        "311 tokens do not go past them": torch.cat([ids, first[:, :-1]], dim=1),
    }
    for why, other in refused.items():
        with pytest.raises(ValueError, match=rf"{type(cache).__name__} holds a conversation of 311 tokens, and "
                                             rf"generate's {why}: a new prompt on a used cache: call cache.reset\(\) "
                                             rf"\(or use a new cache\)"):
            greedy(model, other, new=4, **{keyword: cache})
        assert_same_state(held_state(cache), held, f"{name} after {why!r}")
    conversation = torch.cat([ids, first, prompt(20, seed=3)], dim=1)
    expected = greedy(model, conversation, new=12, **{keyword: clean})
    with mock.patch.object(ConversationIds, "first_difference", autospec=True,
                           side_effect=ConversationIds.first_difference) as compared:
        assert torch.equal(greedy(model, conversation, new=12, **{keyword: cache}), expected)
    assert compared.call_count == 1   # the turn's first forward; none in its decode steps

    new_tokens = REFUSING_CACHES[name](model)
    greedy(model, ids, new=12, **{keyword: new_tokens})
    turn = torch.cat([first[:, -1:], conversation[:, 312:]], dim=1)   # what the cache does not hold yet
    assert torch.equal(greedy(model, turn, new=12, attention_mask=torch.ones_like(conversation),
                              **{keyword: new_tokens}), expected)

    chunks = REFUSING_CACHES[name](model)
    with torch.no_grad():
        model(ids[:, :200], **{keyword: chunks})
        model(ids[:, 200:299], **{keyword: chunks})
    with pytest.raises(ValueError, match="generate's 500 tokens differ from them at token 199"):
        greedy(model, torch.cat([ids[:, :199], prompt(301, seed=2)], dim=1), new=4, **{keyword: chunks})
    assert greedy(model, ids, new=4, **{keyword: chunks}).shape == (1, 4)   # the chunks' ids, continued


def test_a_prompt_given_as_embeddings_is_checked_by_its_length() -> None:
    """``generate(inputs_embeds=...)`` on a switched model with a flexentropy cache (its hook on
    ``prepare_inputs_for_generation`` keeps the class's signature, which ``generate`` reads): embeddings have no
    ids, so a later turn given as embeddings goes on unchecked, with the tokens of a dense cache, and only a prompt
    no longer than the conversation is refused; the tokens the cache generated are known, and ids that change one
    of them are refused."""
    dense, model = twins("llama", COVERING)
    enable(model, COVERING, prefill="dense")
    embed = model.get_input_embeddings()
    ids, cache, dense_cache = prompt(300), LatentKVCache(COVERING), DynamicCache(config=dense.config)
    with torch.no_grad():
        first = greedy(model, None, inputs_embeds=embed(ids), past_key_values=cache)
        assert torch.equal(greedy(dense, None, inputs_embeds=embed(ids), past_key_values=dense_cache), first)
        conversation = torch.cat([ids, first, prompt(20, seed=3)], dim=1)
        later = greedy(model, None, inputs_embeds=embed(conversation), past_key_values=cache)
        assert torch.equal(later, greedy(dense, None, inputs_embeds=embed(conversation), past_key_values=dense_cache))
        with pytest.raises(ValueError, match=r"holds a conversation of 335 tokens, and generate's inputs_embeds of "
                                             r"150 tokens do not go past them: a new prompt on a used cache"):
            greedy(model, None, inputs_embeds=embed(prompt(150, seed=2)), past_key_values=cache)
        changed = torch.cat([conversation, later], dim=1)
        changed[0, 330] = (changed[0, 330] + 1) % VOCAB
        with pytest.raises(ValueError, match="differ from them at token 330"):
            greedy(model, changed, past_key_values=cache)


def test_a_prompt_prefilled_in_chunks_gives_the_tokens_of_one_prefill() -> None:
    """``generate(prefill_chunk_size=...)``: transformers >= 5.24 hands over each chunk's ids and positions and no
    mask of ones, so the conversation's length is read from the chunk's last position; the chunks after the first
    were refused as a new prompt no longer than the conversation."""
    _, model = twins("llama", STATIC_SMALL)
    enable(model, STATIC_SMALL, prefill="dense")
    keyword, ids = hf.cache_keyword(model), prompt(300)
    for name in ("latent", "static"):
        whole = greedy(model, ids, new=4, **{keyword: REFUSING_CACHES[name](model)})
        assert torch.equal(greedy(model, ids, new=4, prefill_chunk_size=128, **{keyword: REFUSING_CACHES[name](model)}),
                           whole), name


@pytest.mark.parametrize("name", ["latent", "static"])
def test_a_disabled_model_on_its_cache_says_to_enable_it(name: str) -> None:
    """Issue 77: after ``fe.disable(model)``, continuing a conversation with its cache stored the turn (SDPA hands
    over no queries) and failed a step later with an internal message about ``observe_queries``; a static cache's
    steps would not have advanced. The first write of such a forward is now refused, before anything is written,
    saying to enable the model; enabled again, the conversation goes on as if the forwards had never come."""
    model, ids, first, clean, cache = used_caches(name)
    keyword = hf.cache_keyword(model)
    held = held_state(cache)
    conversation = torch.cat([ids, first, prompt(20, seed=3)], dim=1)
    hf.disable(model)
    for run in (lambda: greedy(model, conversation, new=4, **{keyword: cache}),
                lambda: model(first[:, -1:], **{keyword: cache})):
        with pytest.raises(RuntimeError, match=r"call flexentropy.enable\(model\) before running the model with this "
                                               r"cache"), torch.no_grad():
            run()
        assert_same_state(held_state(cache), held, name)
    enable(model, STATIC_SMALL, prefill="dense")
    assert torch.equal(greedy(model, conversation, new=12, **{keyword: cache}),
                       greedy(model, conversation, new=12, **{keyword: clean}))


def test_crop_is_refused_and_batch_rows_are_repeated_or_selected() -> None:
    """Issue 77: ``cache.crop(20)`` and ``cache.batch_repeat_interleave(2)`` after a ``generate`` raised an
    AttributeError on ``PolicyLayer``, and ``update`` took int64 keys and values. ``crop`` is refused, saying why and
    what to do, unless it removes nothing (what the cache keeps follows every token it saw); repeated or selected
    rows continue as the rows they copy; a `StaticLatentKVCache` refuses both; ``update`` refuses non-floating
    keys and values."""
    _, model = twins("llama", STATIC_SMALL)
    enable(model, STATIC_SMALL, prefill="dense")
    keyword = hf.cache_keyword(model)
    pair, new = prompt(300, batch=2), prompt(20, seed=3, batch=2)
    solo = [REFUSING_CACHES["latent"](model) for _ in pair]
    first = [greedy(model, row[None], new=12, **{keyword: cache}) for row, cache in zip(pair, solo, strict=True)]
    conversations = torch.cat([pair, torch.cat(first), new], dim=1)
    later = [greedy(model, row[None], new=12, **{keyword: cache}) for row, cache in zip(conversations, solo,
                                                                                         strict=True)]

    cache = REFUSING_CACHES["latent"](model)
    greedy(model, pair[1:], new=12, **{keyword: cache})
    held = held_state(cache)
    for tokens in (20, -3):
        with pytest.raises(NotImplementedError, match=r"LatentKVCache cannot crop: what it keeps .* depends on every "
                                                      r"token it has seen.* call cache.reset\(\) and run them again"):
            cache.crop(tokens)
    cache.crop(0)
    cache.crop(311)
    assert_same_state(held_state(cache), held)
    cache.batch_repeat_interleave(2)
    assert torch.equal(greedy(model, conversations[1:].expand(2, -1), new=12, **{keyword: cache}),
                       later[1].expand(2, -1))

    cache = REFUSING_CACHES["latent"](model)
    assert torch.equal(greedy(model, pair, new=12, **{keyword: cache}), torch.cat(first))
    cache.batch_select_indices(torch.tensor([False, True]))
    assert torch.equal(greedy(model, conversations[1:], new=12, **{keyword: cache}), later[1])
    with pytest.raises(ValueError, match=r"batch_select_indices expects int64 indices \[R\] in \[0, 1\)"):
        cache.batch_select_indices(torch.tensor([1]))

    static = REFUSING_CACHES["static"](model)
    greedy(model, pair[:1], new=12, **{keyword: static})
    for run in (lambda: static.batch_repeat_interleave(2), lambda: static.batch_select_indices(torch.tensor([0]))):
        with pytest.raises(NotImplementedError, match="StaticLatentKVCache keeps its batch rows in buffers of its "
                                                      "batch size and does not repeat or select them"):
            run()
    integers = torch.ones(1, 2, 3, 4, dtype=torch.long)
    for fresh in (LatentKVCache(SMALL), StaticLatentKVCache(STATIC_SMALL, num_layers=1)):
        with pytest.raises(TypeError, match="update expects floating key_states .* got torch.int64"):
            fresh.update(integers, integers, 0)


def test_a_cache_takes_a_model_or_says_what_it_needs() -> None:
    with pytest.raises(TypeError, match="LatentKVCache: model must be the transformers model the cache serves.*"
                                        "got str 'abc'; or pass num_layers="):
        LatentKVCache(SMALL, model="abc")
    with pytest.raises(TypeError, match="PolicyCache: model must be"):
        make_cache("snapkv", model=object())
    assert LatentKVCache(SMALL, model=ARCHS["gemma3"]()).num_layers == 4


def test_an_input_of_no_token_or_no_batch_dim_says_so() -> None:
    """An empty prompt (``input_ids`` of shape ``[1, 0]``) got transformers' reshape error from inside the attention;
    a prompt without its batch dim a size mismatch inside RoPE."""
    _, model = twins("llama", SMALL)
    empty = torch.zeros(1, 0, dtype=torch.long)
    for run in (lambda: model(empty), lambda: model.generate(empty, max_new_tokens=2, past_key_values=LatentKVCache()),
                lambda: model(inputs_embeds=torch.zeros(1, 0, 64))):
        with pytest.raises(ValueError, match=r"the model expects (input_ids|inputs_embeds) \[batch, tokens.*got "
                                             r"\[1, 0(, 64)?\]: an empty prompt"):
            run()
    with pytest.raises(ValueError, match=r"got \[5\]: one prompt needs its batch dim, input_ids\[None\]"):
        model(prompt(5)[0])
    assert model(prompt(5)).logits.shape == (1, 5, VOCAB)
    cache = StaticLatentKVCache(SMALL, model=model)
    with pytest.raises(ValueError, match=r"greedy_generate expects input_ids \[batch, tokens\].*got \[1, 0\]"):
        greedy_generate(model, empty, cache, 2, compiled=False)
    with pytest.raises(TypeError, match="greedy_generate expects input_ids as a tensor, got list"):
        greedy_generate(model, [[5, 6]], cache, 2, compiled=False)


def test_observe_sliding_keeps_the_window() -> None:
    cache = make_cache("full")
    cache.observe_sliding(8, 0)
    keys = torch.randn(1, 2, 20, 4)
    assert cache.update(keys, keys, 0)[0].shape[2] == 20         # the prompt attends all its keys
    assert cache.get_mask_sizes(1, 0) == (8, 13) and cache.is_sliding == [True]
    stored, _ = cache.update(keys[:, :, :1], keys[:, :, :1], 0)  # the last 7, then the new token
    assert torch.equal(stored[:, :, :7], keys[:, :, -7:]) and stored.shape[2] == 8
    assert cache.kept_positions(0)[0, 0].tolist() == list(range(13, 21)) and cache.get_seq_length(0) == 21
    with pytest.raises(ValueError, match="window"):
        cache.observe_sliding(0, 1)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_padded_batch_after_eviction_masks_padding(arch: str) -> None:
    """After an eviction the mask follows each KV head's kept positions; generation runs and stays finite."""
    ids, mask, _ = left_padded((PROMPT, 400))
    _, model = twins(arch, SMALL)
    cache = LatentKVCache(SMALL)
    with mock.patch("flexentropy.caches.layout.kept_columns", wraps=kept_columns) as gathered:
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=10, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    assert all(torch.isfinite(step).all() for step in out.logits)
    assert cache.stored_length(1) < cache.get_seq_length(1)
    assert gathered.call_count >= len(hf.attention_modules(model))  # every layer, on every step after the eviction


def test_kept_columns_and_grouped_attention_match_a_per_head_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    batch, q_heads, kv_heads, q_len, stored, logical, dim = 2, 6, 3, 2, 5, 9, 8
    query = torch.randn(batch, q_heads, q_len, dim, generator=gen, dtype=torch.float64)
    key = torch.randn(batch, kv_heads, stored, dim, generator=gen, dtype=torch.float64)
    value = torch.randn(batch, kv_heads, stored, dim, generator=gen, dtype=torch.float64)
    positions = torch.stack([torch.randperm(logical - q_len, generator=gen)[: stored - q_len].sort().values
                             for _ in range(batch * kv_heads)]).view(batch, kv_heads, -1)
    positions = torch.cat([positions, torch.arange(logical - q_len, logical).expand(batch, kv_heads, q_len)], -1)
    mask = torch.rand(batch, 1, q_len, logical, generator=gen) > 0.3
    mask[..., -q_len:] = True
    allowed = kept_columns(mask, positions)
    out = grouped_attention(query, key, value, allowed, scale=None)
    for b in range(batch):
        for h in range(q_heads):
            kv = h // (q_heads // kv_heads)
            for i in range(q_len):
                keep = mask[b, 0, i, positions[b, kv]]
                assert torch.equal(allowed[b, kv, i], keep)
                weights = (key[b, kv, keep] @ query[b, h, i] / math.sqrt(dim)).softmax(-1)
                torch.testing.assert_close(out[b, h, i], weights @ value[b, kv, keep])


def test_enable_rejects_what_it_cannot_run() -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="supports model types .* got 'gpt2'"):
        enable(gpt2)
    llama = ARCHS["llama"]()
    with pytest.raises(ValueError, match="prefill must be one of"):
        enable(llama, prefill="sparse")
    with pytest.raises(TypeError, match="EntropyConfig"):
        enable(llama, {"base_budget": 512})
    with pytest.raises(TypeError, match="PreTrainedModel"):
        enable(torch.nn.Linear(2, 2))
    softcapped = Gemma3ForCausalLM(Gemma3TextConfig(**COMMON, head_dim=16, attn_logit_softcapping=50.0))
    with pytest.raises(ValueError, match="soft-capping"):
        enable(softcapped)
    with pytest.raises(TypeError, match=r"the model is torch.float64: load it in one of those"):
        enable(ARCHS["llama"]().double())
    enable(ARCHS["llama"]().double(), prefill="dense")  # SDPA prefill takes float64


def test_an_enabled_model_on_meta_gives_the_shapes_of_its_outputs() -> None:
    """Issue 77: a model built on the meta device (shapes without data, as before loading weights) and enabled got
    dynamo's "Observed exception" from the sparse kernel, and its density ``Tensor.item() cannot be called on meta
    tensors``: it runs as a dense one does on meta, prompt and decode step, and its density is unknown (NaN)."""
    with torch.device("meta"):
        model = enable(ARCHS["llama"]().eval(), SMALL)
    cache = LatentKVCache(SMALL)
    ids = torch.zeros(1, PROMPT, dtype=torch.long, device="meta")
    assert model(ids, past_key_values=cache).logits.shape == (1, PROMPT, VOCAB)
    assert model(ids[:, :1], past_key_values=cache).logits.shape == (1, 1, VOCAB)
    assert math.isnan(prefill_density(model))


def test_flags_of_enable_and_the_engine_take_bools() -> None:
    """Issue 77: ``enable(model, keep_plans="no")`` kept the plans (a string is true), and the engine's flags took
    any value for its truth: each refuses what is not a bool (None too where None picks the default)."""
    model = ARCHS["llama"]().eval()
    with pytest.raises(TypeError, match=r"enable.keep_plans must be a bool \(True or False\), got str 'no'"):
        enable(model, SMALL, keep_plans="no")
    assert model.config._attn_implementation == "sdpa"             # refused before the model was touched
    enable(model, STATIC_SMALL)
    ids = prompt(200)
    calls = {
        "greedy_generate.compiled must be a bool or None": lambda: greedy_generate(
            model, ids, StaticLatentKVCache(STATIC_SMALL, model=model), 2, compiled="no"),
        "generate_batch.compiled must be a bool or None": lambda: generate_batch(model, [ids[0]], 2, compiled="no"),
        r"warm_up.loop must be a bool \(True or False\)": lambda: warm_up(model, [200], loop="no"),
    }
    for message, call in calls.items():
        with pytest.raises(TypeError, match=f"{message}.*, got str 'no'"):
            call()


def test_the_helpers_name_the_argument_they_expect() -> None:
    """Issue 77: ``prefill_density(None)``, ``cache_keyword(None)``, and `layer_state`, `local_heads` and
    `attention_forward` given an ``nn.Linear`` raised AttributeErrors on what they read of it."""
    linear = torch.nn.Linear(2, 2)
    q = torch.zeros(1, 4, 3, 16)
    module = r"an attention module of a transformers model \(e.g. model.model.layers\[0\].self_attn\), got Linear"
    calls = [
        (lambda: prefill_density(None), r"prefill_density expects model as a transformers model \(an nn.Module\), "
                                        r"got NoneType \(it has no .named_modules\)"),
        (lambda: hf.cache_keyword(None), r"cache_keyword expects model as a transformers model, got NoneType"),
        (lambda: hf.layer_state(linear), rf"layer_state expects module as {module} \(it has no .config, .layer_idx\)"),
        (lambda: hf.local_heads(linear), rf"local_heads expects module as {module} \(it has no .num_key_value_groups"),
        (lambda: hf.attention_forward(linear, q, q[:, :2], q[:, :2], None), rf"layer_state expects module as {module}"),
    ]
    for call, message in calls:
        with pytest.raises(TypeError, match=message):
            call()


def test_enable_leaves_other_models_of_the_same_config_alone(tmp_path: object) -> None:
    """Two models built from one config object: enabling one switched the other's attention too (and saved the
    other's settings). Each enabled model now holds its own config."""
    shared = LlamaConfig(**COMMON)
    torch.manual_seed(0)
    a, b = LlamaForCausalLM(shared).eval(), LlamaForCausalLM(shared).eval()
    b.load_state_dict(a.state_dict())
    ids = prompt()
    expected = greedy(b, ids)
    enable(a, SMALL)
    assert b.config._attn_implementation == "sdpa" and not hasattr(b.config, hf.CONFIG_ATTR)
    assert all(m.config is a.config for m in hf.attention_modules(a))
    assert torch.equal(greedy(b, ids), expected)                 # b still runs dense
    enable(b, SMALL.replace(coverage=0.9))
    assert a.config.flexentropy["coverage"] == list(SMALL.coverage) and b.config.flexentropy["coverage"] == 0.9
    a.save_pretrained(tmp_path)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.flexentropy["coverage"] == list(SMALL.coverage)


ROUTED = {"get_compiled_call", "prepare_inputs_for_generation", "create_masks_for_generate"}
"""The methods `enable` gives a model of its own (`flexentropy.integrations.hf.hooks`), which `disable` takes off."""


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_disable_takes_off_everything_enable_put_on() -> None:
    """`enable` installs its hooks once (a second call replaces the settings only); `disable` removes them and the
    compiled-call routing, and the model generates as its dense twin again; `enabled` does both around a block."""
    dense, model = twins("llama", SMALL)
    hooks_on = hook_count(model)
    assert hooks_on == 3 + 2 + 3 and vars(model).keys() >= ROUTED         # attention, decoder, signal hooks
    enable(model, SMALL)
    assert hook_count(model) == hooks_on
    ids = prompt()
    cache = LatentKVCache(SMALL, model=model)
    greedy(model, ids, **{hf.cache_keyword(model): cache})
    assert cache.layers[1].evictions > 0                                  # the cache got its queries
    assert hf.disable(model) is model
    assert hook_count(model) == 0 and not ROUTED & vars(model).keys()
    assert model.config._attn_implementation == "sdpa" and not hasattr(model.config, hf.CONFIG_ATTR)
    assert not any(hasattr(m, hf.STATE_ATTR) for m in hf.attention_modules(model))
    assert torch.equal(greedy(model, ids), greedy(dense, ids))
    assert hf.disable(model) is model                                     # a second call changes nothing
    with hf.enabled(model, SMALL) as same:
        assert same is model and model.config._attn_implementation == "flexentropy" and hook_count(model) == hooks_on
    assert hook_count(model) == 0 and model.config._attn_implementation == "sdpa"


def cpu_compile() -> object:
    """transformers compiles ``generate``'s decode forward off CUDA only with ``_compile_all_devices`` set."""
    from transformers.generation import CompileConfig

    config = CompileConfig(backend="eager")
    config._compile_all_devices = True
    return config


def test_a_deep_copy_of_an_enabled_model_is_switched_on_its_own() -> None:
    """Issue 57: ``copy.deepcopy`` of an enabled model shared the original's hooks and compiled-call routing (under
    ``generate``'s compiled path the copy ran the original, so its tokens followed the original's weights),
    `disable` left the copy switched and a second `enable` doubled its hooks. The copy's hooks are its own."""
    _, model = twins("llama", SMALL)
    twin = copy.deepcopy(model)
    ids = prompt(300)

    def run(served: torch.nn.Module) -> torch.Tensor:
        cache = StaticLatentKVCache(SMALL, model=served)
        return greedy(served, ids, 12, compile_config=cpu_compile(), **{hf.cache_keyword(served): cache})

    expected = run(twin)
    with torch.no_grad():
        for weight in model.parameters():
            weight.neg_()
    assert torch.equal(run(twin), expected)
    hooks = hook_count(twin)
    enable(twin, SMALL)
    assert hook_count(twin) == hooks
    assert hf.disable(twin) is twin and hook_count(twin) == 0 and not ROUTED & vars(twin).keys()
    assert twin.config._attn_implementation == "sdpa" and hook_count(model) == hooks


def test_enabled_gives_back_the_settings_a_model_had() -> None:
    """Issue 57: ``with fe.enabled(model, other)`` on an enabled model left it disabled on exit; it now restores the
    settings it had (config, prefill policy and its knobs)."""
    from flexentropy.policies import make_prefill

    _, model = twins("llama", SMALL)
    policy = make_prefill("streaming", SMALL, window=128)
    enable(model, prefill=policy, keep_plans=False)
    hooks = hook_count(model)
    with hf.enabled(model, COVERING, prefill="dense"):
        assert {hf.layer_state(m).config for m in hf.attention_modules(model)} == {COVERING}
    assert model.config._attn_implementation == "flexentropy" and hook_count(model) == hooks
    states = [hf.layer_state(m) for m in hf.attention_modules(model)]
    assert {state.policy for state in states} == {policy} and not any(state.keep_plans for state in states)
    assert hf.parse_settings(model.config.flexentropy).policy == policy


def test_an_enabled_model_pickles(tmp_path: object) -> None:
    """Issue 57: ``torch.save`` of an enabled model failed (a local hook function cannot be pickled); the loaded model
    is switched, decodes the same tokens and can be disabled."""
    _, model = twins("llama", SMALL)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    ids = prompt(300)

    def run(served: torch.nn.Module) -> torch.Tensor:
        cache = StaticLatentKVCache(SMALL, model=served)
        return greedy(served, ids, 12, disable_compile=True, **{hf.cache_keyword(served): cache})

    assert torch.equal(run(loaded), run(model))
    assert hook_count(loaded) == hook_count(model)
    assert chunked_tokens(loaded) is None    # a bound method pickles as its name: the MLPs' own forward comes back
    enable(loaded, SMALL)
    assert chunked_tokens(loaded) == MLP_CHUNK and hook_count(loaded) == hook_count(model)
    assert hf.disable(loaded) is loaded and hook_count(loaded) == 0 and chunked_tokens(loaded) is None


def test_enable_runs_the_mlps_of_long_forwards_in_chunks() -> None:
    """Issue 57: a 128k prompt on the 8B shape ran out of memory inside an MLP on an 80 GB card, where dense fit,
    unless the user knew `fe.chunk_mlp`. `enable` now runs the MLPs of forwards longer than ``mlp_chunk`` tokens over
    chunks of it, with the whole forward's logits (shorter forwards whole); ``mlp_chunk=None`` leaves them whole; MLPs
    the user chunked keep their chunks; `enabled` and `disable` give back what the model had."""
    dense, model = twins("llama", COVERING)
    mlp = model.model.layers[1].mlp
    assert chunked_tokens(model) == MLP_CHUNK and chunked_tokens(dense) is None
    enable(model, COVERING, prefill="dense", mlp_chunk=64)
    calls: list[int] = []
    mlp.down_proj.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[-2]))  # the chunks
    ids = prompt(150)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)
        assert calls == [64, 64, 22]
        model(ids[:, :40])
        assert calls[3:] == [40]
    with hf.enabled(model, SMALL, mlp_chunk=None):
        assert chunked_tokens(model) is None
    assert chunked_tokens(model) == 64
    with hf.enabled(model, SMALL):
        assert chunked_tokens(model) == MLP_CHUNK
    assert chunked_tokens(model) == 64
    hf.disable(model)
    assert chunked_tokens(model) is None and "forward" not in vars(mlp)
    with hf.enabled(model, SMALL):
        assert chunked_tokens(model) == MLP_CHUNK
    assert chunked_tokens(model) is None
    fe_chunk_mlp(model, 32)                          # the user's own chunks stay
    enable(model, SMALL)
    assert chunked_tokens(model) == 32
    hf.disable(model)
    assert chunked_tokens(model) == 32
    with pytest.raises(ValueError, match="enable.mlp_chunk must be >= 1, got 0"):
        enable(model, SMALL, mlp_chunk=0)


def test_use_cache_false_with_a_flexentropy_cache_says_what_is_wrong() -> None:
    """Issue 57: ``generate(use_cache=False)`` with a fresh flexentropy cache said "a new prompt on a used cache, call
    reset"; it says that ``use_cache=False`` runs the whole sequence again at every step."""
    _, model = twins("llama", SMALL)
    for cache in (LatentKVCache(SMALL), StaticLatentKVCache(SMALL, model=model)):
        with pytest.raises(ValueError, match="passed with use_cache=False: the model then runs the whole sequence"):
            greedy(model, prompt(300), 4, use_cache=False, **{hf.cache_keyword(model): cache})


def test_enable_refuses_dense_layers_the_model_lacks() -> None:
    with pytest.raises(ValueError, match=r"dense_layers names layer\(s\) \[99\] that LlamaForCausalLM does not have"):
        enable(ARCHS["llama"](), SMALL.replace(dense_layers=(0, 99)))


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_keyword_follows_the_installed_transformers(arch: str) -> None:
    """transformers 5.24 renamed the cache argument to `cache` (design.md §6, read from the wheels)."""
    import transformers
    from packaging.version import Version

    model = ARCHS[arch]()
    renamed = Version(transformers.__version__) >= Version("5.24.0")
    assert hf.cache_keyword(model) == ("cache" if renamed else "past_key_values")
    assert hf.cache_keyword(torch.compile(model)) == hf.cache_keyword(model)
    assert hf.cache_keyword is keywords.cache_keyword   # one home, beside the names it returns


def test_from_pretrained_with_attn_implementation_and_save_round_trip(tmp_path: object) -> None:
    dense, model = twins("llama", SMALL)
    model.save_pretrained(tmp_path)  # config.flexentropy is JSON: it survives the round trip
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="flexentropy").eval()
    assert loaded.config._attn_implementation == "flexentropy"
    assert hf.parse_settings(loaded.config.flexentropy).policy == hf.parse_settings(SMALL).policy
    ids = prompt()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert prefill_density(loaded) < 1.0
    knobs = hf.settings_dict(COVERING, "entropy")
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="flexentropy", flexentropy=knobs)
    assert torch.equal(greedy(fresh.eval(), ids), greedy(dense, ids))


def test_a_policy_with_knobs_of_its_own_runs_and_survives_save(tmp_path: object) -> None:
    """``enable(model, prefill=make_prefill(name, config, **knobs))``: the rule's own knobs (here a local window
    and a mass threshold) reach every layer and the saved config; the eval's policy specs go this way. Every layer
    runs the one policy object (issue 74: each layer's state built its own from the settings), the loaded model's
    layers the one object read from its record."""
    from flexentropy.policies import make_prefill

    for policy in (make_prefill("streaming", SMALL, window=128), make_prefill("xattention", SMALL, threshold=0.5)):
        _, model = twins("llama", SMALL)
        enable(model, prefill=policy)
        assert all(hf.layer_state(m).policy is policy for m in hf.attention_modules(model))
        with torch.no_grad():
            model(prompt())
        assert prefill_density(model) < 1.0
        model.save_pretrained(tmp_path)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="flexentropy")
        assert hf.parse_settings(loaded.config.flexentropy).policy == policy
        assert hf.layer_state(hf.attention_modules(loaded)[1]).policy == policy
        assert len({id(hf.layer_state(m).policy) for m in hf.attention_modules(loaded)}) == 1
    with pytest.raises(TypeError, match="carries its EntropyConfig"):
        enable(model, COVERING, prefill=policy)


@pytest.mark.slow
def test_torch_compile_model_prefill_and_decode() -> None:
    """``torch.compile(model)``: same logits as eager, prefill and decode, and flex never runs uncompiled."""
    _, model = twins("llama", SMALL)
    compiled = torch.compile(model)
    ids = prompt()

    def run(m: torch.nn.Module) -> list[torch.Tensor]:
        cache = DynamicCache(config=model.config)
        logits = [m(ids, past_key_values=cache).logits[:, -1]]
        for _ in range(3):
            logits.append(m(logits[-1].argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1])
        return logits

    flex_module._WARNINGS_SHOWN.discard("flex_attention_performance")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(compiled)
    assert not [w for w in caught if "flex_attention called without torch.compile" in str(w.message)]
    with torch.no_grad():
        expected = run(model)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")
