"""A tiny decoder-only language model built on `flexentropy.EntropyAttention` (example; no transformers needed).

Each block is pre-norm: ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` with a SwiGLU MLP, as in Llama. Prompts run
entropy-guided sparse prefill, generated tokens decode over a `flexentropy.LatentKVCache` (or any cache with
``update`` / ``get_seq_length``). Run it to compare dense and sparse greedy generation of a random model::

    python docs/examples/tiny_lm.py
"""

from __future__ import annotations

import torch
from torch import nn

from flexentropy import EntropyConfig
from flexentropy.entropy_attention import EntropyAttention, KVCache


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: ``[..., hidden] -> [..., hidden]``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm decoder block: ``[B, L, hidden] -> [B, L, hidden]``."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, layer_idx: int,
                 config: EntropyConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden_size)
        self.attn = EntropyAttention(hidden_size, num_heads, num_kv_heads, layer_idx=layer_idx, config=config)
        self.mlp_norm = nn.RMSNorm(hidden_size)
        self.mlp = SwiGLU(hidden_size, 4 * hidden_size)

    def forward(self, x: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cache)
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    """Token embedding, ``num_layers`` blocks, final norm and LM head: ``input_ids [B, L] -> logits [B, L, V]``."""

    def __init__(self, vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                 num_kv_heads: int = 2, config: EntropyConfig | None = None) -> None:
        super().__init__()
        config = EntropyConfig() if config is None else config
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.blocks = nn.ModuleList(Block(hidden_size, num_heads, num_kv_heads, i, config) for i in range(num_layers))
        self.norm = nn.RMSNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cache)
        return self.head(self.norm(x))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, cache: KVCache) -> torch.Tensor:
        """Greedy decoding: ``input_ids [B, L]`` -> ``[B, L + max_new_tokens]`` (the prompt, then new tokens)."""
        tokens = [input_ids]
        logits = self(input_ids, cache)
        for step in range(max_new_tokens):
            tokens.append(logits[:, -1:].argmax(-1))
            if step + 1 < max_new_tokens:
                logits = self(tokens[-1], cache)
        return torch.cat(tokens, dim=1)


def main() -> None:
    from flexentropy.caches import LatentKVCache  # imports transformers (the Cache base class)

    torch.manual_seed(0)
    prompt = torch.randint(0, 256, (1, 2000))
    dense = EntropyConfig(dense_prefix=1 << 20, decode_budget=4096)  # nothing sparse, nothing evicted
    sparse = EntropyConfig(segment_size=256, block_size=64, base_budget=256, dense_prefix=512, decode_budget=512)
    model = TinyLM(config=dense).eval()
    reference = model.generate(prompt, 32, LatentKVCache(dense))[0, -32:]
    sparse_model = TinyLM(config=sparse).eval()
    sparse_model.load_state_dict(model.state_dict())
    cache = LatentKVCache(sparse)
    tokens = sparse_model.generate(prompt, 32, cache)[0, -32:]
    print("dense  :", reference.tolist())
    print("sparse :", tokens.tolist(), f"(cache holds {cache.stored_length(1)} of {cache.get_seq_length(1)} tokens)")


if __name__ == "__main__":
    main()
