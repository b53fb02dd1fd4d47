"""The attention backends the plugin registers: each is vLLM's own backend of that name, subclassed (docs/design.md
§7), for the engines that chose flexentropy.

``flexentropy.integrations.vllm.backends.FLASH_ATTN`` (and ``.CPU_ATTN``) are resolved on each access, which vLLM
makes when it builds a model under that engine's configuration (`resolve`): vLLM's own class (the enum's default
path, never an override) unless the configuration's ``additional_config`` has a ``"flexentropy"`` entry, else a
subclass of it made once, so this module imports only what the running platform uses. Each subclass keeps its
parent's name, KV-cache layout, supported shapes and CUDA-graph support (at most uniform batches) and changes two
things:

- its metadata builder (`SparsePrefillBuilder`) routes each step on the host (`routing.route`): a step without a
  long prompt chunk gets the parent's metadata exactly as the parent builds it (a step of decode rows only goes to
  the parent before anything is read: the parent's kernel and its CUDA graphs, untouched); a step with some gets a
  `SparseStep`: the parent's metadata for the other requests and the list of chunks;
- its implementation (`SparsePrefillImpl`) runs a `SparseStep`: the parent's kernel on the other requests' rows,
  then, for each chunk, the request's keys and values of positions ``0 .. end`` gathered from the paged cache (this
  step's are written before attention runs) and the engine's prefill policy on them (`PrefillPolicy.run`: the chunk
  is the last rows of its keys).

The engine's prefill policy (`settings.plugin_policy`: any rule of `flexentropy.PREFILL_POLICIES`, its knobs and
`EntropyConfig`) is read once per engine and held by the builder and every layer's implementation.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import get_current_vllm_config, get_current_vllm_config_or_none
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from flexentropy.integrations.vllm.paged import (
    PageLayout,
    flash_pages,
    gather_indexed,
    gather_pages,
    learn_page_layout,
)
from flexentropy.integrations.vllm.plugin import EXTENDED_BACKENDS
from flexentropy.integrations.vllm.routing import Chunk, parent_metadata, route, unsupported_step
from flexentropy.integrations.vllm.settings import CONFIG_KEY, check_layer, plugin_policy
from flexentropy.integrations.vllm.stats import COUNTERS, notice_once
from flexentropy.integrations.vllm.warm_up import warm_up_chunks
from flexentropy.policies import PrefillPolicy
from flexentropy.sparse.plan import SparsePlan


@dataclass(frozen=True)
class SparseStep:
    """A step's attention metadata when it holds long prompt chunks (`SparsePrefillBuilder.build`).

    Attributes:
        parent_metadata: the parent backend's metadata of the step's other requests (decode rows, short prompts,
            chunks within ``dense_prefix``), which the parent's kernel runs; None when there are none.
        parent_rows: their query rows in the step: a leading slice, or an int64 index on the step's device.
        chunks: the long prompt chunks.
        block_table: int ``[R, max_pages]``, the step's block table (row ``chunk.request`` is the chunk's pages).
    """

    parent_metadata: Any
    parent_rows: slice | torch.Tensor
    chunks: tuple[Chunk, ...]
    block_table: torch.Tensor


def decode_query_len(vllm_config: Any) -> int:
    """The most query tokens a decode row holds: 1, plus the speculative tokens verified per step."""
    speculative = getattr(vllm_config, "speculative_config", None)
    return 1 + (getattr(speculative, "num_speculative_tokens", None) or 0)


class SparsePrefillBuilder:
    """Mixed into the parent backend's metadata builder (before it): routes each step (module docstring)."""

    supports_update_block_table = False
    """A `SparseStep` is built whole each step (vLLM would otherwise patch a cached metadata's block table)."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        """The parent's support, at most uniform batches: a step with a prompt chunk is never captured whole."""
        parent = super().get_cudagraph_support(vllm_config, kv_cache_spec)  # type: ignore[misc]
        return min(parent, AttentionCGSupport.UNIFORM_BATCH, key=lambda support: support.value)

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device,
                 *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)  # type: ignore[call-arg]
        self.prefill_policy = chosen_policy(vllm_config)
        self.decode_query_len = decode_query_len(vllm_config)
        warm_up(vllm_config, kv_cache_spec, layer_names, device)

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False,
              **kwargs: Any) -> Any:
        parent = super().build  # type: ignore[misc]
        metadata = common_attn_metadata
        if metadata.max_query_len <= self.decode_query_len:   # decode rows only: the engine's step, nothing read
            return parent(common_prefix_len, metadata, fast_build, **kwargs)
        reason = unsupported_step(metadata)
        if reason is not None:
            notice_once("%s run vLLM's kernel (dense prefill)", reason)
            return parent(common_prefix_len, metadata, fast_build, **kwargs)
        routing = route(metadata.query_start_loc_cpu[: metadata.num_reqs + 1],
                        metadata.seq_lens_cpu_upper_bound[: metadata.num_reqs], self.prefill_policy,
                        self.decode_query_len)
        COUNTERS.count_step(len(routing.chunks), routing.dense_prompt_chunks)
        if not routing.chunks:
            return parent(common_prefix_len, metadata, fast_build, **kwargs)
        others = parent_metadata(metadata, routing)
        if others is None:
            return SparseStep(None, slice(0, 0), routing.chunks, metadata.block_table_tensor)
        # no cascade over the sub-batch: a prefix common to the step is common to it, but 0 is always right
        return SparseStep(parent(0, others[0], fast_build, **kwargs), others[1], routing.chunks,
                          metadata.block_table_tensor)


@functools.cache
def layer_index(layer_name: str) -> int:
    """The decoder layer index in a vLLM attention layer's name (``model.layers.7.self_attn.attn`` -> 7)."""
    return extract_layer_index(layer_name)


LAYER_ARGUMENTS = {"alibi_slopes": None, "sliding_window": None, "logits_soft_cap": None, "kv_cache_dtype": "auto",
                   "attn_type": "decoder", "sinks": None}
"""Arguments of vLLM's ``AttentionImpl`` constructors that `check_layer` reads, with their defaults."""


def call_arguments(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``function``'s arguments by name for a call with ``args`` and ``kwargs`` (those caught by ``**`` included)."""
    signature = inspect.signature(function)
    arguments = dict(signature.bind(*args, **kwargs).arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(parameter.name, {}))
    return arguments


class SparsePrefillImpl:
    """Mixed into the parent backend's attention implementation (before it): runs a `SparseStep` (module docstring).

    Validated when vLLM builds the layer (start-up): the plugin's configuration (`plugin_policy`) and the layer's
    attention function (`check_layer`).
    """

    backend_name: str
    """The parent backend's name; set on each subclass."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        arguments = call_arguments(super().__init__, args, kwargs)
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        check_layer(**{name: arguments.get(name, default) for name, default in LAYER_ARGUMENTS.items()})
        self.prefill_policy = chosen_policy(get_current_vllm_config())
        self.page_layout: PageLayout | None = None

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor, *args: Any,
                **kwargs: Any) -> torch.Tensor:
        """vLLM's attention call: ``query [T, Hq, D]``, ``output [T, Hq, D]`` written in place and returned."""
        parent = super().forward  # type: ignore[misc]
        if not isinstance(attn_metadata, SparseStep):
            return parent(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        step = attn_metadata
        if step.parent_metadata is not None:
            if isinstance(step.parent_rows, slice):
                parent(layer, query, key, value, kv_cache, step.parent_metadata, output, *args, **kwargs)
            else:
                rows = step.parent_rows
                part = output.new_empty((rows.numel(), *output.shape[1:]))
                parent(layer, query[rows], key[rows], value[rows], kv_cache, step.parent_metadata, part, *args,
                       **kwargs)
                output.index_copy_(0, rows, part)
        layer_idx = layer_index(layer.layer_name)
        for chunk in step.chunks:
            out, plan = self.attend_chunk(layer, query, kv_cache, step.block_table[chunk.request], chunk, layer_idx)
            output[chunk.start:chunk.end] = out
            COUNTERS.count_layer(None if plan is None else plan.density_tensor())
        return output

    def attend_chunk(self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
                     chunk: Chunk, layer_idx: int) -> tuple[torch.Tensor, SparsePlan | None]:
        """One long prompt chunk's attention in this layer: its rows of the step's ``query [T, Hq, D]`` over the
        request's keys and values in ``kv_cache`` (pages ``page_table``), by the engine's prefill policy
        (`PrefillPolicy.run`: the chunk is the last rows of the keys). Returns ``([M, Hq, D], its plan)``, the plan
        None where the layer ran dense.

        The chunk's queries are copied first (``M x Hq x D``, a share of the keys and values gathered beside them), so
        that the compiled kernels see one layout whatever the model hands vLLM (a view into its fused projection, a
        step of any length): the classes of shapes that `warm_up` compiles at start-up are then those requests bring.
        """
        q = query[chunk.start:chunk.end].clone().transpose(0, 1).unsqueeze(0)
        k, v = self.read_cache(layer, kv_cache, page_table, chunk.key_length)
        out, plan = self.prefill_policy.run(q, k, v, layer_idx, scale=self.scale)  # type: ignore[attr-defined]
        return out[0].transpose(0, 1), plan

    def warm_up(self, layer: Any, layer_idx: int, page_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Run a chunk of every class of `warm_up_chunks` through `attend_chunk` in layer ``layer_idx``, on random
        queries and a scratch cache of ``page_size``-token pages, as a served step runs them (inference mode), so
        that what they compile is compiled now."""
        chunks = warm_up_chunks(self.prefill_policy.config, page_size)
        longest = max(chunk.key_length for chunk in chunks)
        pages = -(-longest // page_size)
        heads, kv_heads, head_size = self.num_heads, self.num_kv_heads, self.head_size  # type: ignore[attr-defined]
        with torch.inference_mode():
            kv_cache = torch.randn(pages, kv_heads, page_size, 2 * head_size, dtype=dtype, device=device)
            query = torch.randn(longest, heads, head_size, dtype=dtype, device=device)
            page_table = torch.arange(pages, dtype=torch.int32, device=device)
            for chunk in chunks:
                self.attend_chunk(layer, query, kv_cache, page_table, chunk, layer_idx)

    def read_cache(self, layer: Any, kv_cache: torch.Tensor, page_table: torch.Tensor,
                   length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of positions ``0 .. length - 1`` of the request whose pages ``page_table`` lists,
        each ``[1, Hkv, length, D]``: through views of ``FLASH_ATTN``'s known layout, else through the layout learned
        (once per layer) from the parent's own cache writer (`paged.learn_page_layout`)."""
        head_size = self.head_size  # type: ignore[attr-defined]
        if self.backend_name == "FLASH_ATTN":
            keys, values = flash_pages(kv_cache, head_size)
            return gather_pages(keys, page_table, length), gather_pages(values, page_table, length)
        if self.page_layout is None:
            def write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
                self.do_kv_cache_update(layer, key, value, cache, slots)  # type: ignore[attr-defined]

            self.page_layout = learn_page_layout(write, kv_cache, self.num_kv_heads, head_size)  # type: ignore[attr-defined]
        layout = self.page_layout
        return (gather_indexed(kv_cache, layout.keys, page_table, length),
                gather_indexed(kv_cache, layout.values, page_table, length))


def warm_up(vllm_config: Any, kv_cache_spec: Any, layer_names: list[str], device: torch.device) -> None:
    """Compile at start-up what the long prompt chunks of this KV-cache group's layers will compile: the chunks of
    `warm_up_chunks` through one sparse and one dense layer of the group (`SparsePrefillImpl.warm_up`), each on its
    own scratch cache, so that the first request served compiles nothing. Nothing when the policy runs every chunk
    dense (the ``dense`` rule: no chunk is routed to it)."""
    context = vllm_config.compilation_config.static_forward_context
    layers = {layer_index(name): context[name] for name in layer_names
              if isinstance(getattr(context.get(name), "impl", None), SparsePrefillImpl)}
    policy = chosen_policy(vllm_config)
    past_prefix = policy.config.dense_prefix + 1                    # the warm-up chunks' keys: the layer decides
    if policy.runs_dense(None, past_prefix):
        return
    picked = {policy.runs_dense(index, past_prefix): index for index in sorted(layers)}   # a sparse and a dense layer
    for index in picked.values():
        layers[index].impl.warm_up(layers[index], index, kv_cache_spec.block_size, kv_cache_spec.dtype, device)


@functools.cache
def sparse_backend(name: str) -> type:
    """vLLM's backend ``name`` (one of `EXTENDED_BACKENDS`) with `SparsePrefillBuilder` and `SparsePrefillImpl`."""
    parent = resolve_obj_by_qualname(AttentionBackendEnum[name].value)
    impl = type(f"{name}.Impl", (SparsePrefillImpl, parent.get_impl_cls()),
                {"backend_name": name, "__module__": __name__})
    builder = type(f"{name}.Builder", (SparsePrefillBuilder, parent.get_builder_cls()), {"__module__": __name__})
    return type(name, (parent,), {
        "__module__": __name__, "__qualname__": name,
        "__doc__": f"vLLM's {name} backend with flexentropy's sparse prefill of long prompt chunks.",
        "get_impl_cls": staticmethod(lambda: impl), "get_builder_cls": staticmethod(lambda: builder)})


def resolve(name: str, additional_config: object) -> type:
    """The class of backend ``name`` for an engine whose ``additional_config`` is this: vLLM's own without a
    ``"flexentropy"`` entry, else flexentropy's subclass (the entry validated here, at start-up); logs, once per
    process and outcome, whether flexentropy is on and with what."""
    policy = plugin_policy(additional_config)
    if policy is None:
        notice_once("off (no %r entry in vLLM's additional_config): vLLM's %s backend runs as without the plugin; "
                    "--additional-config '{\"%s\": {}}' turns it on", CONFIG_KEY, name, CONFIG_KEY)
        return resolve_obj_by_qualname(AttentionBackendEnum[name].value)
    notice_once("on: vLLM's %s backend runs the prompt chunks whose keys reach past dense_prefix=%d tokens by the %r "
                "prefill (knobs %s, %s)", name, policy.config.dense_prefix, policy.name, policy.knobs, policy.config)
    return sparse_backend(name)


def chosen_policy(vllm_config: Any) -> PrefillPolicy:
    """The prefill policy of an engine that runs the plugin's backend (`plugin_policy`: read once per engine)."""
    policy = plugin_policy(vllm_config.additional_config)
    if policy is None:
        raise RuntimeError(f"flexentropy's backend was built for an engine without a {CONFIG_KEY!r} entry in its "
                           "additional_config: vLLM resolved it for an earlier engine of this process that chose "
                           "flexentropy (it keeps one backend class per layer shape and process); start this engine "
                           "in a process of its own")
    return policy


def __getattr__(name: str) -> type:
    if name in EXTENDED_BACKENDS:
        vllm_config = get_current_vllm_config_or_none()
        return resolve(name, None if vllm_config is None else vllm_config.additional_config)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
