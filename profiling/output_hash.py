"""A hash of what every prefill path gives, tiny, on the CPU in float32: run it before and after a refactor that
must change no output (issue 74: one prefill path from every front door), and compare the lines.

Paths: `fe.sparse_prefill_attention` on a whole prompt and on a chunk at an offset (compiled and eager kernels),
`fe.select_blocks` whole and chunk (the plans' tables, budgets and entropies), each rule of `fe.PREFILL_POLICIES`
planned on the same q/k and run through `fe.enable` + ``generate`` on a tiny random Llama (prefill logits and greedy
tokens, one prompt and a left-padded batch of two), `fe.EntropyAttention`, and ``generate`` with `fe.LatentKVCache`
and `fe.StaticLatentKVCache`. The geometry (segments of 128, key blocks of 64, ``dense_prefix=256``) makes a
700-token prompt sparse in every layer but layer 0.

    PYTHONPATH=$PWD python profiling/output_hash.py            # one line per path, then the hash of them all
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flexentropy as fe  # noqa: E402
import flexentropy.integrations.hf  # noqa: E402

CONFIG = fe.EntropyConfig(segment_size=128, block_size=64, dense_prefix=256, base_budget=128, decode_budget=256,
                          decode_window=16, decode_delay=4)
"""Small geometry: a 700-token prompt has segments 2-4 sparse (dense prefix and last segment dense)."""

PROMPT = 700
NEW_TOKENS = 8

KNOBS = {"flexprefill": {"gamma": 0.5, "min_budget": 64}, "xattention": {"threshold": 0.5},
         "vertical_slash": {"vertical": 64, "slash": 64}}
"""Knobs that make the peers sparse at this size (their defaults keep every block of a random model's prompt)."""


def digest(*values: object) -> str:
    """Short sha256 of tensors (their float32/int64/bool bytes), ints, strings and None, in order."""
    h = hashlib.sha256()
    for value in values:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(value).encode())
    return h.hexdigest()[:16]


def plan_digest(plan: fe.SparsePlan) -> str:
    return digest(plan.blocks, plan.seq_len, plan.q_start, plan.dense, plan.budgets, plan.entropy, plan.rigid)


def qkv(n: int = 1000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, n, 32, generator=gen), torch.randn(1, 2, n, 32, generator=gen),
            torch.randn(1, 2, n, 32, generator=gen))


def kernel_rows() -> dict[str, str]:
    q, k, v = qkv()
    start = 300                      # a chunk from inside a segment to the end
    rows = {}
    for compiled in (True, False):
        tag = "compiled" if compiled else "eager"
        rows[f"sparse_prefill_attention/whole/{tag}"] = digest(
            fe.sparse_prefill_attention(q, k, v, CONFIG, 1, compiled=compiled))
        rows[f"sparse_prefill_attention/chunk/{tag}"] = digest(
            fe.sparse_prefill_attention(q[..., start:, :], k, v, CONFIG, 1, compiled=compiled, q_start=start))
    rows["sparse_prefill_attention/dense_layer"] = digest(fe.sparse_prefill_attention(q, k, v, CONFIG, 0))
    rows["select_blocks/whole"] = plan_digest(fe.select_blocks(q, k, CONFIG, 1))
    rows["select_blocks/chunk"] = plan_digest(fe.select_blocks(q[..., start:, :], k, CONFIG, 1, q_start=start))
    for name in fe.PREFILL_POLICIES:
        rows[f"policy/{name}/plan"] = plan_digest(fe.make_prefill(name, CONFIG, **KNOBS.get(name, {})).plan(q, k, 1))
    return rows


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=2048, bos_token_id=1,
                         eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def prompts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(one prompt [1, PROMPT], a left-padded batch [2, PROMPT], its mask)``."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, PROMPT), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :60] = 0
    ids[1, :60] = 0
    return ids[:1], ids, mask


@torch.inference_mode()
def model_rows() -> dict[str, str]:
    one, batch, mask = prompts()
    rows = {}
    for name in fe.PREFILL_POLICIES:
        model = tiny_llama()
        fe.enable(model, prefill=fe.make_prefill(name, CONFIG, **KNOBS.get(name, {})))
        logits = model(one).logits
        density = round(fe.integrations.hf.prefill_density(model), 6)
        tokens = model.generate(one, max_new_tokens=NEW_TOKENS, do_sample=False)
        padded = model.generate(batch, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        rows[f"enable/{name}"] = f"{digest(logits, tokens, padded)} density {density}"
    for cache_name, make in (("LatentKVCache", lambda m: fe.LatentKVCache(CONFIG)),
                             ("StaticLatentKVCache", lambda m: fe.StaticLatentKVCache(CONFIG, model=m))):
        model = fe.enable(tiny_llama(), CONFIG)
        tokens = model.generate(one, past_key_values=make(model), max_new_tokens=2 * NEW_TOKENS, do_sample=False)
        rows[f"generate/{cache_name}"] = digest(tokens)
    return rows


@torch.inference_mode()
def module_rows() -> dict[str, str]:
    torch.manual_seed(0)
    rows = {}
    for layer_idx in (0, 1):
        layer = fe.EntropyAttention(128, 4, 2, layer_idx=layer_idx, config=CONFIG)
        x = torch.randn(1, PROMPT, 128, generator=torch.Generator().manual_seed(2))
        cache = fe.LatentKVCache(CONFIG)
        prompt_out = layer(x, cache)
        step = layer(x[:, -1:], cache)
        rows[f"EntropyAttention/layer{layer_idx}"] = digest(prompt_out, step)
    return rows


def main() -> None:
    rows: dict[str, str] = {}
    parts: list[Callable[[], dict[str, str]]] = [kernel_rows, module_rows, model_rows]
    for part in parts:
        rows.update(part())
    for name, value in rows.items():
        print(f"{name:45s} {value}")
    print(f"{'ALL':45s} {digest(*rows.items())}")


if __name__ == "__main__":
    main()
