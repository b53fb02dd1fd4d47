"""One process of tests/test_kept_compiled.py: `fe.warm_up` of a two-layer Llama (layer 0 dense, layer 1 sparse)
with flexentropy's compiled work kept in the folder ``sys.argv[1]`` (`fe.warm_up`'s ``compiled_dir``), then one
request through ``generate`` and the same request without compiling; prints one JSON line: the graphs dynamo
traced, what the kept work did (`flexentropy._compile.KEPT`), both requests' tokens and flexentropy's warnings."""

from __future__ import annotations

import json
import sys
import warnings

import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation import CompileConfig

import flexentropy as fe
from flexentropy._compile import KEPT

CONFIG = fe.EntropyConfig(segment_size=128, block_size=64, base_budget=64, dense_prefix=128, decode_budget=96,
                          decode_window=16, decode_delay=2, recompress_every=4)
"""Sparse prefill past 128 tokens and an eviction two tokens into decoding: both stages of the static step."""

PROMPT, NEW = 333, 10


def main(folder: str) -> None:
    torch.manual_seed(0)
    llama = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, max_position_embeddings=1024, eos_token_id=None)
    model = fe.enable(LlamaForCausalLM(llama).eval(), CONFIG)
    compile_config = CompileConfig(backend="inductor", mode="default")
    compile_config._compile_all_devices = True              # transformers compiles off CUDA only with this set
    cache = fe.StaticLatentKVCache(CONFIG, model=model, max_prompt_length=400)   # phase 1 captured too
    ids = torch.randint(1, llama.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    request = dict(attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fe.warm_up(model, [300], cache=cache, compile_config=compile_config, compiled_dir=folder)
        cache.reset()
        tokens = model.generate(ids, past_key_values=cache, compile_config=compile_config, **request)
    traced = counters["stats"]["unique_graphs"]
    eager = model.generate(ids, past_key_values=fe.StaticLatentKVCache(CONFIG, model=model), **request)
    print(json.dumps({"traced": traced, "kept": dict(KEPT), "tokens": tokens[0, PROMPT:].tolist(),
                      "eager": eager[0, PROMPT:].tolist(),
                      "warnings": [str(w.message) for w in caught if "flexentropy" in str(w.message)]}))


if __name__ == "__main__":
    main(sys.argv[1])
