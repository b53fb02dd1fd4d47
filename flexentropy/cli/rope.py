"""Rope scaling of a transformers config: YaRN, for contexts past the one a model was trained on."""

from __future__ import annotations

from typing import Any


def apply_yarn(config: Any, factor: float) -> None:
    """Switch a transformers config (>= 5.17: ``rope_parameters``) to YaRN rope scaling by ``factor``, in place.

    ``original_max_position_embeddings`` is the config's context; ``max_position_embeddings`` becomes ``factor`` times
    it (what length checks read). Qwen2.5 documents ``factor=4`` for 128k.

    Raises:
        ValueError: ``factor <= 1``, or a model with per-layer-type rope settings (e.g. Gemma-3).
    """
    if not factor > 1:
        raise ValueError(f"YaRN factor must be > 1, got {factor}")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in rope:
        raise ValueError(f"--yarn needs a model with one rope setting (rope_parameters with rope_theta), got {rope}")
    if rope.get("rope_type", "default") not in ("default", "yarn"):
        raise ValueError(f"--yarn: the model already uses rope_type {rope['rope_type']!r}")
    original = int(rope.get("original_max_position_embeddings") or config.max_position_embeddings)
    config.rope_parameters = {**rope, "rope_type": "yarn", "factor": float(factor),
                              "original_max_position_embeddings": original}
    config.max_position_embeddings = int(factor * original)
