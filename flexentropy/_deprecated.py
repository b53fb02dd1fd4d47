"""Old import paths that keep working, with a warning: a module-level ``__getattr__`` (`moved`) that hands out a name
from the module it moved to and says where that is."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def moved(old: str, homes: Mapping[str, str] | tuple[str, ...]) -> Callable[[str], Any]:
    """The ``__getattr__`` of the module ``old``, whose names now live elsewhere: ``homes`` maps each name to its new
    module, or is a tuple of modules searched in order (the first holding the name). Each access gives a
    ``DeprecationWarning`` naming the new place (the map's module; for a search, the module defining the name); an
    unknown name raises ``AttributeError`` as a module would."""
    search = not isinstance(homes, Mapping)

    def __getattr__(name: str) -> Any:
        moving = not (name.startswith("__") and name.endswith("__"))      # a module's own dunders stay its own
        for place in (homes if search else [homes[name]] if name in homes else []) if moving else []:
            module = importlib.import_module(place)
            if name in vars(module):
                value = vars(module)[name]
                home = getattr(value, "__module__", place) if search and callable(value) else place
                warnings.warn(f"{old}.{name} has moved: import it from {home} ({old} is deprecated and will be "
                              "removed)", DeprecationWarning, stacklevel=2)
                return value
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
