"""Token counts of the Gemma-3-270m GGUF tokenizer: transformers alone against
`flexentropy.cli.gguf.load_tokenizer` (quoted in docs/quality.md). Writes tokenizer_counts.json.

Run from the repository root, with the GGUF joined at /tmp/gemma3 (or pass its folder):
``python profiling/quality/gemma_tokenizer_counts.py [FOLDER]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer
from transformers.utils import logging

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the lab (bench/) is not installed: the checkout
from bench.data import load_essays  # noqa: E402
from flexentropy.cli.gguf import load_tokenizer  # noqa: E402

GGUF = "gemma-3-270m-q4_k_m.gguf"


def main(folder: str) -> None:
    logging.set_verbosity_error()
    text = load_essays()[:100_000]
    stock, fixed = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF), load_tokenizer(folder, GGUF)
    out = {
        "gguf": GGUF,
        "text": "first 100,000 characters of bench.data.load_essays()",
        "tokens_transformers_alone": len(stock(text)["input_ids"]),
        "tokens_load_tokenizer": len(fixed(text)["input_ids"]),
        "hello_world_transformers_alone": stock.convert_ids_to_tokens(stock("Hello world")["input_ids"]),
        "hello_world_load_tokenizer": fixed.convert_ids_to_tokens(fixed("Hello world")["input_ids"]),
    }
    path = Path(__file__).resolve().parents[2] / "docs/results/gemma3_cpu.json"   # its "tokenizer_counts" key
    results = json.loads(path.read_text(encoding="utf-8"))
    results["tokenizer_counts"] = out
    path.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps(out, ensure_ascii=False))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gemma3")
