"""The lab's model loading: the ``flexentropy`` command's offline loading (`flexentropy.cli.loading`) with the
model aliases of `bench.models` (assembled from registry part wheels) as well as paths.

torch and transformers are imported inside the functions that need them, so that building a parser stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.models import MODELS, ModelUnavailable, resolve_alias
from flexentropy.cli import loading
from flexentropy.cli.loading import DTYPES, SMOLLM2_GGUF, InputError

__all__ = ["DTYPES", "SMOLLM2_GGUF", "InputError", "load_model", "resolve_model"]


def resolve_model(path: str | None) -> tuple[Path, str | None]:
    """``(folder, gguf_file or None)`` for ``--model``: an alias of `bench.models.MODELS` (its verified cached
    file, assembled from the part wheels on first use), else as `flexentropy.cli.loading.resolve_model` (a path, or
    None for the SmolLM2 wheel)."""
    if path in MODELS:
        try:
            gguf = resolve_alias(path)
        except (ModelUnavailable, OSError) as err:
            raise InputError(str(err)) from None
        return gguf.parent, gguf.name
    return loading.resolve_model(path)


def load_model(path: str | None = None, device: str = "auto", dtype: str = "auto", yarn: float | None = None
               ) -> tuple[Any, Any, str]:
    """``(model, tokenizer, source)`` loaded offline from ``--model``-style ``path`` (see `resolve_model`)."""
    folder, gguf_file = resolve_model(path)
    where = loading.select_device(device)
    config = loading.load_config(folder, gguf_file, yarn)
    tokenizer = loading.load_tokenizer(folder, gguf_file)
    model = loading.load_weights(folder, gguf_file, config, loading.select_dtype(dtype, where), where)
    return model, tokenizer, loading.model_source(folder, gguf_file)
