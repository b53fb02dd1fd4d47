"""`EntropyAttention`: a self-contained causal self-attention layer with sparse prefill and cached decoding.

Llama-style: q/k/v/o linear projections, rotary position embedding (RoPE, "rotate half" convention, as
``LlamaAttention``), grouped-query attention. A prompt (no cached past) runs the layer's prefill policy (design.md §1;
`PrefillPolicy.run`, the path every front door takes); later tokens attend over a cache, e.g.
`flexentropy.LatentKVCache` (design.md §2), through ``decode_attention``. Depends on torch only: any object with the
`KVCache` methods works as the cache (HF's ``DynamicCache`` too).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
from torch import nn

from flexentropy._checks import FLOAT_DTYPES, check_bool, check_layer_idx, is_int, plain
from flexentropy.config import EntropyConfig
from flexentropy.kv.decode_attention import decode_attention
from flexentropy.policies import PrefillPolicy, prefill_policy


class KVCache(Protocol):
    """What `EntropyAttention` needs from a cache (`flexentropy.LatentKVCache` and HF's caches have it).

    A cache may also define ``observe_queries(query_states, layer_idx)`` (post-RoPE ``[B, Hq, L, D]``), which
    `EntropyAttention` calls on every forward before ``update``, and ``attend(query, layer_idx, scale=...)``, which
    it then uses for decode attention instead of attending over what ``update`` returned (flexentropy's
    `PolicyCache`: kept entries per head, possibly ragged).
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
               ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def get_seq_length(self, layer_idx: int = 0) -> int: ...


def _holds_nothing(cache: KVCache, layer_idx: int) -> bool:
    """Whether ``cache`` holds nothing for layer ``layer_idx`` (the tokens are a prompt). A flexentropy cache answers
    through ``stored_length`` (a constant under compilation: a compiled decode step does not depend on the count)."""
    if hasattr(cache, "stored_length"):
        return cache.stored_length(layer_idx) == 0
    return cache.get_seq_length(layer_idx) == 0


def _integer(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds integers (not a bool, floating or complex dtype)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (split in halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for integer ``positions [B, L]``: ``(cos, sin)``, each ``[B, 1, L, head_dim]`` in ``dtype``.

    Frequencies ``theta ** (-2i / head_dim)``, computed in float32 and repeated over both halves of the head dim.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions[..., None].float() * inv_freq                          # [B, L, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]                         # [B, 1, L, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, L, D]`` by the RoPE tables ``[B, 1, L, D]``."""
    return x * cos + rotate_half(x) * sin


class EntropyAttention(nn.Module):
    """Causal self-attention with entropy-guided sparse prefill (design.md §1) and cached decoding (design.md §2).

    Args:
        hidden_size: model width (input and output features).
        num_heads: query heads ``Hq``.
        num_kv_heads: key/value heads ``Hkv`` (GQA; a divisor of ``num_heads``; default ``num_heads``).
        layer_idx: this layer's index (``config.dense_layers`` run dense; the cache's layer slot).
        head_dim: ``D`` (default ``hidden_size // num_heads``; even, for RoPE).
        config: `EntropyConfig` (default ``EntropyConfig()``).
        prefill: the prefill policy: a name of `flexentropy.PREFILL_POLICIES` (default ``"entropy"``) on ``config``,
            or a `PrefillPolicy` (``fe.make_prefill(name, config, **knobs)``), which carries its config (leave
            ``config`` None or pass the same one).
        rope_theta: RoPE base.
        bias: bias in the q/k/v/o projections.
        compiled: run the sparse kernel compiled (False: eager flex, which materialises N x N scores; tests only).
        device, dtype: of the projection weights (a floating dtype).

    Forward: ``hidden_states [B, L, hidden_size]`` -> ``[B, L, hidden_size]`` (floating, the weights' dtype; an empty
    batch or sequence gives an empty output and leaves the cache as it is). Without a cache, or with a cache that
    holds nothing for this layer, the ``L`` tokens are a prompt and run sparse prefill (stored in the cache if
    given). Otherwise they follow the cached tokens: the cache receives their queries (``observe_queries``, when
    it has it) and keys/values, and they attend over everything the cache returns. Positions default to
    ``past .. past + L - 1`` with ``past = cache.get_seq_length(layer_idx)`` (the logical length, evicted tokens
    included).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None, *, layer_idx: int,
                 head_dim: int | None = None, config: EntropyConfig | None = None, rope_theta: float = 10000.0,
                 bias: bool = False, compiled: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, prefill: str | PrefillPolicy = "entropy") -> None:
        super().__init__()
        hidden_size, num_heads, num_kv_heads, head_dim, layer_idx = (
            plain(value) for value in (hidden_size, num_heads, num_kv_heads, head_dim, layer_idx))
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if not is_int(value) or value < 1:
                raise ValueError(f"EntropyAttention {name} must be an int >= 1, got {value!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}), "
                                 "or pass head_dim")
            head_dim = hidden_size // num_heads
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {head_dim}")
        check_layer_idx(layer_idx)
        policy = prefill_policy(prefill, config)
        if not rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {rope_theta!r}")
        check_bool("EntropyAttention", "bias", bias)
        check_bool("EntropyAttention", "compiled", compiled)
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"EntropyAttention's weights take a floating dtype (torch.float16, torch.bfloat16, "
                            f"torch.float32 or torch.float64) or None (torch's default), got {dtype!r}")
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.layer_idx, self.rope_theta, self.compiled = layer_idx, rope_theta, compiled
        self.prefill_policy = policy
        self.scale = head_dim**-0.5
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias, **factory)

    @property
    def config(self) -> EntropyConfig:
        """The prefill policy's `EntropyConfig`; setting it keeps the rule and its knobs on the new config."""
        return self.prefill_policy.config

    @config.setter
    def config(self, config: EntropyConfig) -> None:
        self.prefill_policy = dataclasses.replace(self.prefill_policy, config=config)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, layer_idx={self.layer_idx}")

    def forward(self, hidden_states: torch.Tensor, cache: KVCache | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``hidden_states [B, L, hidden_size]`` (see the class docstring); ``[B, L, hidden_size]``.

        Args:
            cache: a `KVCache` (e.g. `flexentropy.LatentKVCache`) or None (prompt only, nothing kept).
            position_ids: int ``[B, L]`` or ``[L]`` RoPE positions (default: after the cached tokens).
        """
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [batch, seq_len, hidden_size={self.hidden_size}], "
                             f"got {tuple(hidden_states.shape)}")
        weights = self.q_proj.weight.dtype
        if not hidden_states.is_floating_point():
            raise TypeError(f"EntropyAttention takes floating hidden_states (its weights are {weights}), got "
                            f"{hidden_states.dtype}: embed token ids first, or cast them (hidden_states.to({weights}))")
        if hidden_states.dtype != weights:
            raise TypeError(f"EntropyAttention's weights are {weights} but hidden_states are {hidden_states.dtype}: "
                            f"cast one to the other (module.to({hidden_states.dtype}) or "
                            f"hidden_states.to({weights}))")
        if cache is not None and not (hasattr(cache, "update") and hasattr(cache, "get_seq_length")):
            raise TypeError(f"cache must have update() and get_seq_length() (e.g. flexentropy.LatentKVCache), "
                            f"got {type(cache).__name__}")
        batch, length, _ = hidden_states.shape
        if not batch or not length:   # no token to attend: nothing reaches the cache
            return hidden_states.new_empty(batch, length, self.hidden_size)
        prompt = cache is None or _holds_nothing(cache, self.layer_idx)
        if position_ids is None:
            past = 0 if prompt else cache.get_seq_length(self.layer_idx)
            position_ids = torch.arange(length, device=hidden_states.device) + past
        elif not isinstance(position_ids, torch.Tensor) or not _integer(position_ids.dtype):
            got = position_ids.dtype if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
            raise TypeError(f"position_ids must be an integer tensor, got {got}")
        elif position_ids.shape not in ((length,), (1, length), (batch, length)):
            raise ValueError(f"position_ids must be [B={batch}, L={length}] or [L={length}] (a position per token of "
                             f"hidden_states {list(hidden_states.shape)}), got {list(position_ids.shape)}")
        position_ids = position_ids.expand(batch, length)
        cos, sin = rotary_cos_sin(position_ids, self.head_dim, self.rope_theta, hidden_states.dtype)

        def heads(x: torch.Tensor) -> torch.Tensor:  # [B, L, H * D] -> [B, H, L, D]
            return x.view(batch, length, -1, self.head_dim).transpose(1, 2)

        query = apply_rotary(heads(self.q_proj(hidden_states)), cos, sin)
        key = apply_rotary(heads(self.k_proj(hidden_states)), cos, sin)
        value = heads(self.v_proj(hidden_states))
        if cache is not None:
            if hasattr(cache, "observe_queries"):
                cache.observe_queries(query, self.layer_idx)
            cached_key, cached_value = cache.update(key, value, self.layer_idx)
        if prompt:
            out, _ = self.prefill_policy.run(query, key, value, self.layer_idx, scale=self.scale,
                                             compiled=self.compiled)
        elif hasattr(cache, "attend"):  # a flexentropy PolicyCache reads its own layout (per-head, maybe ragged)
            out = cache.attend(query, self.layer_idx, scale=self.scale)
        else:
            out = decode_attention(query, cached_key, cached_value, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
