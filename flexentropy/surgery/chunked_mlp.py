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

from collections.abc import Callable

import torch
from torch import nn

from flexentropy._checks import check_int

MLP_NAMES = ("mlp", "feed_forward")
"""Names under which a decoder layer holds its MLP (Llama, Qwen2, Mistral, Gemma: ``mlp``)."""

MLP_CHUNK = 16384
"""Tokens per chunk of `chunk_mlp`'s default and of `flexentropy.enable`'s: a chunk's matrix products are still large
enough to run at the GPU's full rate (16,384 x 4,096 x 28,672 on the 8B shape), and its activations are a quarter of
those of a 65,536-token chunk, so that prompts from 16k tokens on peak below a whole-sequence MLP's."""


class ChunkedForward:
    """An MLP's forward over ``x [..., L, d]`` in chunks of ``tokens`` along ``L`` (module docstring); shorter inputs
    go to ``forward`` whole."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], tokens: int) -> None:
        self.forward, self.tokens = forward, tokens

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-2]
        if length <= self.tokens:
            return self.forward(x)
        first = self.forward(x[..., : self.tokens, :])
        out = first.new_empty((*first.shape[:-2], length, first.shape[-1]))
        out[..., : self.tokens, :] = first
        for start in range(self.tokens, length, self.tokens):
            out[..., start : start + self.tokens, :] = self.forward(x[..., start : start + self.tokens, :])
        return out


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    """The MLPs of ``model``: its children named as in `MLP_NAMES`."""
    return [module for parent in model.modules() for name, module in parent.named_children() if name in MLP_NAMES]


def chunked_tokens(model: nn.Module) -> int | None:
    """Tokens per chunk of ``model``'s MLPs (`chunk_mlp`), or None when they run whole (or it has none)."""
    chunked = [vars(mlp).get("forward") for mlp in mlp_modules(model)]
    return next((forward.tokens for forward in chunked if isinstance(forward, ChunkedForward)), None)


def chunk_mlp(model: nn.Module, tokens: int | None = MLP_CHUNK) -> int:
    """Run every MLP of ``model`` (a child named as in `MLP_NAMES`) over chunks of ``tokens`` tokens (module
    docstring), in place; ``tokens=None`` restores the whole-sequence forwards. Returns the MLPs changed.

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
        chunked = mlp.__dict__.get("forward")
        if isinstance(chunked, ChunkedForward):
            del mlp.forward                     # back to the class's forward
        if tokens is not None:
            mlp.forward = ChunkedForward(mlp.forward, int(tokens))
    return len(mlps)
