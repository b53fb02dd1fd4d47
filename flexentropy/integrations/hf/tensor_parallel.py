"""Tensor parallelism: which of the model's heads an attention module computes on this process.

Under transformers' ``DistributedConfig(tp_plan="auto")`` (started with ``torchrun``) q/k/v are sharded by heads, so
each rank's attention function receives its own whole heads as plain tensors (``[B, Hq / world, N, D]``,
``[B, Hkv / world, N, D]``) while ``module.config`` still counts every head. Nothing in flexentropy reads the head
counts of the config: each rank plans its sparse prefill from its local heads and a `PolicyCache` keeps its local KV
heads; flexentropy adds no communication. `local_heads` says which heads a rank holds, and `flexentropy.enable`
refuses a sharding that splits a head or a GQA group.
"""

from __future__ import annotations

import torch
from torch import nn

from flexentropy._checks import check_has

ATTENTION_MODULE = "an attention module of a transformers model (e.g. model.model.layers[0].self_attn)"
"""What `local_heads` and `layer_state` take (for their messages)."""


def local_heads(module: nn.Module) -> tuple[range, range]:
    """``(query heads, KV heads)``: the model's heads, as global indices, that this process's attention ``module``
    computes.

    Without tensor parallelism, every head. Under transformers' tensor parallelism (``q_proj`` and ``k_proj`` weights
    DTensors sharded on their output dimension, the ``"colwise"`` style of ``tp_plan="auto"``), this rank's slice:
    the heads :func:`attention_forward` receives, the rows of the plans in `LayerState.plans` and the heads a
    `PolicyCache` stores for the layer. Query heads ``q`` read KV heads ``q // G`` (``G`` = ``num_key_value_groups``).
    Read from the weights' sharding: a style that gathers a projection's output (``"colwise_gather_output"``) would
    hand the attention every head, which this does not see.

    Raises:
        ValueError: the sharding splits a head, or a rank's query heads read KV heads of another rank.
    """
    check_has("local_heads", "module", module, ("num_key_value_groups", "head_dim", "q_proj", "k_proj", "layer_idx"),
              ATTENTION_MODULE)
    group = module.num_key_value_groups
    query = _sharded_heads(module.q_proj.weight, module.head_dim, "q_proj")
    kv = _sharded_heads(module.k_proj.weight, module.head_dim, "k_proj")
    if query != range(kv.start * group, kv.stop * group):
        raise ValueError(f"layer {module.layer_idx}: this rank holds query heads {query.start}..{query.stop - 1} and "
                         f"KV heads {kv.start}..{kv.stop - 1}, which are not the same GQA groups (G={group}): "
                         f"shard q_proj and k_proj/v_proj alike, over a number of ranks that divides the KV heads")
    return query, kv


def _sharded_heads(weight: torch.Tensor, head_dim: int, name: str) -> range:
    """Global heads of a projection ``weight`` ``[heads * head_dim, hidden]`` held by this rank (all of them unless
    it is a DTensor sharded on dim 0)."""
    heads = weight.shape[0] // head_dim
    if not torch.distributed.is_available():
        return range(heads)
    from torch.distributed.tensor import DTensor

    if not isinstance(weight, DTensor):
        return range(heads)
    dims = [i for i, p in enumerate(weight.placements) if p.is_shard(0)]
    if not dims:
        return range(heads)
    if len(dims) > 1:
        raise ValueError(f"{name} is sharded by heads over {len(dims)} mesh dimensions; flexentropy supports one")
    world, rank = weight.device_mesh.size(dims[0]), weight.device_mesh.get_local_rank(dims[0])
    if heads % world:
        raise ValueError(f"{name} has {heads} heads, which {world} tensor-parallel ranks cannot share without "
                         f"splitting a head: use a number of ranks that divides {heads}")
    per = heads // world
    return range(rank * per, (rank + 1) * per)
