"""A callback after each attention layer's forward: what a progress bar over a prefill's layers reads."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn

from flexentropy.integrations.hf.layer_state import attention_modules


@contextlib.contextmanager
def after_each_layer(model: nn.Module, callback: Callable[[], None]) -> Iterator[None]:
    """Call ``callback()`` after every attention module's forward (`attention_modules`) while the block runs; the
    forward hooks come off on exit; what ``callback`` returns is dropped (a hook's return would replace the
    module's output)."""

    def hook(*_: object) -> None:
        callback()

    handles = [module.register_forward_hook(hook) for module in attention_modules(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
