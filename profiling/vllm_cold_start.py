"""A fresh vLLM engine with flexentropy's plugin on: its first long request against its second (issue 65, item 2).

What flexentropy's code compiles while the engine starts (the plugin's warm-up, `flexentropy.integrations.vllm.warm_up`)
and during each request, and each request's seconds to its first token: the first should compile nothing and take the
second's time. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so dynamo's compilation
metrics read here are the engine's. The model is profiling/vllm_serving.py's: the Llama-3.1-8B shape with dummy
weights (``--tiny``: a 2-layer one), bf16 on CUDA; two random prompts of ``--context`` tokens, no shared prefix.

    python profiling/vllm_cold_start.py --context 131072 --out cold_start_128k.json        # one GPU, vLLM's defaults
    python profiling/vllm_cold_start.py --device cpu --tiny --context 3000 --out /tmp/cold_start.json

A restarted server (issue 76): the same command twice with ``FLEXENTROPY_COMPILED_DIR=FOLDER`` set, the second start
loading what the first kept (``start_up_kept``: graphs loaded and compiled; ``start_up_traced``: graphs dynamo traced,
vLLM's own included); ``--plugin-off`` times vLLM's own start-up and requests, the plugin off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the engine in this process: its compiles counted here
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_serving import LLAMA_8B, TINY_LLAMA, TINY_PLUGIN_CONFIG, dummy_model, random_prompt  # noqa: E402


def flexentropy_compiles() -> int:
    """Frames dynamo has compiled in this process from flexentropy's code (its compiled regions)."""
    from torch._dynamo.utils import get_compilation_metrics

    return sum(1 for m in get_compilation_metrics() if f"{os.sep}flexentropy{os.sep}" in (m.co_filename or ""))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="the 2-layer model (on the CPU: checks the script)")
    p.add_argument("--context", type=int, default=131072, help="tokens of each prompt")
    p.add_argument("--config", default="{}", help="the plugin's additional_config entry, as JSON (--tiny: its "
                                                  "geometry for ~2k tokens under it)")
    p.add_argument("--max-num-batched-tokens", type=int, help="vLLM's chunk (default: vLLM's)")
    p.add_argument("--plugin-off", action="store_true", help="vLLM's own backend: the plugin off")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "flexentropy_vllm_cold_start")
    p.add_argument("--out", type=Path, required=True, help="the row, as JSON")
    a = p.parse_args(argv)
    options: dict[str, Any] = {"dtype": "bfloat16"}
    if a.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")   # GiB: vLLM's CPU build would reserve most of the memory
        options = {"dtype": "float32", "enforce_eager": True}
    from vllm import LLM, SamplingParams

    config = {**(TINY_PLUGIN_CONFIG if a.tiny else {}), **json.loads(a.config)}
    if a.max_num_batched_tokens:
        options["max_num_batched_tokens"] = a.max_num_batched_tokens
    a.work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    llm = LLM(model=str(dummy_model(a.work, a.tiny)), load_format="dummy", skip_tokenizer_init=True, seed=0,
              max_model_len=a.context + 64, enable_chunked_prefill=True,
              additional_config={} if a.plugin_off else {"flexentropy": config},
              **options)
    from torch._dynamo.utils import counters

    from flexentropy.engine.warm_up import COMPILED_DIR_VARIABLE, compiled_work

    row: dict[str, Any] = {"context": a.context, "device": a.device, "tiny": a.tiny,
                           "plugin_config": None if a.plugin_off else config,
                           "start_up_s": time.perf_counter() - start, "start_up_compiles": flexentropy_compiles(),
                           "start_up_traced": counters["stats"]["unique_graphs"],
                           "compiled_dir": os.environ.get(COMPILED_DIR_VARIABLE), "start_up_kept": compiled_work()}
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
    vocab = (TINY_LLAMA if a.tiny else LLAMA_8B)["vocab_size"]
    for seed, name in enumerate(("first", "second")):
        before, start = flexentropy_compiles(), time.perf_counter()
        llm.generate([random_prompt(a.context, vocab, seed)], one, use_tqdm=False)
        row |= {f"{name}_s": time.perf_counter() - start, f"{name}_compiles": flexentropy_compiles() - before}
    row["first_over_second"] = row["first_s"] / row["second_s"]
    row["kept"] = compiled_work()
    a.out.write_text(json.dumps(row, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
