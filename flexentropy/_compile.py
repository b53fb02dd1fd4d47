"""Compilation helpers shared by flexentropy's compiled regions: the recompile guard, and `eager`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

RECOMPILE_LIMIT = 64
"""Graphs each flexentropy compiled region may hold. Lengths share a graph (``dynamic=True``); each model shape
(dtype, head counts, head dim, softmax scale, block size, backend) needs its own, and dynamo's default of 8 is
reached by one process that serves a few models."""


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
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=limit):
            yield
    except torch._dynamo.exc.FailOnRecompileLimitHit as err:
        raise RecompileLimitError(
            f"a flexentropy compiled region hit its recompile limit "
            f"({max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)} graphs); refusing the eager fallback, "
            "which materialises N x N attention scores. Raise flexentropy._compile.RECOMPILE_LIMIT (or "
            "torch._dynamo.config.recompile_limit), or keep dtypes/devices/head counts fixed across calls."
        ) from err


def keep_dynamic(*tensors: torch.Tensor, dims: tuple[int, ...]) -> None:
    """Keep the sizes of ``dims`` of ``tensors`` (lengths, block counts) symbolic in the next compiled call.

    Dynamo gives equal sizes one symbol, and flex keeps head counts and the head dim static: a first call whose block
    count equals one of them would compile that count as a constant, and the next length would recompile. Inside an
    outer compile the outer graph decides, so this marks nothing there.
    """
    if torch.compiler.is_compiling():
        return
    for tensor in tensors:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim % tensor.dim())


@torch.compiler.disable
def eager(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` outside any compiled region (dynamo breaks the graph here instead of tracing it)."""
    return fn(*args)
