"""`chunk_mlp`: the MLPs of a long prompt's forward run over the sequence in chunks of tokens, so their
intermediate activations stop setting the longest prompt one GPU takes.

At 1M tokens on a Llama-3.1-8B shape, one MLP's gate and up projections alone are ``[1M, 28672]`` bfloat16 (56 GiB),
more than the KV a latent cache keeps of the whole prompt; at 128k they are 7 GiB, and the activation and product
after them 7 GiB more, beside the prompt's 16 GiB of KV. An MLP acts on each token alone, so running it on chunks of
the sequence gives the same output (each chunk's products are the same rows of the whole one's) and holds one
chunk's activations at a time. Forwards of at most ``tokens`` tokens (decode steps, short prompts) run as before.
`flexentropy.enable` chunks a model's MLPs by default (`MLP_CHUNK`).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from flexentropy._checks import check_int

MLP_NAMES = ("mlp", "feed_forward")
"""Names under which a decoder layer holds its MLP (Llama, Qwen2, Mistral, Gemma: ``mlp``)."""

MLP_CHUNK = 16384
"""Tokens per chunk of `chunk_mlp`'s default and of `flexentropy.enable`'s: a chunk's matrix products are still large
enough to run at the GPU's full rate (16,384 x 4,096 x 28,672 on the 8B shape), and its activations are a quarter of
those of a 65,536-token chunk, so that prompts from 16k tokens on peak below a whole-sequence MLP's."""


CHUNK_ATTR = "flexentropy_mlp_chunk"
"""Attribute of a chunked MLP: its tokens per chunk."""

WHOLE_ATTR = "flexentropy_whole_forward"
"""Attribute of a chunked MLP whose instance ``forward`` was another library's (a hook's wrapper): that forward, which
each chunk runs (else the class's)."""


def forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A chunked MLP's forward over ``x [..., L, d]``, in chunks of its `CHUNK_ATTR` tokens along ``L`` (module
    docstring); shorter inputs whole.

    `chunk_mlp` binds it to each MLP as its instance ``forward`` (``types.MethodType``): one function for every MLP,
    and a chunk size that is an int on each, so that a compiled decoder layer (the static decode step's) is one graph
    for every layer; an object per MLP (a ``functools.partial``, a callable) would be guarded by identity, a graph per
    layer. Named ``forward`` so that an unpickled model finds its class's ``forward`` there (its MLPs run whole).
    """
    tokens, whole = getattr(mlp, CHUNK_ATTR), vars(mlp).get(WHOLE_ATTR)

    def run(part: torch.Tensor) -> torch.Tensor:
        return type(mlp).forward(mlp, part) if whole is None else whole(part)

    length = x.shape[-2]
    if length <= tokens:
        return run(x)
    first = run(x[..., :tokens, :])
    out = first.new_empty((*first.shape[:-2], length, first.shape[-1]))
    out[..., :tokens, :] = first
    for start in range(tokens, length, tokens):
        out[..., start : start + tokens, :] = run(x[..., start : start + tokens, :])
    return out


def chunked(mlp: nn.Module) -> bool:
    """Whether ``mlp`` runs `forward` (`chunk_mlp` chunked it)."""
    bound = vars(mlp).get("forward")
    return isinstance(bound, types.MethodType) and bound.__func__ is forward


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    """The MLPs of ``model``: its children named as in `MLP_NAMES`."""
    return [module for parent in model.modules() for name, module in parent.named_children() if name in MLP_NAMES]


def chunked_tokens(model: nn.Module) -> int | None:
    """Tokens per chunk of ``model``'s MLPs (`chunk_mlp`), or None when they run whole (or it has none)."""
    return next((getattr(mlp, CHUNK_ATTR) for mlp in mlp_modules(model) if chunked(mlp)), None)


def chunk_mlp(model: nn.Module, tokens: int | None = MLP_CHUNK) -> int:
    """Run every MLP of ``model`` (a child named as in `MLP_NAMES`) over chunks of ``tokens`` tokens (module
    docstring), in place; ``tokens=None`` restores the whole-sequence forwards. Returns the MLPs changed. A model
    pickled whole (``torch.save(model)``) comes back with its MLPs whole: chunk them again (`chunk_mlp`, or
    `flexentropy.enable` for the MLPs it chunked).

    Raises:
        ValueError: ``tokens`` not a positive int, or no MLP found.
    """
    if tokens is not None:
        check_int("chunk_mlp", "tokens", tokens, 1)
    mlps = mlp_modules(model)
    if not mlps:
        raise ValueError(f"chunk_mlp found no MLP in {type(model).__name__}: it looks for children named "
                         f"{' or '.join(MLP_NAMES)}")
    for mlp in mlps:
        if chunked(mlp):                        # back to the forward it had
            del mlp.forward
            delattr(mlp, CHUNK_ATTR)
            whole = vars(mlp).pop(WHOLE_ATTR, None)
            if whole is not None:
                mlp.forward = whole
        if tokens is not None:
            if "forward" in vars(mlp):          # another library's wrapper: each chunk runs it
                setattr(mlp, WHOLE_ATTR, vars(mlp).pop("forward"))
            setattr(mlp, CHUNK_ATTR, int(tokens))
            mlp.forward = types.MethodType(forward, mlp)
    return len(mlps)
