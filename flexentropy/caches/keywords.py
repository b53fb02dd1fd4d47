"""Where a transformers module finds the cache among its keyword arguments.

transformers 5.24 renamed the cache keyword of attention modules, decoder layers, model forwards and ``generate``
from ``past_key_values`` to ``cache`` (the old name stays a deprecated alias until 5.40); 5.17-5.23 use
``past_key_values``. Hooks read both.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

CACHE_KEYWORDS = ("cache", "past_key_values")
"""The cache's keyword, newest name first."""


def cache_argument(kwargs: Mapping[str, Any]) -> Any:
    """The cache passed in ``kwargs`` under either name (None when there is none)."""
    for name in CACHE_KEYWORDS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def cache_keyword(model: Any) -> str:
    """The keyword under which ``model``'s forward and ``generate`` take a cache: ``"cache"`` (transformers >= 5.24)
    or ``"past_key_values"`` (earlier). ``model.generate(ids, **{cache_keyword(model): cache})`` works on both."""
    forward = getattr(model, "_orig_mod", model).forward  # a torch.compile'd model wraps the original
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
