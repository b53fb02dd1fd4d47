"""The vLLM plugin's parts that need no vLLM (`flexentropy.integrations.vllm.settings`, `.routing`, `.paged`): its
configuration checks, the split of a step between the sparse prefill and vLLM's kernel, and the reading of paged
caches laid out as vLLM's backends lay them out. The plugin inside a real vLLM engine: tests/test_vllm_plugin.py."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flexentropy as fe
from flexentropy import EntropyConfig, make_prefill
from flexentropy.config import Q_BLOCK_SIZE
from flexentropy.integrations.vllm.paged import (
    flash_pages,
    gather_indexed,
    gather_pages,
    learn_page_layout,
)
from flexentropy.integrations.vllm.routing import Chunk, parent_metadata, route, unsupported_step
from flexentropy.integrations.vllm.settings import CONFIG_KEY, check_layer, plugin_config, plugin_policy
from flexentropy.integrations.vllm.warm_up import warm_up_chunks
from flexentropy.settings import parse_settings

# --------------------------------------------------------------------------------------------------------------
# configuration


def test_config_off_without_the_entry_defaults_with_an_empty_one() -> None:
    """The plugin runs only where ``additional_config`` has a ``"flexentropy"`` entry; ``{}`` there: the defaults."""
    assert plugin_config({}) is None
    assert plugin_config(None) is None
    assert plugin_config({"other_plugin": {"x": 1}, CONFIG_KEY: None}) is None
    assert plugin_config({CONFIG_KEY: {}}) == EntropyConfig()
    config = plugin_config({CONFIG_KEY: {"dense_prefix": 8192, "coverage": [0.9, 0.7], "dense_layers": [0, 1],
                                         "prefill": "entropy"}})
    assert config == EntropyConfig(dense_prefix=8192, coverage=(0.9, 0.7), dense_layers=(0, 1))


@pytest.mark.parametrize(("entry", "error", "says"), [
    ({"dense_prefx": 1}, ValueError, "unknown field(s) ['dense_prefx']"),
    ({"decode_budget": 512}, ValueError, "KV-cache eviction"),
    ({"prefill": "flexprefill", "prefill_knobs": {"gamma": 2.0}}, ValueError,
     "additional_config['flexentropy']: FlexPrefill.gamma must be a finite number in [0.0, 1.0]"),
    ({"prefill": "sparse"}, ValueError, "additional_config['flexentropy']['prefill'] must be one of"),
    ({"prefill_knobs": [128]}, TypeError, "['prefill_knobs'] must be a mapping of the prefill policy's knobs"),
    ({"block_size": 96}, ValueError, "additional_config['flexentropy']: EntropyConfig.block_size must be 64 or 128"),
    ({"coverage": "high"}, TypeError, "coverage"),
    ([1, 2], TypeError, "must be a mapping of EntropyConfig fields"),
])
def test_config_errors_say_what_to_write(entry: object, error: type[Exception], says: str) -> None:
    with pytest.raises(error) as caught:
        plugin_config({CONFIG_KEY: entry})
    assert says in str(caught.value)


RULES = {"dense": {}, "entropy": {}, "entropy_paper": {}, "critiprefill": {"observation": "paper"},
         "streaming": {"window": 512}, "flexprefill": {"gamma": 0.8, "tau": 0.2}, "xattention": {"threshold": 0.8},
         "vertical_slash": {"vertical": 100, "slash": 200}}
"""Every rule of `flexentropy.PREFILL_POLICIES`, with knobs of its own where it has some."""


def test_every_rule_is_chosen_by_the_entry_and_read_once() -> None:
    """``{"prefill": name, "prefill_knobs": {...}}`` picks any rule of `flexentropy.PREFILL_POLICIES` with its knobs
    (issue 74: the plugin refused every rule but ``entropy``); the entry is read once per process, every caller of
    the engine getting the same policy object (the plugin parsed it four times)."""
    assert set(RULES) == set(fe.PREFILL_POLICIES)
    for name, knobs in RULES.items():
        entry = {"dense_prefix": 1024, "prefill": name, "prefill_knobs": knobs}
        policy = plugin_policy({CONFIG_KEY: entry})
        assert policy == make_prefill(name, EntropyConfig(dense_prefix=1024), **knobs)
        assert plugin_policy({CONFIG_KEY: dict(entry), "other_plugin": 1}) is policy
        assert plugin_config({CONFIG_KEY: entry}) == EntropyConfig(dense_prefix=1024)
    assert plugin_policy({CONFIG_KEY: {}}) == make_prefill("entropy")


@pytest.mark.parametrize("entry", [
    {"dense_prefix": 8192, "coverage": [0.9, 0.7], "dense_layers": [0, 1]},
    MappingProxyType({"segment_size": 512, "block_size": 64, "prefill": "entropy"}),
])
def test_one_reader_for_the_record_and_the_plugin(entry: Mapping[str, object]) -> None:
    """A model config's record (`parse_settings`) and vLLM's ``additional_config`` entry are read by one reader: the
    same plain values (any mapping; JSON's lists as tuples) give the same `EntropyConfig`."""
    config = parse_settings(entry).config
    assert plugin_config({CONFIG_KEY: entry}) == config
    assert config == EntropyConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in entry.items()
                                      if k != "prefill"})


def test_the_reader_names_where_a_refused_value_came_from() -> None:
    for read, where in ((parse_settings, "config.flexentropy"),
                        (lambda entry: plugin_config({CONFIG_KEY: entry}), "additional_config['flexentropy']")):
        with pytest.raises(ValueError, match=re.escape(f"{where}: EntropyConfig.block_size must be 64 or 128")):
            read({"block_size": 96})
        with pytest.raises(ValueError, match=re.escape(f"{where}['prefill'] must be one of")):
            read({"prefill": "sparse"})


def test_layer_checks() -> None:
    plain = {"alibi_slopes": None, "sliding_window": None, "logits_soft_cap": None, "kv_cache_dtype": "auto",
             "attn_type": "decoder", "sinks": None}
    check_layer(**plain)
    check_layer(**{**plain, "logits_soft_cap": 0, "kv_cache_dtype": "bfloat16"})
    for change, says in (({"alibi_slopes": [0.5]}, "ALiBi"), ({"sliding_window": 4096}, "sliding window of 4096"),
                         ({"logits_soft_cap": 30.0}, "soft-cap of 30.0"), ({"sinks": torch.zeros(2)}, "sinks"),
                         ({"kv_cache_dtype": "fp8"}, "fp8 KV cache"),
                         ({"attn_type": "encoder_only"}, "encoder_only attention")):
        with pytest.raises(ValueError, match="leave the 'flexentropy' entry out") as caught:
            check_layer(**{**plain, **change})
        assert says in str(caught.value)


# --------------------------------------------------------------------------------------------------------------
# routing


POLICY = make_prefill("entropy", EntropyConfig(dense_prefix=1000))


def reference_route(query_lens: list[int], seq_lens: list[int], decode_len: int) -> tuple[list[Chunk], list[int], int]:
    """The rule, one request at a time."""
    chunks, dense, dense_prompts, start = [], [], 0, 0
    for r, (m, n) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if m > decode_len and n > POLICY.config.dense_prefix:
            chunks.append(Chunk(r, start, start + m, n - m))
        else:
            dense.append(r)
            dense_prompts += m > decode_len
        start += m
    return chunks, dense, dense_prompts


@st.composite
def steps(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """A batch of requests: decode rows, padding rows (no query), prompt chunks inside and past the dense prefix."""
    query_lens, seq_lens = [], []
    for _ in range(draw(st.integers(1, 8))):
        m = draw(st.sampled_from([0, 1, 2, 3, 64, 500, 999, 1000, 1001, 2048]))
        query_lens.append(m)
        seq_lens.append(m + draw(st.sampled_from([0, 1, 500, 999, 1000, 4000])))
    return query_lens, seq_lens


def starts_of(query_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32)


@given(steps(), st.sampled_from([1, 3]))
def test_route_matches_the_rule(step: tuple[list[int], list[int]], decode_len: int) -> None:
    query_lens, seq_lens = step
    routing = route(starts_of(query_lens), torch.tensor(seq_lens, dtype=torch.int32), POLICY, decode_len)
    chunks, dense, dense_prompts = reference_route(query_lens, seq_lens, decode_len)
    assert list(routing.chunks) == chunks
    assert routing.parent_requests.tolist() == dense
    assert routing.dense_prompt_chunks == dense_prompts
    assert all(c.key_length == seq_lens[c.request] for c in routing.chunks)


@dataclass
class Metadata:
    """The fields of vLLM's ``CommonAttentionMetadata`` that `parent_metadata` reads or carries (a stand-in)."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool | torch.Tensor = True
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    req_idx: np.ndarray | None = None
    mm_req_doc_ranges: dict | None = None
    _num_computed_tokens_cache: torch.Tensor | None = None


def metadata_of(query_lens: list[int], seq_lens: list[int]) -> Metadata:
    starts = starts_of(query_lens)
    tokens = int(starts[-1])
    return Metadata(query_start_loc=starts.clone(), query_start_loc_cpu=starts, seq_lens=torch.tensor(seq_lens),
                    num_reqs=len(query_lens), num_actual_tokens=tokens, max_query_len=max(query_lens),
                    max_seq_len=max(seq_lens), block_table_tensor=torch.arange(len(query_lens) * 5).view(-1, 5),
                    slot_mapping=torch.arange(100, 100 + tokens), seq_lens_cpu_upper_bound=torch.tensor(seq_lens),
                    req_idx=np.arange(len(query_lens)) + 7, _num_computed_tokens_cache=torch.zeros(1))


@given(steps())
def test_parent_metadata_is_the_sub_batch(step: tuple[list[int], list[int]]) -> None:
    query_lens, seq_lens = step
    metadata = metadata_of(query_lens, seq_lens)
    routing = route(metadata.query_start_loc_cpu, metadata.seq_lens_cpu_upper_bound, POLICY, 1)
    result = parent_metadata(metadata, routing)
    keep = routing.parent_requests.tolist()
    if not keep:
        assert result is None
        return
    sub, rows = result
    starts = metadata.query_start_loc_cpu.tolist()
    expected_rows = [t for r in keep for t in range(starts[r], starts[r + 1])]
    got_rows = list(range(rows.start, rows.stop)) if isinstance(rows, slice) else rows.tolist()
    assert got_rows == expected_rows
    assert isinstance(rows, slice) == (expected_rows == list(range(len(expected_rows))))
    assert sub.query_start_loc_cpu.tolist() == starts_of([query_lens[r] for r in keep]).tolist()
    assert torch.equal(sub.query_start_loc, sub.query_start_loc_cpu)
    assert sub.seq_lens.tolist() == [seq_lens[r] for r in keep] == sub.seq_lens_cpu_upper_bound.tolist()
    assert sub.block_table_tensor.tolist() == metadata.block_table_tensor[keep].tolist()
    assert sub.slot_mapping.tolist() == [100 + t for t in expected_rows]
    assert sub.req_idx.tolist() == [7 + r for r in keep]
    assert (sub.num_reqs, sub.num_actual_tokens) == (len(keep), len(expected_rows))
    assert sub.max_query_len == max(query_lens[r] for r in keep)
    assert sub.max_seq_len == max(seq_lens[r] for r in keep)
    assert sub._num_computed_tokens_cache is None


def test_unsupported_steps_are_named() -> None:
    metadata = metadata_of([1, 2000], [3000, 5000])
    assert unsupported_step(metadata) is None
    for change, says in (({"seq_lens_cpu_upper_bound": None}, "host copy"),
                         ({"causal": torch.ones(2, dtype=torch.bool)}, "non-causal"),
                         ({"mm_req_doc_ranges": {1: [(0, 10)]}}, "bidirectional")):
        assert says in unsupported_step(dataclasses.replace(metadata, **change))


# --------------------------------------------------------------------------------------------------------------
# paged caches


HEADS, PAGE, DIM = 3, 16, 8


def flash_writer(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """``FLASH_ATTN``'s layout: ``[pages, Hkv, page, 2D]``, keys in the first D channels."""
    cache[slots // PAGE, :, slots % PAGE] = torch.cat([key, value], dim=-1)


def vec_writer(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """``CPU_ATTN``'s layout on AVX-512 ("vec"): per page and head, keys transposed ``[D, page]``, then values
    ``[page, D]``."""
    flat = cache.view(cache.shape[0], HEADS, -1)
    page, offset = (slots // PAGE)[:, None, None], (slots % PAGE)[:, None, None]
    heads, dims = torch.arange(HEADS)[None, :, None], torch.arange(DIM)[None, None, :]
    flat[page, heads, dims * PAGE + offset] = key
    flat[page, heads, PAGE * DIM + offset * DIM + dims] = value


def vnni_writer(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """A packing of channel pairs (``[D / 2, page, 2]`` per head, as AMX tiles read 16-bit pairs), values after all
    heads' keys."""
    flat = cache.view(cache.shape[0], -1)
    page, offset = (slots // PAGE)[:, None, None], (slots % PAGE)[:, None, None]
    heads, dims = torch.arange(HEADS)[None, :, None], torch.arange(DIM)[None, None, :]
    flat[page, heads * PAGE * DIM + (dims // 2) * PAGE * 2 + offset * 2 + dims % 2] = key
    flat[page, HEADS * PAGE * DIM + heads * PAGE * DIM + offset * DIM + dims] = value


def a_request(writer: object, length: int, nhd: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                         torch.Tensor]:
    """``(cache, page_table, keys [L, Hkv, D], values)``: one request of ``length`` tokens written by ``writer`` into
    shuffled pages of a cache that also holds another request's tokens."""
    torch.manual_seed(length)
    pages = 2 * (-(-length // PAGE)) + 1
    shape = (pages, HEADS, PAGE, 2 * DIM)
    cache = torch.zeros(pages, PAGE, HEADS, 2 * DIM).transpose(1, 2) if nhd else torch.zeros(shape)
    order = torch.randperm(pages)
    table, other = order[: -(-length // PAGE)], order[-(-length // PAGE):]
    keys, values = torch.randn(length, HEADS, DIM), torch.randn(length, HEADS, DIM)
    positions = torch.arange(length)
    writer(keys, values, cache, table[positions // PAGE] * PAGE + positions % PAGE)
    noise = torch.arange(other.numel() * PAGE)
    writer(torch.randn(noise.numel(), HEADS, DIM), torch.randn(noise.numel(), HEADS, DIM), cache,
           other[noise // PAGE] * PAGE + noise % PAGE)
    return cache, table.to(torch.int32), keys, values


def as_gathered(tokens: torch.Tensor) -> torch.Tensor:
    return tokens.transpose(0, 1).unsqueeze(0)


@pytest.mark.parametrize("length", [1, PAGE - 1, PAGE, 3 * PAGE + 5])
@pytest.mark.parametrize("nhd", [False, True])
def test_flash_layout_gathers_the_request(length: int, nhd: bool) -> None:
    cache, table, keys, values = a_request(flash_writer, length, nhd)
    page_keys, page_values = flash_pages(cache, DIM)
    padded = torch.cat([table, torch.full((4,), 10**6, dtype=torch.int32)])  # entries past the request: never read
    assert torch.equal(gather_pages(page_keys, padded, length), as_gathered(keys))
    assert torch.equal(gather_pages(page_values, padded, length), as_gathered(values))


@pytest.mark.parametrize("writer", [vec_writer, vnni_writer, flash_writer])
@pytest.mark.parametrize("length", [1, PAGE, 3 * PAGE + 5])
def test_learned_layout_gathers_the_request(writer: object, length: int) -> None:
    cache, table, keys, values = a_request(writer, length)
    layout = learn_page_layout(writer, cache, HEADS, DIM)
    assert torch.equal(gather_indexed(cache, layout.keys, table, length), as_gathered(keys))
    assert torch.equal(gather_indexed(cache, layout.values, table, length), as_gathered(values))


def test_learned_layout_refuses_a_writer_that_loses_channels() -> None:
    def lossy(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        cache[slots // PAGE, :, slots % PAGE] = torch.cat([key[..., :1].expand_as(key), value], dim=-1)

    with pytest.raises(RuntimeError, match="did not put a page.s .* key channels in distinct elements"):
        learn_page_layout(lossy, torch.zeros(2, HEADS, PAGE, 2 * DIM), HEADS, DIM)


# --------------------------------------------------------------------------------------------------------------
# counters


def test_counters_average_the_density_and_log_at_the_first_sparse_chunk(caplog: pytest.LogCaptureFixture,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from flexentropy.integrations.vllm import stats

    counters = stats.Counters()
    clock = [100.0]
    monkeypatch.setattr(stats.time, "monotonic", lambda: clock[0])
    with caplog.at_level("INFO", logger="vllm.flexentropy"):
        counters.count_step(0, 2)                          # prompt chunks within the dense prefix: no line yet
        assert not caplog.records
        counters.count_step(1, 0)                          # the first sparse chunk: a line
        for density in (0.25, None, 0.75):
            counters.count_layer(None if density is None else torch.tensor(density))
        counters.count_step(1, 1)                          # within the interval: no line
        clock[0] += stats.LOG_EVERY_S
        counters.count_step(0, 0)                          # the interval is over and the counters moved: a line
        counters.count_step(0, 0)                          # nothing moved since: no line
    assert len(caplog.records) == 2
    assert "2 prompt chunks sparse, 3 dense" in caplog.records[-1].getMessage()
    assert counters.snapshot() == stats.PrefillStats(2, 3, 2, 1, 0.5)


# --------------------------------------------------------------------------------------------------------------
# the start-up warm-up


@pytest.mark.parametrize("config", [EntropyConfig(), EntropyConfig(dense_prefix=700, segment_size=512, block_size=64)])
@pytest.mark.parametrize("page_size", [16, 128, 256])
def test_warm_up_chunks_hold_one_of_every_class(config: EntropyConfig, page_size: int) -> None:
    """Warm-up chunks past ``dense_prefix`` of each class that compiles a graph of its own: starting on the
    128-token query grid or off it, each ending on a page boundary or past it, long (several segments) and short;
    and whole prompts, ending on a page boundary or past it."""
    chunks = warm_up_chunks(config, page_size)
    assert all(c.key_length > config.dense_prefix and c.start == c.q_start for c in chunks)
    classes = {(c.q_start == 0, c.q_start % Q_BLOCK_SIZE == 0, c.end - c.start >= 2 * config.segment_size,
                c.key_length % page_size == 0) for c in chunks}
    every = {(False, grid, long, whole) for grid in (True, False) for long in (True, False) for whole in (True, False)}
    assert classes == every | {(True, True, True, True), (True, True, True, False)}
