"""`fuse_projections`: each attention's q/k/v projections, and each gated MLP's gate/up projections, as one matrix
product, without changing any forward.

A decode step at batch 1 reads every weight once, and cuBLAS reads a few large matrices faster than many small ones
(docs/performance.md, measured by `profiling/decode_attention.py`). Inductor's freezing fuses them too, but it stores
the fused weight transposed, and for that layout cuBLAS picks slower split-K kernels.

The members of a group (``q_proj``, ``k_proj``, ``v_proj``) become `FusedMember` views of one `FusedLinear`,
registered on their parent as ``qkv_proj`` (``gate_up_proj``), whose weight holds theirs stacked (no extra copy once
fused). The first member called with an input computes the whole product and keeps it; the others called with the
same tensor take their columns of it, and the last of them drops it. A member called with another input computes
the group's product for it afresh, so every forward stays what it was.

The state dict keeps the unfused layout: the parent's ``state_dict`` gives each member's rows under its own name
(``q_proj.weight``, views of the stacked weight) in place of the group's, so ``save_pretrained`` writes a checkpoint
that ``from_pretrained`` loads into the unfused model; the parent's ``load_state_dict`` stacks them back.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

GROUPS: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                      "gate_up_proj": ("gate_proj", "up_proj")}
"""Fused name on the parent module -> the `nn.Linear` children it replaces (every one sharing its input)."""


class FusedLinear(nn.Module):
    """The stacked weight ``[sum(out), in]`` (and bias) of a group of linears fed the same input.

    Args:
        linears: the group's `nn.Linear`s, one input size, device and dtype (their weights are copied once).
    """

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        first = linears[0]
        self.biased = [linear.bias is not None for linear in linears]
        self.sizes = [linear.out_features for linear in linears]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(linears))]
        self.weight = nn.Parameter(torch.cat([linear.weight.detach() for linear in linears]),
                                   requires_grad=first.weight.requires_grad)
        if any(linear.bias is not None for linear in linears):
            bias = [linear.weight.new_zeros(linear.out_features) if linear.bias is None else linear.bias.detach()
                    for linear in linears]
            self.bias = nn.Parameter(torch.cat(bias), requires_grad=first.weight.requires_grad)
        else:
            self.bias = None
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._taken = 0

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Member ``index``'s output ``[..., sizes[index]]`` for ``x [..., in]`` (module docstring)."""
        if self._input is not x:
            self._input, self._output, self._taken = x, F.linear(x, self.weight, self.bias), 0
        out = self._output.narrow(-1, self.offsets[index], self.sizes[index])
        self._taken += 1
        if self._taken == len(self.sizes):   # back to the state every forward starts from (nothing to guard anew)
            self._input, self._output, self._taken = None, None, 0
        return out


class FusedMember(nn.Module):
    """One former `nn.Linear` of a `FusedLinear` group: same ``in_features``/``out_features``, ``weight`` and
    ``bias`` as views of the group's."""

    def __init__(self, group: FusedLinear, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "group", group)   # not a submodule: the parent holds the group once
        self.index = index
        self.in_features = group.weight.shape[1]
        self.out_features = group.sizes[index]

    @property
    def weight(self) -> torch.Tensor:
        return self.group.weight.narrow(0, self.group.offsets[self.index], self.out_features)

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.group.bias
        return None if bias is None else bias.narrow(0, self.group.offsets[self.index], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(x, self.index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, index={self.index}"


def _unfused_state(name: str, parent: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
    """State-dict post-hook of the parent of group ``name``: the group's stacked weight (and bias) leave ``state``,
    and each member's rows take their place under its own name (module docstring)."""
    group = getattr(parent, name)
    for kind in ("weight", "bias"):
        stacked = state.pop(f"{prefix}{name}.{kind}", None)
        if stacked is None:
            continue
        for member, offset, size, biased in zip(GROUPS[name], group.offsets, group.sizes, group.biased, strict=True):
            if kind == "weight" or biased:
                state[f"{prefix}{member}.{kind}"] = stacked.narrow(0, offset, size)


def _fused_state(name: str, parent: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load-state-dict pre-hook of the parent of group ``name``: the members' tensors under their own names (an
    unfused checkpoint, or `_unfused_state`'s) stacked into the group's, where ``state`` holds all of them."""
    group = getattr(parent, name)
    for kind in ("weight", "bias"):
        keys = {member: f"{prefix}{member}.{kind}" for member, biased in zip(GROUPS[name], group.biased, strict=True)
                if kind == "weight" or biased}
        if not keys or not all(key in state for key in keys.values()):
            continue
        like = state[next(iter(keys.values()))]
        parts = [state.pop(keys[member]) if member in keys else like.new_zeros(size)
                 for member, size in zip(GROUPS[name], group.sizes, strict=True)]
        state[f"{prefix}{name}.{kind}"] = torch.cat(parts)


def _fusable(linears: list[object]) -> bool:
    if not all(type(linear) is nn.Linear for linear in linears):
        return False
    weights = [linear.weight for linear in linears]
    if any(type(w.data) is not torch.Tensor for w in weights):   # DTensor (tensor parallelism), quantised, ...
        raise ValueError("fuse_projections needs plain weights; it does not fuse tensor-parallel (DTensor) or "
                         "quantised linears: fuse before sharding, or leave the model unfused")
    first = weights[0]
    return all(w.shape[1] == first.shape[1] and w.device == first.device and w.dtype == first.dtype
               for w in weights)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every group of `GROUPS` found in ``model`` (module docstring), in place; returns the groups fused.

    For a model whose attentions and MLPs name their linears as Llama, Qwen2, Mistral or Gemma do. Apply it before
    ``torch.compile`` (or `flexentropy.warm_up`); the outputs equal the unfused model's within the rounding of a
    wider matrix product. Each group's weights are copied once into the stacked one, parent by parent, and the
    originals freed, so the extra memory is one parent's group at a time. ``state_dict`` (and so ``save_pretrained``)
    gives the unfused names, and ``load_state_dict`` takes them (module docstring).

    Raises:
        ValueError: no group to fuse (or, for a model fused already, none left), or a group whose linears are not
            plain tensors.
    """
    fused = 0
    for parent in list(model.modules()):
        for name, members in GROUPS.items():
            linears = [getattr(parent, member, None) for member in members]
            if hasattr(parent, name) or not _fusable(linears):
                continue
            group = FusedLinear(linears)
            parent.add_module(name, group)
            for index, member in enumerate(members):
                setattr(parent, member, FusedMember(group, index))
            parent.register_state_dict_post_hook(functools.partial(_unfused_state, name))
            parent.register_load_state_dict_pre_hook(functools.partial(_fused_state, name))
            fused += 1
    if not fused:
        already = sum(isinstance(module, FusedLinear) for module in model.modules())
        if already:
            raise ValueError(f"fuse_projections: {type(model).__name__} is already fused ({already} groups, by an "
                             f"earlier call): nothing is left to fuse")
        raise ValueError(f"fuse_projections found no group to fuse in {type(model).__name__}: it looks for "
                         f"{', '.join('/'.join(m) for m in GROUPS.values())} as nn.Linear children of one module, "
                         f"with one input size, device and dtype")
    return fused
