"""Where a transformers module finds the cache among its keyword arguments.

transformers 5.24 renamed the cache keyword of attention modules, decoder layers, model forwards and ``generate``
from ``past_key_values`` to ``cache`` (the old name stays a deprecated alias until 5.40); 5.17-5.23 use
``past_key_values``. Hooks read both. flexentropy hands its own objects to its attention function under keywords of
its own (`CACHE_KWARG`, `STEP_KWARG`, `DRIVER_KWARG`), which transformers passes through.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from flexentropy._checks import check_has

CACHE_KEYWORDS = ("cache", "past_key_values")
"""The cache's keyword, newest name first."""
CACHE_KWARG = "flexentropy_cache"
"""Keyword under which flexentropy's hooks hand an attention module's cache to its attention function (transformers
does not pass the cache on)."""
STEP_KWARG = "flexentropy_step"
"""Keyword under which a static step run by layer arguments (`flexentropy.engine.compiled_layer`) hands a
layer's `StepLayer` (the step's metadata) to its attention function."""
DRIVER_KWARG = "flexentropy_driver"
"""Keyword set (True) on the forwards a step driver runs (`flexentropy.engine.driver`): the model's hooks leave the
step's preparation and advance to the driver."""


def cache_argument(kwargs: Mapping[str, Any]) -> Any:
    """The cache passed in ``kwargs`` under either name (None when there is none)."""
    for name in CACHE_KEYWORDS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def cache_keyword(model: Any) -> str:
    """The keyword under which ``model``'s forward and ``generate`` take a cache: ``"cache"`` (transformers >= 5.24)
    or ``"past_key_values"`` (earlier). ``model.generate(ids, **{cache_keyword(model): cache})`` works on both."""
    model = getattr(model, "_orig_mod", model)  # a torch.compile'd model wraps the original
    check_has("cache_keyword", "model", model, ("forward",), "a transformers model")
    forward = model.forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
