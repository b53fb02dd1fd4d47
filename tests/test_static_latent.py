"""`StaticLatentKVCache` (captured decoding, issue 17): same greedy tokens as `LatentKVCache`, bounded memory, static
decode shapes, compiled decode identical to eager with no recompiles, and `warm_up`.

Models: tiny random Llama / Qwen2 built from configs (as tests/test_hf_integration.py), and a tiny model built from
`EntropyAttention` layers for the plain loop.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.generation import CompileConfig

import flexentropy as fe
from flexentropy.caches import LatentKVCache, StaticLatentKVCache
from flexentropy.caches.dynamic_phase import layer_attention
from flexentropy.caches.progress import Progress
from flexentropy.engine import begin_step, end_step
from flexentropy.integrations.hf import cache_keyword, enable
from flexentropy.kv.decode_attention import flash_decode
from reference import cache as reference

VOCAB = 256
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=4096, bos_token_id=1, eos_token_id=None, pad_token_id=0)
ARCHS = {"llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
         "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON))}
EVICTING = fe.EntropyConfig(segment_size=128, block_size=64, base_budget=64, dense_prefix=128, decode_budget=96,
                            decode_window=16, decode_delay=4, recompress_every=8)
COVERING = EVICTING.replace(decode_budget=512)


def model_for(arch: str, config: fe.EntropyConfig, prefill: str = "dense") -> nn.Module:
    torch.manual_seed(0)
    return enable(ARCHS[arch]().eval(), config, prefill=prefill)


def prompt(length: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model: nn.Module, ids: torch.Tensor, cache: object, new: int, **kwargs: object) -> torch.Tensor:
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         **{cache_keyword(model): cache}, **kwargs)
    return out[:, ids.shape[1]:]


def cpu_compile(backend: str = "eager") -> CompileConfig:
    """transformers compiles ``generate``'s decode forward off CUDA only with ``_compile_all_devices`` set."""
    config = CompileConfig(backend=backend, mode=None if backend == "eager" else "default")
    config._compile_all_devices = True
    return config


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize(("config", "length"), [(COVERING, 200), (EVICTING, 300)], ids=["covering", "evicting"])
def test_same_tokens_as_dynamic_latent(arch: str, config: fe.EntropyConfig, length: int) -> None:
    """Eager generate: the static cache takes the dynamic cache's decisions (first eviction, recompressions)."""
    model = model_for(arch, config)
    ids = prompt(length)
    dynamic = LatentKVCache(config)
    static = StaticLatentKVCache(config, model=model)
    expected = greedy(model, ids, dynamic, 48, disable_compile=True)
    assert torch.equal(greedy(model, ids, static, 48, disable_compile=True), expected)
    assert static.is_static and dynamic.layers[0].evictions == static.evictions
    assert (static.evictions > 1) == (config is EVICTING)
    assert torch.equal(static.kept_positions(0), dynamic.kept_positions(0))


def test_left_padded_rows_match_their_solo_runs() -> None:
    model = model_for("llama", EVICTING)
    long, short = prompt(300, seed=2), prompt(260, seed=3)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 40, dtype=torch.long), short], dim=1)])
    mask = (ids != 0).long()
    mask[0] = 1
    batch = greedy(model, ids, StaticLatentKVCache(EVICTING, model=model), 24, attention_mask=mask,
                   disable_compile=True)
    for row, solo in enumerate((long, short)):
        alone = greedy(model, solo, StaticLatentKVCache(EVICTING, model=model), 24, disable_compile=True)
        assert torch.equal(batch[row], alone[0])


def test_memory_bounded_and_shapes_static() -> None:
    """Over many steps the buffers never grow and the step's tensors keep their shapes and addresses; the slots a
    step reads under the validity mask are the first ``lengths`` (what flash_decode reads, an unpadded batch)."""
    model = model_for("llama", EVICTING)
    cache = StaticLatentKVCache(EVICTING, model=model)
    seen: list[tuple] = []
    prefixes: list[bool] = []

    def record(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if cache.is_static:
            keys = cache.main.keys[1]
            counters = cache.static.batch.device
            seen.append((cache.nbytes(), tuple(keys.shape), keys.data_ptr(), counters["slot"].data_ptr()))
            valid = (torch.arange(cache.capacity) <= counters["slot"]) & cache.main.real[1]
            prefix = torch.arange(cache.capacity) < counters["lengths"][:, None, None]
            prefixes.append(torch.equal(valid, prefix.expand_as(valid)))

    handle = model.model.layers[1].register_forward_hook(record, with_kwargs=True)
    try:
        greedy(model, prompt(300), cache, 150, disable_compile=True)
    finally:
        handle.remove()
    assert len(seen) > 100 and len(set(seen)) == 1
    assert len(prefixes) == len(seen) and all(prefixes)
    assert seen[0][1][2] == cache.capacity == EVICTING.decode_budget + EVICTING.recompress_every
    assert cache.stored_length(1) <= cache.capacity


@pytest.mark.slow
def test_compiled_step_writes_its_token_in_place() -> None:
    """A step's write, compiled, touches its token's entries only: no kernel runs over a whole buffer (a ``scatter_``
    into a buffer the step reads becomes a copy of the buffer in the compiled graph: 17 GB a step over the prompt
    buffers at 128k on an 8B model)."""
    from torch._inductor.utils import run_and_get_code

    from flexentropy.caches.static_buffers import StaticBuffers, write_step

    buffers = StaticBuffers(4099)
    buffers.allocate(1, torch.zeros(2, 3, 1, 8), torch.zeros(2, 3, 1, 8))
    key, value = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8)
    slot, position = torch.tensor([1, 4098]), torch.tensor([7, 9])
    layer = buffers.layer(0, torch.zeros(2, 6, 4, 8), {"slot": slot, "lengths": slot + 1, "position": position}, False)
    _, code = run_and_get_code(torch.compile(lambda: write_step(layer, key, value)))
    assert not any(str(n) in source for source in code for n in (2 * 3 * 4099 * 8, 2 * 3 * 4099)), \
        "a kernel of the compiled write runs over a whole buffer"
    assert torch.equal(buffers.keys[0][[0, 1], :, [1, 4098]], key[:, :, 0])
    assert torch.equal(buffers.values[0][[0, 1], :, [1, 4098]], value[:, :, 0])
    assert buffers.positions[0][[0, 1], :, [1, 4098]].tolist() == [[7] * 3, [9] * 3]
    assert int(buffers.real[0].sum()) == 6 and bool(buffers.real[0][[0, 1], :, [1, 4098]].all())


def test_phase_one_appends_in_place_and_frees_its_buffers() -> None:
    """Phase 1 holds the whole prompt: its one-token appends write into slots reserved past the prompt (the keys
    keep their address; a copy of every entry per step reads and writes 16 GiB at 128k on an 8B model), and the
    prompt-sized buffers are dropped at the switch to the static buffers."""
    model = model_for("llama", EVICTING)
    cache = StaticLatentKVCache(EVICTING, model=model)
    layer = cache.layers[1]
    phase_one: list[tuple[int, int]] = []

    def record(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if cache.stage is None:
            phase_one.append((layer.keys.data_ptr(), layer.keys.shape[-2]))

    handle = model.model.layers[1].register_forward_hook(record, with_kwargs=True)
    try:
        greedy(model, prompt(300), cache, 12, disable_compile=True)
    finally:
        handle.remove()
    assert [length for _, length in phase_one] == list(range(300, 300 + EVICTING.decode_delay + 1))
    assert len({address for address, _ in phase_one}) == 1
    assert cache.is_static and all(layer.keys is None for layer in cache.layers)
    # the prompt's attention reads the prompt's own keys (contiguous: the sparse kernel's strides stay those of q),
    # a phase-1 step the entries so far
    direct = StaticLatentKVCache(EVICTING, num_layers=1)
    keys, values = torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    direct.observe_queries(torch.randn(1, 4, 300, 16), 0)
    assert all(got is given for got, given in zip(direct.update(keys, values, 0), (keys, values), strict=True))
    step = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    direct.observe_queries(torch.randn(1, 4, 1, 16), 0)
    got = direct.update(*step, 0)
    for read, before, new in zip(got, (keys, values), step, strict=True):
        assert torch.equal(read, torch.cat([before, new], dim=-2))


def test_phase_one_frees_its_prompt_sized_buffer_after_an_eviction() -> None:
    """A layer's own buffer (no prompt buffers lent) holds the prompt and the phase-1 slots; once an eviction leaves
    fewer entries elsewhere, the next append moves them to a buffer of their size, and the prompt-sized one is freed
    (a lent buffer takes them instead: the prompt buffers are kept anyway)."""
    cache = StaticLatentKVCache(EVICTING, num_layers=1)
    layer = cache.layers[0]
    cache.observe_queries(torch.randn(1, 4, 300, 16), 0)
    cache.update(torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16), 0)
    assert layer.keys.untyped_storage().nbytes() == 2 * (300 + EVICTING.decode_delay) * 16 * 4
    layer.decide(EVICTING.decode_budget, 1)
    cache.observe_queries(torch.randn(1, 4, 1, 16), 0)
    cache.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), 0)
    held = EVICTING.decode_budget + 1 + EVICTING.decode_delay
    assert layer.keys.untyped_storage().nbytes() == 2 * held * 16 * 4 and layer.stored == EVICTING.decode_budget + 1


def drive(cache: StaticLatentKVCache, steps: int, *, seed: int = 0, padding: int = 0, device: str = "cpu") -> None:
    """Feed ``cache`` a 2-row prompt of 300 tokens (row 1 left-padded by ``padding``) and ``steps`` decode steps
    of random post-RoPE queries, keys and values, different in every layer, as an attention layer hands them over
    (the driver's ``begin_step``, then per layer ``observe_queries``, ``update`` and ``attend``, then its
    ``end_step``)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    def forward(length: int) -> None:
        begin_step(cache, length)
        for layer_idx in range(len(cache.layers)):
            if padding and length > 1:
                real = torch.ones(2, length, dtype=torch.bool, device=device)
                real[1, :padding] = False
                cache.observe_padding(real, layer_idx)
            query = random(2, 4, length, 16)
            cache.observe_queries(query, layer_idx)
            cache.update(random(2, 2, length, 16), random(2, 2, length, 8), layer_idx)
            if length == 1:
                cache.attend(query, layer_idx)
        end_step(cache, length)

    forward(300)
    for _ in range(steps):
        forward(1)


def check_decisions_in_chunks(monkeypatch: pytest.MonkeyPatch, padding: int, device: str) -> None:
    """A decision covers every layer at once, or, where the scores of all layers would not fit in memory
    (`static_phase.SCORE_ELEMENTS`), chunks of them: the two keep the same entries, and the buffers hold the
    same."""
    import flexentropy.caches.static_phase as static_phase

    together, chunked = (StaticLatentKVCache(EVICTING, num_layers=3) for _ in range(2))
    drive(together, 40, padding=padding, device=device)
    monkeypatch.setattr(static_phase, "SCORE_ELEMENTS", 1)
    drive(chunked, 40, padding=padding, device=device)
    assert together.evictions == chunked.evictions >= 3
    for name in ("keys", "values", "positions", "real"):
        for got, expected in zip(getattr(together.main, name), getattr(chunked.main, name), strict=True):
            assert torch.equal(got, expected), name
    assert all(torch.equal(a, b) for a, b in zip(together.static.window, chunked.static.window, strict=True))
    assert not torch.equal(together.kept_positions(0), together.kept_positions(1))
    if padding:  # row 1 holds fewer real tokens than the budget: padding entries stay, marked unreal
        assert not together.main.real[0][1, :, :together.stored_length(0)].all()


@pytest.mark.parametrize("padding", [0, 250])
def test_decisions_in_chunks_of_layers_equal_all_at_once(monkeypatch: pytest.MonkeyPatch, padding: int) -> None:
    check_decisions_in_chunks(monkeypatch, padding, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("padding", [0, 250])
def test_cuda_decisions_in_chunks_of_layers_equal_all_at_once(monkeypatch: pytest.MonkeyPatch, padding: int) -> None:
    """The same on the GPU, where the stacked scores run as one batched product of another shape."""
    check_decisions_in_chunks(monkeypatch, padding, "cuda")


@st.composite
def multi_layer_schedules(draw: st.DrawFn) -> dict:
    window = draw(st.integers(1, 6))
    return dict(
        layers=draw(st.integers(1, 3)), batch=draw(st.integers(1, 2)), kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 4])), dim=draw(st.sampled_from([2, 4])), prompt=draw(st.integers(1, 30)),
        steps=draw(st.integers(1, 30)), seed=draw(st.integers(0, 2**16)), turn=draw(st.integers(1, 30)),
        turn_length=draw(st.integers(2, 5)), max_prompt_length=draw(st.sampled_from([None, 1, 20, 40, 40])),
        config=fe.EntropyConfig(
            decode_budget=draw(st.integers(window, 16)), decode_window=window, decode_delay=draw(st.integers(0, 4)),
            decode_pool=draw(st.sampled_from([1, 3])), decode_span=draw(st.sampled_from([0, 4])),
            decode_score=draw(st.sampled_from(["softmax", "raw"])),
            recompress_every=draw(st.sampled_from([1, 4])),
        ),
    )


@settings(max_examples=40, deadline=None)
@given(case=multi_layer_schedules())
def test_every_layer_matches_the_dense_oracle(case: dict) -> None:
    """Each layer of a `StaticLatentKVCache`, with its decisions taken for all layers at once, holds after every
    step the entries and positions of `reference.cache.LatentCacheOracle` run on that layer alone (the decision
    before the step's queries are handed over: ``hand_over="after"``), also across a later turn (one forward of
    several tokens after decoding began, which leaves the buffers and re-enters them at the next step), with phase 1
    captured in prompt buffers or not (``max_prompt_length`` None, below or above the prompt)."""
    config, batch, kv_heads, dim = case["config"], case["batch"], case["kv_heads"], case["dim"]
    gen = torch.Generator().manual_seed(case["seed"])
    cache = StaticLatentKVCache(config, num_layers=case["layers"], max_prompt_length=case["max_prompt_length"])
    captured = False
    oracles = [reference.LatentCacheOracle(config) for _ in range(case["layers"])]
    for step in range(case["steps"] + 1):
        length = case["prompt"] if step == 0 else case["turn_length"] if step == case["turn"] else 1
        begin_step(cache, length)
        captured |= cache.stage is cache.prompt
        expected = []
        for layer_idx, oracle in enumerate(oracles):
            q, k, v = (torch.randn(batch, heads, length, dim, generator=gen, dtype=torch.float64)
                       for heads in (kv_heads * case["group"], kv_heads, kv_heads))
            cache.observe_queries(q, layer_idx)
            cache.update(k, v, layer_idx)
            if step:
                cache.attend(q, layer_idx)
            oracle.step(q, k, v, "after")
            expected.append((oracle.keys, oracle.values, oracle.positions))
        end_step(cache, length)
        for layer_idx, (want_keys, want_values, want_positions) in enumerate(expected):
            keys, values = cache.stored_entries(layer_idx)
            assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
            assert torch.equal(cache.kept_positions(layer_idx), want_positions)
    assert cache.evictions == len(oracles[0].evictions)
    event(f"recompressions: {min(max(len(oracles[0].evictions) - 1, 0), 2)}")
    event(f"phase 1 captured: {captured}")


def static_addresses(cache: StaticLatentKVCache) -> set[int]:
    """Addresses of every tensor a captured step reads in place (buffers and counters)."""
    main = cache.main
    tensors = [*cache.static.batch.device.values(), *cache.static.window, *main.keys, *main.values,
               *main.positions, *main.real]
    return {tensor.data_ptr() for tensor in tensors}


def test_reset_keeps_the_buffers_for_the_next_request() -> None:
    """A captured step replays only at the addresses it was recorded with: after ``reset()`` the next request decodes
    in the same buffers and counters (and gives the tokens of a fresh cache); two live caches never share one."""
    model = model_for("llama", EVICTING)
    ids, other = prompt(300), prompt(260, seed=5)
    cache = StaticLatentKVCache(EVICTING, model=model)
    greedy(model, other, cache, 24, disable_compile=True)
    addresses = static_addresses(cache)
    cache.reset()
    reused = greedy(model, ids, cache, 24, disable_compile=True)
    assert static_addresses(cache) == addresses
    fresh = StaticLatentKVCache(EVICTING, model=model)
    assert torch.equal(greedy(model, ids, fresh, 24, disable_compile=True), reused)
    assert static_addresses(fresh).isdisjoint(addresses)


def test_reset_serves_a_request_of_another_batch_size() -> None:
    """After ``reset()`` a cache serves a batch of another size (new buffers for it), with the tokens of a fresh
    cache; without ``reset()`` the error says what to do."""
    model, ids = model_for("llama", EVICTING), prompt(300)
    cache = StaticLatentKVCache(EVICTING, model=model)
    greedy(model, ids, cache, 24, disable_compile=True)
    pair = prompt(280, seed=4, batch=2)
    with pytest.raises(ValueError, match="call cache.reset\\(\\) before a request of another batch size"):
        greedy(model, pair, cache, 24, disable_compile=True)
    cache.reset()
    got = greedy(model, pair, cache, 24, disable_compile=True)
    assert torch.equal(got, greedy(model, pair, StaticLatentKVCache(EVICTING, model=model), 24, disable_compile=True))
    assert cache.main.keys[0].shape[0] == 2


def test_a_new_prompt_on_a_used_cache_says_to_reset_it() -> None:
    """A second request on a used static cache without ``reset()`` raises and says to reset (it attended over the old
    conversation's entries); after ``reset()`` the request gets a fresh cache's tokens."""
    model, ids, other = model_for("llama", EVICTING), prompt(300), prompt(280, seed=5)
    cache = StaticLatentKVCache(EVICTING, model=model)
    greedy(model, ids, cache, 24, disable_compile=True)
    with pytest.raises(ValueError, match=r"new prompt on a used cache: call cache.reset\(\)"):
        greedy(model, other, cache, 24, disable_compile=True)
    cache.reset()
    got = greedy(model, other, cache, 24, disable_compile=True)
    assert torch.equal(got, greedy(model, other, StaticLatentKVCache(EVICTING, model=model), 24,
                                   disable_compile=True))


def test_a_hand_loop_may_prepare_each_step_itself() -> None:
    """A plain loop over an HF model may call the driver's ``begin_step(cache, 1)`` before each forward (the model's
    pre-hook then finds nothing left to prepare), or twice, or not at all: each step advances once, to the logits and
    length of the hook alone, and the length of `LatentKVCache`. After ``reset()`` the cache serves the next
    request."""
    model, ids = model_for("llama", EVICTING), prompt(300)

    def hand_loop(cache: object, prepares: int, steps: int = 12) -> tuple[torch.Tensor, int]:
        logits = []
        with torch.no_grad():
            out = model(ids, **{cache_keyword(model): cache})
            for _ in range(steps):
                logits.append(out.logits[:, -1])
                for _ in range(prepares):
                    begin_step(cache, 1)
                out = model(out.logits[:, -1:].argmax(-1), **{cache_keyword(model): cache})
        return torch.stack(logits), cache.get_seq_length()

    assert hand_loop(LatentKVCache(EVICTING), 0)[1] == 300 + 12
    expected = hand_loop(StaticLatentKVCache(EVICTING, model=model), 0)
    for prepares in (1, 2):
        cache = StaticLatentKVCache(EVICTING, model=model)
        got = hand_loop(cache, prepares)
        assert cache.is_static and got[1] == 300 + 12 and torch.equal(got[0], expected[0]), prepares
    cache.reset()
    got = hand_loop(cache, 1)
    assert got[1] == 300 + 12 and torch.equal(got[0], expected[0])


def test_only_the_driver_prepares_and_advances_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's host work (the cache's `prepare`, which sets its current phase), its device advance and its host
    count (the static phase's) are called from the step driver's module only, whatever runs the step: ``generate``
    eagerly (the decoder's hooks call the driver's ``begin_step``/``end_step``) or compiled (the `StepDriver`),
    `fe.greedy_generate`, `fe.generate_batch`, a hand loop over the model's forward. Each forward is prepared once,
    each static step advanced and counted once."""
    import sys

    from flexentropy.caches.static_phase import StaticPhase

    calls: list[tuple[str, str]] = []
    for owner, name in ((StaticLatentKVCache, "prepare"), (StaticPhase, "advance"), (StaticPhase, "count")):
        def wrapped(self: object, *args: object, _name: str = name, _original: object = getattr(owner, name)
                    ) -> None:
            calls.append((_name, sys._getframe(1).f_globals["__name__"]))
            _original(self, *args)
        monkeypatch.setattr(owner, name, wrapped)
    model, ids, new = model_for("llama", EVICTING), prompt(300), 40

    def hand_loop() -> None:
        cache, keyword = StaticLatentKVCache(EVICTING, model=model), cache_keyword(model)
        with torch.no_grad():
            out = model(ids, **{keyword: cache})
            for _ in range(new - 1):
                out = model(out.logits[:, -1:].argmax(-1), **{keyword: cache})

    runs = {
        "generate": lambda: greedy(model, ids, StaticLatentKVCache(EVICTING, model=model), new, disable_compile=True),
        "generate compiled": lambda: greedy(model, ids, StaticLatentKVCache(EVICTING, model=model), new,
                                            compile_config=cpu_compile()),
        "greedy_generate": lambda: fe.greedy_generate(model, ids, StaticLatentKVCache(EVICTING, model=model), new),
        "hand loop": hand_loop,
        "generate_batch": lambda: fe.generate_batch(model, [ids[0], prompt(260)[0]], new, rows=2, config=EVICTING),
    }
    for label, run in runs.items():
        calls.clear()
        run()
        names = [name for name, _ in calls]
        assert {module for _, module in calls} == {"flexentropy.engine.driver"}, label
        assert names.count("advance") == names.count("count") > 0, label
        if label != "generate_batch":   # one prepare per forward: the prompt and new - 1 steps
            assert names.count("prepare") == new, label


def conversation(model: nn.Module, ids: torch.Tensor, cache: object, compile_config: object = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two turns on one cache: 30 tokens, then a 25-token later turn in one forward and 30 more tokens (generate on
    the whole conversation, as a chat would)."""
    options = {"disable_compile": True} if compile_config is None else {"compile_config": compile_config}
    first = greedy(model, ids, cache, 30, **options)
    turn = torch.cat([ids, first, prompt(25, seed=9)], dim=1)
    return first, greedy(model, turn, cache, 30, **options)


def test_a_later_turn_continues_on_the_same_cache() -> None:
    """A forward of several tokens after decoding began is the conversation's next turn: the static cache leaves its
    buffers for it and re-enters them at the next step (the same buffers), and takes the dynamic cache's decisions
    and tokens through both turns, eagerly and under transformers' compiled ``generate`` (no graph compiled for the
    second turn). The turn's forward attends causally within itself, also on a left-padded row."""
    model, ids = model_for("llama", EVICTING), prompt(300)
    dynamic, static = LatentKVCache(EVICTING), StaticLatentKVCache(EVICTING, model=model)
    expected = conversation(model, ids, dynamic)
    got = conversation(model, ids, static)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert static.is_static and static.get_seq_length() == dynamic.get_seq_length() == 300 + 30 + 25 + 30 - 1
    assert torch.equal(static.kept_positions(1), dynamic.kept_positions(1))
    assert static.evictions == dynamic.layers[0].evictions > 2
    torch._dynamo.reset()
    compiled = StaticLatentKVCache(EVICTING, model=model)
    first = greedy(model, ids, compiled, 30, compile_config=cpu_compile())
    addresses = compiled.main.keys[0].data_ptr()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    turn = torch.cat([ids, first, prompt(25, seed=9)], dim=1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        second = greedy(model, turn, compiled, 30, compile_config=cpu_compile())
    assert torch.equal(first, expected[0]) and torch.equal(second, expected[1])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert compiled.main.keys[0].data_ptr() == addresses and compiled.is_static

    layer = StaticLatentKVCache(EVICTING, num_layers=1).layers[0]   # causal within a later turn, padded or not
    query, keys, values = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    held = dict(keys=keys, values=values, kept=torch.arange(10).expand(1, 2, 10), window=query,
                progress=Progress(seen=10, observed=10, stored=10, prompt_length=10))
    layer.adopt(**held, padding=None)
    plain = layer_attention(layer, query, None)
    layer.adopt(**held, padding=torch.tensor([0]))
    torch.testing.assert_close(layer_attention(layer, query, None), plain)


@pytest.mark.parametrize(("config", "length"), [(COVERING, 200), (EVICTING, 300)], ids=["covering", "evicting"])
def test_captured_phase_one_takes_the_same_decisions(config: fe.EntropyConfig, length: int) -> None:
    """With ``max_prompt_length`` the phase-1 steps write into prompt buffers (one address) and read them, and the
    cache leaves them at the first decision point: the dynamic cache's tokens and kept positions; a prompt longer
    than ``max_prompt_length`` runs its phase 1 on the dynamic path, with the same tokens."""
    model, ids, dynamic = model_for("llama", config), prompt(length), LatentKVCache(config)
    expected = greedy(model, ids, dynamic, 40, disable_compile=True)
    cache = StaticLatentKVCache(config, model=model, max_prompt_length=length + 20)
    phase_one: list[tuple[int, int]] = []

    def record(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if cache.stage is cache.prompt:   # the decode steps before the first decision point
            phase_one.append((cache.prompt.keys[1].data_ptr(), cache.stored_length(1)))

    handle = model.model.layers[1].register_forward_hook(record, with_kwargs=True)
    try:
        assert torch.equal(greedy(model, ids, cache, 40, disable_compile=True), expected)
    finally:
        handle.remove()
    assert [entry[1] for entry in phase_one] == list(range(length, length + config.decode_delay))
    assert len({entry[0] for entry in phase_one}) == 1
    assert cache.is_static and cache.prompt.keys[1].shape[2] == length + 20 + config.decode_delay
    assert torch.equal(cache.kept_positions(0), dynamic.kept_positions(0))
    short = StaticLatentKVCache(config, model=model, max_prompt_length=length - 1)
    assert torch.equal(greedy(model, ids, short, 40, disable_compile=True), expected)
    assert not short.prompt.keys


def test_captured_phase_one_compiles_one_graph_more_and_none_after() -> None:
    """Under transformers' compiled ``generate`` a captured phase 1 is one more graph (the prompt buffers' shapes), with
    no graph break: the phase-1 steps no longer run eagerly; another prompt length, reset between requests, compiles
    nothing and keeps the buffers' addresses."""
    model, ids, other = model_for("llama", EVICTING), prompt(300), prompt(420, seed=5)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cache = StaticLatentKVCache(EVICTING, model=model, max_prompt_length=512)
    got = greedy(model, ids, cache, 40, compile_config=cpu_compile())
    assert torch.equal(got, greedy(model, ids, LatentKVCache(EVICTING), 40, disable_compile=True))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert not torch._dynamo.utils.counters["graph_break"]
    addresses = {buffer.data_ptr() for buffer in (*cache.prompt.keys, *cache.prompt.values)}
    cache.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = greedy(model, other, cache, 70, compile_config=cpu_compile())
    assert torch.equal(got, greedy(model, other, LatentKVCache(EVICTING), 70, disable_compile=True))
    assert {buffer.data_ptr() for buffer in (*cache.prompt.keys, *cache.prompt.values)} == addresses


def held_storages(root: object) -> dict[int, int]:
    """Every tensor storage reachable from ``root`` through flexentropy's objects, lists, tuples and dicts: its
    address -> its bytes (views of one storage counted once)."""
    held: dict[int, int] = {}
    seen: set[int] = set()
    pending = [root]
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            held[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, list | tuple):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif type(item).__module__.startswith("flexentropy") and hasattr(item, "__dict__"):
            pending.extend(vars(item).values())
    return held


def windows_bytes(cache: StaticLatentKVCache) -> int:
    """Bytes of the query windows, the layers' and the static phase's."""
    windows = [layer.window for layer in cache.layers if layer.window is not None] + list(cache.static.window)
    return sum(window.untyped_storage().nbytes() for window in windows)


def test_a_prompt_is_held_once_in_the_prompt_buffers() -> None:
    """With ``max_prompt_length`` a prompt's keys and values are written straight into the prompt buffers, which the
    layers read as views, in the first request (the buffers made at its first update) as in the next ones: after the
    prompt's forward the cache holds the buffers and the query windows, and no second copy of the prompt (each layer
    kept one of its own beside the buffers before: 16 GiB more at 128k on an 8B model). So does it at every step
    through phase 1 and a later turn during phase 1 (the layers get views of the buffers and append in place), up
    to the first eviction: nothing is held but the buffers, the query windows and the step's counters."""
    config = EVICTING.replace(decode_delay=6)
    cache = StaticLatentKVCache(config, num_layers=3, max_prompt_length=400)
    gen = torch.Generator().manual_seed(0)

    def forward(length: int) -> None:
        begin_step(cache, length)
        assert extra() == 0, "a copy of the prompt's KV held beside the prompt buffers"
        for layer_idx in range(3):
            query = torch.randn(1, 4, length, 16, generator=gen)
            cache.observe_queries(query, layer_idx)
            cache.update(torch.randn(1, 2, length, 16, generator=gen), torch.randn(1, 2, length, 16, generator=gen),
                         layer_idx)
            if length == 1:
                cache.attend(query, layer_idx)
        end_step(cache, length)

    def extra() -> int:
        """Bytes held beyond the buffers, the query windows and the step's counters."""
        rows = cache.static.batch
        counters = sum(t.untyped_storage().nbytes() for t in (*rows.device.values(), rows.row_index))
        buffers = cache.prompt.nbytes() + cache.main.nbytes()
        return sum(held_storages(cache).values()) - buffers - windows_bytes(cache) - counters

    for request in range(2):
        cache.reset()
        forward(300)
        assert cache.stage is None and extra() == 0, f"request {request}: the prompt's KV held twice"
        keys = cache.layers[1].keys
        assert keys.untyped_storage().data_ptr() == cache.prompt.keys[1].data_ptr() and keys.shape[2] == 300
        forward(1)
        assert cache.stage is cache.prompt and extra() == 0
    forward(1)
    forward(3)   # a later turn inside phase 1: the layers get views of the buffers and append in place
    assert cache.stage is None and cache.layers[0].stored == 305 and extra() == 0
    assert cache.layers[2].keys.untyped_storage().data_ptr() == cache.prompt.keys[2].data_ptr()
    while not cache.is_static:
        forward(1)
    assert cache.evictions == 1


def test_a_budget_above_the_request_is_a_dense_captured_decode() -> None:
    """With ``decode_delay=0`` and a budget above what a request holds, the cache switches to its buffers at the
    first step and never evicts: the tokens of a full ``DynamicCache`` (the dense decode baseline of
    ``profiling/decode_static.py``)."""
    from transformers import DynamicCache

    config = EVICTING.replace(decode_budget=300 + 40, decode_delay=0)
    model, ids = model_for("llama", config), prompt(300)
    cache = StaticLatentKVCache(config, model=model)
    got = greedy(model, ids, cache, 40, disable_compile=True)
    assert torch.equal(got, greedy(model, ids, DynamicCache(config=model.config), 40, disable_compile=True))
    assert cache.is_static and cache.evictions == 0 and cache.stored_length(0) == 300 + 39


def test_validation() -> None:
    with pytest.raises(ValueError, match="recompress_every"):
        StaticLatentKVCache(EVICTING.replace(recompress_every=None), num_layers=2)
    with pytest.raises(ValueError, match="model= or num_layers="):
        StaticLatentKVCache(EVICTING)
    with pytest.raises(ValueError, match="max_prompt_length must be >= 1, got 0"):
        StaticLatentKVCache(EVICTING, num_layers=2, max_prompt_length=0)
    assert StaticLatentKVCache(EVICTING, num_layers=2).is_compileable
    with pytest.raises(ValueError, match="decode_kernel"):
        EVICTING.replace(decode_kernel="triton")
    flash = EVICTING.replace(decode_kernel="flash")
    model = model_for("llama", flash)
    with pytest.raises(ValueError, match="decode_kernel='flash' needs a CUDA device"):
        greedy(model, prompt(300), StaticLatentKVCache(flash, model=model), 8, disable_compile=True)


def test_a_cache_for_another_layer_count_says_so() -> None:
    """A cache built for fewer layers than the model has, or for more, fails at the model's first forward, with the
    count it was built for, before anything is stored (issue 69: the first layers stored the prompt)."""
    model, ids = model_for("llama", EVICTING), prompt(300)
    for layers in (1, 5):
        cache = StaticLatentKVCache(EVICTING, num_layers=layers)
        with pytest.raises(ValueError, match=f"built for {layers} layers, but a model of 3 layers runs on it: pass "
                                             f"model="):
            greedy(model, ids, cache, 4, disable_compile=True)
        assert [layer.seen for layer in cache.layers] == [0] * layers


def test_flash_decode_traces_to_its_output_shape() -> None:
    """The kernel is a custom op: a compiled step traces it through its fake (no flash-attn-4 needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        query, keys = torch.empty(2, 8, 1, 64, dtype=torch.bfloat16), torch.empty(2, 2, 96, 64, dtype=torch.bfloat16)
        out = flash_decode(query, keys, torch.empty(2, 2, 96, 32, dtype=torch.bfloat16),
                           torch.empty(2, dtype=torch.int32))
    assert out.shape == (2, 8, 1, 32) and out.dtype == torch.bfloat16


def partial_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`flexentropy.kv.decode_attention.PartialAttention` in float64: each row over its first ``lengths[b]``
    entries, and the log-sum-exp of its scores (-inf, output 0, for a row of none)."""
    group = query.shape[2] // keys.shape[2]
    k, v = (t.double().transpose(1, 2).repeat_interleave(group, 1) for t in (keys, values))
    scores = query.double().transpose(1, 2) @ k.transpose(-1, -2) * scale                 # [B, Hq, 1, T]
    scores = scores.masked_fill(torch.arange(k.shape[2]) >= lengths[:, None, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (scores - lse[..., None]).exp().nan_to_num(0.0) @ v
    return out.transpose(1, 2).to(query.dtype), lse.float()


@pytest.mark.parametrize(("capacity", "splits", "length"), [(96, 8, 96), (96, 8, 13), (96, 16, 1), (1056, 8, 1030)])
def test_flash_decode_split_into_parts_equals_one_pass(capacity: int, splits: int, length: int) -> None:
    """One row's entries cut into equal parts, each attended on its own (empty parts included) and merged by their
    log-sum-exps, is the attention over the row's first ``lengths`` entries."""
    gen = torch.Generator().manual_seed(capacity + length)
    query = torch.randn(1, 8, 1, 16, generator=gen)
    keys, values = (torch.randn(1, 2, capacity, 16, generator=gen) for _ in range(2))
    lengths = torch.tensor([length], dtype=torch.int32)
    got = flash_decode(query, keys, values, lengths, splits=splits, partial=partial_reference)
    torch.testing.assert_close(got.double(), reference.prefix_decode_attention(query, keys, values, lengths))
    with pytest.raises(ValueError, match="equal parts"):
        flash_decode(query.expand(2, -1, -1, -1), keys.expand(2, -1, -1, -1), values.expand(2, -1, -1, -1),
                     lengths.expand(2), splits=splits, partial=partial_reference)


@pytest.mark.cuda
@pytest.mark.parametrize(("batch", "capacity", "splits"), [(1, 1056, 1), (8, 1056, 1), (1, 1056, 8), (1, 131088, 16)])
def test_cuda_flash_decode_matches_reference(batch: int, capacity: int, splits: int) -> None:
    """flash-attn-4's decode kernel (needs it installed) against the float64 reference over each row's first
    ``lengths[b]`` entries, in one pass or in parts, eager and in a captured compiled step."""
    pytest.importorskip("flash_attn.cute")
    gen = torch.Generator(device="cuda").manual_seed(batch)
    query = torch.randn(batch, 32, 1, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    keys, values = (torch.randn(batch, 8, capacity, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
                    for _ in range(2))
    lengths = torch.tensor([capacity - 26, 17, capacity, 500, 1, 1030, 900, 64][:batch], dtype=torch.int32,
                           device="cuda")
    expected = reference.prefix_decode_attention(query, keys, values, lengths).float().cuda()
    step = torch.compile(flash_decode, mode="reduce-overhead", fullgraph=True)
    for fn in (flash_decode, step, step, step):
        got = fn(query, keys, values, lengths, splits=splits)
        torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=0)


def test_hf_compiled_generate_matches_eager_without_recompiles() -> None:
    """``generate``'s compiled decode runs the step driver: the phase-1 steps run eagerly, and the static step runs
    its decoder layers in one compiled function, each handed its own buffers, so the three layers compile one graph
    with no break (a layer index read inside would compile one per layer); after one request, another prompt length
    and more steps compile nothing (``error_on_recompile``)."""
    model = model_for("llama", EVICTING)
    ids = prompt(300)
    expected = greedy(model, ids, StaticLatentKVCache(EVICTING, model=model), 40, disable_compile=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert torch.equal(greedy(model, ids, StaticLatentKVCache(EVICTING, model=model), 40,
                              compile_config=cpu_compile()), expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    other = prompt(420, seed=5)
    expected = greedy(model, other, LatentKVCache(EVICTING), 70, disable_compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = greedy(model, other, StaticLatentKVCache(EVICTING, model=model), 70, compile_config=cpu_compile())
    assert torch.equal(got, expected)


def test_compiled_layers_leave_the_layers_as_they_were() -> None:
    """A static step runs each decoder layer through the compiled region and gives the layers back their own
    ``forward`` afterwards: a layer's instance ``forward`` set by another library survives, the others have none."""
    from flexentropy.engine.compiled_layer import compiled_layers, decoder_layers

    model = model_for("llama", EVICTING)
    layers = decoder_layers(model)
    own = layers[1].forward   # stands for a hook another library put on one layer
    layers[1].forward = own
    ran: list[int] = []

    def region(layer: nn.Module, *args: object, **kwargs: object) -> object:
        ran.append(kwargs["flexentropy_step"].keys.data_ptr())
        return type(layer).forward(layer, *args, **kwargs)

    cache = StaticLatentKVCache(EVICTING, model=model)
    greedy(model, prompt(300), cache, 8, disable_compile=True)   # to the static phase
    with torch.no_grad(), compiled_layers(model, region, cache):
        model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[308]]), **{cache_keyword(model): cache},
              use_cache=True)
    assert ran == [cache.stage.keys[i].data_ptr() for i in range(3)]   # each layer its own buffers, in order
    assert vars(layers[1])["forward"] is own
    assert "forward" not in vars(layers[0]) and "forward" not in vars(layers[2])


def test_the_compiled_layers_refuse_to_fall_back_to_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its recompile limit the decode step's compiled layer raises `RecompileLimitError` instead of running
    every layer eagerly from then on: here a limit of one graph, and a cache with two stages (phase 1 captured)."""
    from flexentropy import _compile

    model = model_for("llama", EVICTING)
    torch._dynamo.reset()
    monkeypatch.setattr(_compile, "RECOMPILE_LIMIT", 1)
    with torch._dynamo.config.patch(recompile_limit=1), pytest.raises(_compile.RecompileLimitError,
                                                                      match="recompile limit"):
        greedy(model, prompt(300), StaticLatentKVCache(EVICTING, model=model, max_prompt_length=400), 8,
               compile_config=cpu_compile())
    torch._dynamo.reset()


class TinyEntropyLM(nn.Module):
    """Embedding, `EntropyAttention` layers with residuals, LM head: a model built from flexentropy's module."""

    def __init__(self, config: fe.EntropyConfig, layers: int = 2, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.layers = nn.ModuleList(fe.EntropyAttention(hidden, 4, 2, layer_idx=i, config=config)
                                    for i in range(layers))
        self.head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, cache: object, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed(tokens)
        for layer in self.layers:
            hidden = hidden + layer(hidden, cache, position_ids)
        return self.head(hidden)


def plain_run(model: TinyEntropyLM, ids: torch.Tensor, steps: int, compiled: object = None,
              cache_class: type = StaticLatentKVCache, config: fe.EntropyConfig = EVICTING) -> torch.Tensor:
    """The plain loop of a model without hooks: the driver's ``begin_step`` and ``end_step`` around each forward;
    ``compiled`` runs the steps of the static stage."""
    cache = cache_class(config, num_layers=len(model.layers))
    out = []
    with torch.no_grad():
        tokens = model(ids, cache)[:, -1:].argmax(dim=-1)
        positions = torch.full_like(tokens, ids.shape[1])
        for _ in range(steps):
            begin_step(cache, 1)
            static = isinstance(cache, StaticLatentKVCache) and cache.stage is not None
            run = compiled if compiled is not None and static else model
            tokens = run(tokens, cache, positions)[:, -1:].argmax(dim=-1)
            end_step(cache, 1)
            out.append(tokens)
            positions = positions + 1
    return torch.cat(out, dim=1)


def test_plain_loop_static_matches_dynamic_entropy_attention() -> None:
    """The plain loop over `EntropyAttention` layers at a covering budget: the buffers' masked attention gives the
    dynamic cache's tokens (with eviction the two differ by design: the static cache decides before the step's
    queries are handed over, `EntropyAttention` hands them over before ``update``)."""
    torch.manual_seed(0)
    model = TinyEntropyLM(COVERING.replace(dense_prefix=4096)).eval()
    ids = prompt(200)
    static = plain_run(model, ids, 40, config=COVERING)
    assert torch.equal(static, plain_run(model, ids, 40, cache_class=LatentKVCache, config=COVERING))
    assert len(set(static[0].tolist())) > 5  # a random model that is not stuck on one token


@pytest.mark.slow
def test_plain_loop_compiled_matches_eager_without_recompiles() -> None:
    """``torch.compile`` of the step (inductor on CPU): same greedy tokens as eager; a second prompt length and
    more steps compile nothing new."""
    torch.manual_seed(0)
    model = TinyEntropyLM(EVICTING.replace(dense_prefix=4096)).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=False)
    ids = prompt(200)
    assert torch.equal(plain_run(model, ids, 30, compiled), plain_run(model, ids, 30))
    other = prompt(230, seed=4)
    expected = plain_run(model, other, 60)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(plain_run(model, other, 60, compiled), expected)


@pytest.mark.slow
def test_warm_up_then_no_recompile() -> None:
    """After `fe.warm_up` over two lengths (sparse prefill compiled, the static decode graph), a third length
    in the range compiles nothing; the serving cache passed to it comes back empty, and decodes in the buffers the
    warm-up wrote."""
    model = model_for("llama", EVICTING, prefill="entropy")
    torch._dynamo.reset()
    serving = StaticLatentKVCache(EVICTING, model=model)
    times = fe.warm_up(model, [300, 421], compile_config=cpu_compile(), cache=serving)
    assert set(times) == {300, 421} and serving.get_seq_length() == 0
    addresses = static_addresses(serving)
    ids = prompt(377, seed=6)
    expected = greedy(model, ids, LatentKVCache(EVICTING), 30, disable_compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(greedy(model, ids, serving, 30, compile_config=cpu_compile()), expected)
        got = greedy(model, ids, StaticLatentKVCache(EVICTING, model=model), 30, compile_config=cpu_compile())
    assert torch.equal(got, expected) and static_addresses(serving) == addresses
    with pytest.raises(TypeError, match="warm_up warms a StaticLatentKVCache, got LatentKVCache"):
        fe.warm_up(model, [300], cache=LatentKVCache(EVICTING))


@pytest.mark.slow
def test_warm_up_writes_and_reads_compiled_artifacts(tmp_path: Path) -> None:
    """``warm_up(..., artifacts=path)`` writes inductor's compiled artifacts to ``path``; torch takes them back (a new
    process loads them before it compiles), and a second warm-up with the file loads it and rewrites it."""
    config = EVICTING.replace(decode_delay=1, recompress_every=2)
    torch.manual_seed(0)
    model = enable(LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": 1})).eval(), config)
    torch._dynamo.reset()
    path = tmp_path / "artifacts.bin"
    fe.warm_up(model, [200], compile_config=cpu_compile("inductor"), new_tokens=4, artifacts=path)
    assert path.is_file() and path.stat().st_size > 0
    info = torch.compiler.load_cache_artifacts(path.read_bytes())
    assert info is not None and info.inductor_artifacts
    first = path.stat().st_mtime_ns
    fe.warm_up(model, [200], compile_config=cpu_compile("inductor"), new_tokens=4, artifacts=path)
    assert path.stat().st_mtime_ns >= first and path.stat().st_size > 0


def test_a_user_compiled_model_decodes_phase_one_through_placeholders() -> None:
    """``torch.compile(model)`` without ``generate``: phase-1 steps are traced, so their cache work runs eagerly
    from inside the compiled forward and ``update`` returns placeholders; the tokens are the dynamic cache's."""

    def loop(forward: nn.Module, model: nn.Module, ids: torch.Tensor, cache: object, steps: int) -> torch.Tensor:
        keyword = cache_keyword(model)
        with torch.no_grad():
            token = forward(input_ids=ids, **{keyword: cache}, use_cache=True).logits[:, -1:].argmax(-1)
            tokens = [token]
            for i in range(steps - 1):
                position = torch.tensor([[ids.shape[1] + i]])
                logits = forward(input_ids=token, **{keyword: cache}, use_cache=True, position_ids=position).logits
                token = logits[:, -1:].argmax(-1)
                tokens.append(token)
        return torch.cat(tokens, dim=1)

    model = model_for("llama", EVICTING)
    ids = prompt(300)
    expected = loop(model, model, ids, LatentKVCache(EVICTING), 30)
    torch._dynamo.reset()
    got = loop(torch.compile(model, backend="eager"), model, ids, StaticLatentKVCache(EVICTING, model=model), 30)
    assert torch.equal(got, expected)


@pytest.mark.parametrize(("config", "length"), [(COVERING, 200), (EVICTING, 300)], ids=["covering", "evicting"])
def test_greedy_generate_gives_generates_tokens(config: fe.EntropyConfig, length: int) -> None:
    """The plain HF loop (eager) returns what greedy ``generate`` returns: one row, a left-padded batch, and
    transformers' dense ``StaticCache``."""
    from transformers import StaticCache

    model = model_for("llama", config)
    ids = prompt(length)
    expected = greedy(model, ids, StaticLatentKVCache(config, model=model), 30, disable_compile=True)
    assert torch.equal(fe.greedy_generate(model, ids, StaticLatentKVCache(config, model=model), 30), expected)
    batch, mask = prompt(length, seed=3, batch=2), torch.ones(2, length, dtype=torch.long)
    batch[1, :17], mask[1, :17] = 0, 0
    expected = greedy(model, batch, StaticLatentKVCache(config, model=model), 20, attention_mask=mask,
                      disable_compile=True)
    got = fe.greedy_generate(model, batch, StaticLatentKVCache(config, model=model), 20, attention_mask=mask)
    assert torch.equal(got, expected)
    model.set_attn_implementation("sdpa")
    expected = greedy(model, ids, StaticCache(config=model.config, max_cache_len=length + 40), 30,
                      disable_compile=True)
    got = fe.greedy_generate(model, ids, StaticCache(config=model.config, max_cache_len=length + 40), 30)
    assert torch.equal(got, expected)


def test_greedy_generate_validation() -> None:
    from transformers import DynamicCache

    model = model_for("llama", EVICTING)
    ids = prompt(40)
    with pytest.raises(TypeError, match="StaticLatentKVCache or transformers' StaticCache"):
        fe.greedy_generate(model, ids, DynamicCache(config=model.config), 4)
    with pytest.raises(ValueError, match="int64"):
        fe.greedy_generate(model, ids.int(), StaticLatentKVCache(EVICTING, model=model), 4)
    with pytest.raises(ValueError, match="must match input_ids"):
        fe.greedy_generate(model, ids, StaticLatentKVCache(EVICTING, model=model), 4,
                           attention_mask=torch.ones(1, 39, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        fe.greedy_generate(model, ids, StaticLatentKVCache(EVICTING, model=model), 0)
    right = torch.ones(2, 40, dtype=torch.long)
    right[1, 30:] = 0
    for mask in (right, torch.ones(2, 40, dtype=torch.long).index_fill_(0, torch.tensor([1]), 0)):
        with pytest.raises(ValueError, match="left padding only"):
            fe.greedy_generate(model, ids.expand(2, -1), StaticLatentKVCache(EVICTING, model=model), 4,
                               attention_mask=mask)


def test_warm_up_checks_its_artifacts_path_first(tmp_path: Path) -> None:
    """A folder, or a file in a missing folder, fails before any work; a file torch cannot read is reported and
    written anew after the warm-up."""
    model = model_for("llama", EVICTING)
    for path in (tmp_path, tmp_path / "missing" / "artifacts.bin"):
        with pytest.raises(ValueError, match="warm_up\\(artifacts=...\\)"):
            fe.warm_up(model, [300], config=EVICTING, artifacts=path)
    broken = tmp_path / "artifacts.bin"
    broken.write_bytes(b"not torch's")
    with pytest.warns(UserWarning, match="could not load the compiled artifacts"):
        fe.warm_up(model, [300], config=EVICTING, new_tokens=2, artifacts=broken)
    assert broken.read_bytes() != b"not torch's"


def test_warm_up_keeps_flash_attn_4_kernels_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 57: flash-attn-4 compiles its CuTe kernels again in every process unless its persistent kernel cache is
    on, which it reads once, when ``flash_attn.cute`` is imported. `fe.warm_up` turns it on where the variable is unset
    and flash-attn-4 not imported yet; a user's setting, or an import already made, is left alone."""
    import sys

    from flexentropy.engine.warm_up import FLASH_KERNEL_CACHE, keep_flash_kernels

    monkeypatch.delitem(sys.modules, "flash_attn.cute", raising=False)
    monkeypatch.delenv(FLASH_KERNEL_CACHE, raising=False)
    fe.warm_up(model_for("llama", EVICTING), [200], config=EVICTING, new_tokens=2)
    assert os.environ[FLASH_KERNEL_CACHE] == "1"
    monkeypatch.setenv(FLASH_KERNEL_CACHE, "0")
    assert not keep_flash_kernels() and os.environ[FLASH_KERNEL_CACHE] == "0"
    monkeypatch.delenv(FLASH_KERNEL_CACHE)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", object())   # imported before: too late to turn it on
    assert not keep_flash_kernels() and FLASH_KERNEL_CACHE not in os.environ
    monkeypatch.delitem(sys.modules, "flash_attn.cute")
    assert keep_flash_kernels() and os.environ[FLASH_KERNEL_CACHE] == "1"


def test_greedy_generate_compiled_after_its_warm_up_compiles_nothing() -> None:
    """``warm_up(loop=True)`` compiles the loop's static decode graph (one graph, no break); another prompt
    length and more steps then compile nothing, with the eager tokens."""
    model = model_for("llama", EVICTING)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fe.warm_up(model, [300], config=EVICTING, compile_config=cpu_compile(), loop=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    ids = prompt(377, seed=6)
    expected = greedy(model, ids, LatentKVCache(EVICTING), 50, disable_compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = fe.greedy_generate(model, ids, StaticLatentKVCache(EVICTING, model=model), 50,
                                 compile_config=cpu_compile())
    assert torch.equal(got, expected)


@pytest.mark.parametrize("compiled", [False, True])
def test_decode_steps_never_wait_on_the_device(monkeypatch: pytest.MonkeyPatch, compiled: bool) -> None:
    """No host-device synchronisation on the decode path: over 40 steps after the prompt, through the first eviction,
    the recompressions and the static steps (eager forwards, or the compiled layers' eager surroundings, which a CUDA
    graph records, and the cache's decisions), nothing reads a tensor's value on the host (``item``, ``__bool__``,
    ``__int__``, ``__float__``, ``tolist``, ``nonzero``: each waits for the GPU there), and no host value is copied
    into a tensor (a copy from pageable memory waits too)."""
    from flexentropy.engine.driver import step_driver

    model = model_for("llama", EVICTING)
    cache = StaticLatentKVCache(EVICTING, model=model, max_prompt_length=400)
    ids = prompt(300)
    driver = step_driver(model, cpu_compile(), torch.device("cpu"), compiled=compiled)
    if compiled:   # compile the steps first: tracing reads host values, a step does not
        greedy(model, ids, cache, 24, compile_config=cpu_compile())
        cache.reset()
    reads: list[str] = []
    with torch.no_grad():
        logits = model(input_ids=ids, **{cache_keyword(model): cache}, use_cache=True).logits
        tokens, position = logits[:, -1:].argmax(-1), torch.tensor([[300]])
        for name in ("item", "__bool__", "__int__", "__float__", "tolist", "nonzero"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _f=original, **k: reads.append(_n)
                                or _f(self, *a, **k))
        copy = torch.Tensor.copy_

        def checked_copy(self: torch.Tensor, source: object, *args: object, **kwargs: object) -> torch.Tensor:
            if not isinstance(source, torch.Tensor) or source.device != self.device:   # a host value to the device
                reads.append("copy_ from the host")
            return copy(self, source, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "copy_", checked_copy)
        for _ in range(40):
            tokens = driver(tokens, position, cache).logits[:, -1:].argmax(-1)
            position = position + 1
        monkeypatch.undo()
    assert cache.is_static and cache.evictions >= 3
    assert reads == []


@pytest.mark.parametrize("cache_class", [LatentKVCache, StaticLatentKVCache])
def test_no_delay_evicts_each_layer_at_the_end_of_its_prompt_forward(cache_class: type) -> None:
    """``decode_delay=0``: each layer keeps ``decode_budget`` entries as soon as its attention over the prompt has run,
    so a prompt's full KV is held for one layer at a time (measured after each decoder layer's forward, with the
    cache's own byte count); the tokens are the oracle's decisions' (the property tests), and a left-padded batch
    keeps its rows' solo tokens."""
    config = EVICTING.replace(decode_delay=0)
    model, ids = model_for("llama", config), prompt(300)
    cache = cache_class(config, model=model)
    held: list[list[int]] = []
    full = cache_class(EVICTING.replace(decode_delay=0, decode_budget=512), model=model)
    handles = [layer.register_forward_hook(lambda *_: held.append([cache.stored_length(i) for i in range(3)]))
               for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids, **{cache_keyword(model): cache}, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    budget = config.decode_budget
    assert held == [[budget, 0, 0], [budget, budget, 0], [budget, budget, budget]]
    with torch.no_grad():
        model(ids, **{cache_keyword(model): full}, use_cache=True)
    assert cache.nbytes() < full.nbytes() / 2
    long, short = prompt(300, seed=2), prompt(260, seed=3)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 40, dtype=torch.long), short], dim=1)])
    mask = (batch != 0).long()
    mask[0] = 1
    got = greedy(model, batch, cache_class(config, model=model), 24, attention_mask=mask, disable_compile=True)
    for row, solo in enumerate((long, short)):
        assert torch.equal(got[row], greedy(model, solo, cache_class(config, model=model), 24,
                                            disable_compile=True)[0])


@pytest.mark.parametrize("config", [COVERING, EVICTING], ids=["covering", "evicting"])
def test_a_batch_of_prompts_gives_each_its_own_tokens(config: fe.EntropyConfig) -> None:
    """`fe.generate_batch`: five prompts of different lengths through two rows (prefilled one by one, each evicted at
    the end of its prompt, rows freed and taken again) give each prompt the tokens of its run alone through
    `greedy_generate`; at an evicting budget too (every row recompresses on its own count); a stop token ends a row
    early, the token kept."""
    model = model_for("llama", config)
    alone_config = config.replace(decode_delay=0)
    prompts = [prompt(length, seed=seed)[0] for seed, length in enumerate((300, 260, 333, 301, 280))]
    got = fe.generate_batch(model, prompts, 30, rows=2, config=config)
    for ids, tokens in zip(prompts, got, strict=True):
        alone = fe.greedy_generate(model, ids[None], StaticLatentKVCache(alone_config, model=model), 30)[0]
        assert torch.equal(tokens, alone)
    stop = int(got[1][5])
    stopped = fe.generate_batch(model, prompts[:3], 30, rows=2, config=config, eos_token_id=stop)
    cut = (got[1] == stop).nonzero()[0, 0] + 1
    assert torch.equal(stopped[1], got[1][:cut])
    with pytest.raises(ValueError, match="prompt 1 is torch.int32"):
        fe.generate_batch(model, [prompts[0], prompts[1].int()], 4, config=config)


def test_a_batch_takes_any_iterable_of_prompts_and_refuses_a_mapping_config() -> None:
    """Issue 77: ``fe.generate_batch(model, (p for p in prompts), ...)`` failed ("object of type 'generator' has no
    len()") and ``config={"decode_budget": 64}`` on ``.replace``; a generator gives the list's tokens, a tensor of
    prompts and a mapping config are refused with what to pass instead."""
    model = model_for("llama", EVICTING)
    prompts = [prompt(length, seed=seed)[0] for seed, length in enumerate((300, 260))]
    expected = fe.generate_batch(model, prompts, 6, rows=2, config=EVICTING)
    got = fe.generate_batch(model, (ids for ids in prompts), 6, rows=2, config=EVICTING)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    with pytest.raises(TypeError, match=r"generate_batch.config must be an EntropyConfig, got dict \(build one from "
                                        r"the mapping's fields: EntropyConfig\(\*\*values\)\)"):
        fe.generate_batch(model, prompts, 4, config={"decode_budget": 64})
    for wrong, says in ((prompts[0], r"got a tensor \[300\]: pass \[ids\] for one prompt"), (7, "got int")):
        with pytest.raises(TypeError, match=f"generate_batch takes prompts as a list .*{says}"):
            fe.generate_batch(model, wrong, 4, config=EVICTING)


@pytest.mark.slow
def test_a_batch_of_prompts_compiles_one_step_with_the_eager_tokens() -> None:
    """`fe.generate_batch` through the compiled step (inductor on the CPU): one graph, no break, the eager tokens; a
    call with one prompt for two rows runs the same step."""
    model = model_for("llama", EVICTING)
    prompts = [prompt(length, seed=seed)[0] for seed, length in enumerate((300, 260, 333))]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got = fe.generate_batch(model, prompts, 30, rows=2, config=EVICTING, compile_config=cpu_compile("inductor"))
    alone = fe.generate_batch(model, prompts[:1], 30, rows=2, config=EVICTING, compile_config=cpu_compile("inductor"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1   # fewer prompts than rows: the same step
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch.equal(alone[0], got[0])
    eager = fe.generate_batch(model, prompts, 30, rows=2, config=EVICTING, compiled=False)
    assert all(torch.equal(a, b) for a, b in zip(got, eager, strict=True))


def test_a_batch_stops_at_any_of_several_stop_tokens() -> None:
    """Issue 57: ``fe.generate_batch(..., eos_token_id=[a, b])`` (a list, as ``generate`` takes) ignored the stop
    tokens; each row now ends at the first of them (kept), from a list, a tuple or a tensor."""
    model = model_for("llama", EVICTING)
    prompts = [prompt(length, seed=seed)[0] for seed, length in enumerate((300, 260, 333))]
    full = fe.generate_batch(model, prompts, 20, rows=2, config=EVICTING)
    stops = [int(full[0][3]), int(full[2][6])]
    expected = []
    for tokens in full:
        ends = [i for i, token in enumerate(tokens.tolist()) if token in stops]
        expected.append(tokens[:ends[0] + 1] if ends else tokens)
    assert any(len(cut) < len(tokens) for cut, tokens in zip(expected, full, strict=True))
    for stop in (stops, tuple(stops), torch.tensor(stops)):
        got = fe.generate_batch(model, prompts, 20, rows=2, config=EVICTING, eos_token_id=stop)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), stop
    with pytest.raises(TypeError, match="eos_token_id must be a token id"):
        fe.generate_batch(model, prompts, 4, config=EVICTING, eos_token_id=["a"])


def test_greedy_generate_after_generate_batch_on_the_same_cache() -> None:
    """Issue 57: `fe.greedy_generate` on a cache that `fe.generate_batch` used, without ``reset()``, raised a tensor
    size mismatch. `generate_batch` leaves the cache empty, so the next request gets a fresh cache's tokens; a cache
    still serving rows one by one (``open``) refuses a prompt and names ``cache.reset()``."""
    config = EVICTING.replace(decode_delay=0)
    model, ids = model_for("llama", config), prompt(280, seed=7)
    prompts = [prompt(length, seed=seed)[0] for seed, length in enumerate((300, 260, 333))]
    cache = StaticLatentKVCache(config, model=model)
    fe.generate_batch(model, prompts, 10, rows=2, config=EVICTING, cache=cache)
    got = fe.greedy_generate(model, ids, cache, 10)
    assert torch.equal(got, fe.greedy_generate(model, ids, StaticLatentKVCache(config, model=model), 10))
    single = LatentKVCache(config, model=model)
    with torch.no_grad():
        model(input_ids=ids, **{cache_keyword(model): single}, use_cache=True)
    cache.open(2, single)
    with pytest.raises(ValueError, match=r"serves its rows one by one .* call cache.reset\(\)"):
        fe.greedy_generate(model, ids, cache, 4)


def test_numpy_integers_reach_transformers_as_ints() -> None:
    """Issue 69: ``fe.warm_up(model, lengths, new_tokens=np.int64(3))`` passed flexentropy's check, then transformers
    refused it (``min_length`` has to be a non-negative integer, for a model with a stop token). warm_up,
    greedy_generate and generate_batch take numpy integers as Python's ints: the same tokens, timings keyed by int."""
    model, ids = model_for("llama", EVICTING), prompt(300)
    model.generation_config.eos_token_id = 2
    for loop in (False, True):
        seconds = fe.warm_up(model, [np.int64(300)], config=EVICTING, batch_size=np.int64(1), new_tokens=np.int64(3),
                             loop=loop)
        assert [type(length) for length in seconds] == [int], loop
    assert torch.equal(fe.greedy_generate(model, ids, StaticLatentKVCache(EVICTING, model=model), np.int64(5)),
                       fe.greedy_generate(model, ids, StaticLatentKVCache(EVICTING, model=model), 5))
    prompts = [ids[0], prompt(260, seed=2)[0]]
    got = fe.generate_batch(model, prompts, np.int64(5), rows=np.int64(2), config=EVICTING)
    expected = fe.generate_batch(model, prompts, 5, rows=2, config=EVICTING)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


class Terminal(io.StringIO):
    """A stderr that says it is a terminal: tqdm draws its bars there."""

    def isatty(self) -> bool:
        return True


def test_warm_up_takes_one_length_and_shows_its_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 77: ``fe.warm_up(model, 300)`` failed ("'int' object is not iterable"), ``"300"`` was read as the
    length 3, and ``config={...}`` failed on ``.replace``; one int is one length, a string or a mapping is refused
    before any work, and on a terminal a progress bar names the lengths (the warm-up said nothing for minutes)."""
    model = model_for("llama", EVICTING)
    for lengths, says in (("300", "warm_up takes lengths as prompt lengths in tokens: a list of ints"),
                          (300.0, "got float 300.0")):
        with pytest.raises(TypeError, match=says):
            fe.warm_up(model, lengths, config=EVICTING)
    with pytest.raises(TypeError, match=r"warm_up.config must be an EntropyConfig, got dict \(build one from"):
        fe.warm_up(model, [300], config={"decode_budget": 64})
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert list(fe.warm_up(model, 300, config=EVICTING, new_tokens=2, loop=True)) == [300]
    assert "warm_up (300 tokens)" in terminal.getvalue()


def test_warm_up_names_the_argument_it_was_given() -> None:
    """Issue 57: ``fe.warm_up(new_tokens=0)`` failed inside ``generate`` with an error naming ``max_new_tokens``."""
    model = model_for("llama", EVICTING)
    for loop in (False, True):
        with pytest.raises(ValueError, match="warm_up.new_tokens must be >= 1, got 0"):
            fe.warm_up(model, [300], config=EVICTING, new_tokens=0, loop=loop)
