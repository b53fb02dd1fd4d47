"""Compilation guard shared by the compiled regions of flexentropy."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class RecompileLimitError(RuntimeError):
    """Raised instead of silently falling back to eager flex attention (which would materialise N x N scores)."""


@contextlib.contextmanager
def no_silent_fallback() -> Iterator[None]:
    """Turn dynamo's silent eager fallback at ``recompile_limit`` into `RecompileLimitError`.

    Inside an outer ``torch.compile`` (e.g. of a whole model) the config patch would break the graph; there the
    outer compile's own settings apply.
    """
    if torch.compiler.is_compiling():
        yield
        return
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            yield
    except torch._dynamo.exc.FailOnRecompileLimitHit as err:
        raise RecompileLimitError(
            "a flexentropy compiled region hit torch._dynamo.config.recompile_limit "
            f"({torch._dynamo.config.recompile_limit}); refusing the eager fallback, which materialises "
            "N x N attention scores. Raise the limit or keep dtypes/devices/head counts fixed across calls."
        ) from err
