"""Validation of tensors at the public boundary: clear `ValueError`/`TypeError` instead of kernel crashes."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_heads(named: Sequence[tuple[str, object]]) -> None:
    """Raise unless each ``(name, tensor)`` of ``named`` is a floating tensor (`FLOAT_DTYPES`) of 4 dims ``[batch,
    heads, seq_len, head_dim]`` with the dtype and device of the first (q/k/v of an attention call)."""
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq_len, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor (float16/bfloat16/float32/float64), got {t.dtype}")
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{name}.dtype ({t.dtype}) must equal {first_name}.dtype ({first.dtype})")
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; put them on one device")


def check_qk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None, *, q_start: int = 0) -> None:
    """Check ``q [B, Hq, M, D]``, ``k``/``v [B, Hkv, q_start + M, D]`` agree in shape, dtype and device; Hq % Hkv
    == 0. ``q_start`` (an int >= 0) is the position of the first query: the keys are those of the positions
    ``0 .. q_start + M - 1`` (a whole prompt: ``q_start=0``, equal lengths)."""
    if not is_int(q_start) or q_start < 0:
        raise ValueError(f"q_start must be an int >= 0 (the position of the chunk's first query), got {q_start!r}")
    named = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    check_heads(named)
    for name, t in named[1:]:
        for axis, what in ((0, "batch size"), (3, "head dim")):
            if t.shape[axis] != q.shape[axis]:
                raise ValueError(f"{name} {what} (dim {axis}) is {t.shape[axis]} but q's is {q.shape[axis]}; "
                                 f"q {tuple(q.shape)}, {name} {tuple(t.shape)}")
        if t.shape[2] != q_start + q.shape[2]:
            expected = (f"q's is {q.shape[2]}" if q_start == 0 else
                        f"q_start + q's is {q_start} + {q.shape[2]} = {q_start + q.shape[2]}: {name} holds the "
                        "positions 0 .. q_start + M - 1, every key up to the chunk's last query")
            raise ValueError(f"{name} sequence length (dim 2) is {t.shape[2]} but {expected}; "
                             f"q {tuple(q.shape)}, {name} {tuple(t.shape)}")
    if v is not None and v.shape[1] != k.shape[1]:
        raise ValueError(f"v has {v.shape[1]} heads but k has {k.shape[1]}; they must match")
    if q.shape[0] == 0:
        raise ValueError(f"batch size must be >= 1, got q of shape {tuple(q.shape)}")
    if q.shape[3] == 0:
        raise ValueError(f"head dim must be >= 1, got q of shape {tuple(q.shape)}")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a positive multiple of key/value heads ({hkv}) for GQA")


def check_tokens(owner: str, name: str, tokens: object, *, dims: int = 2) -> None:
    """Raise unless ``tokens`` is a tensor of ``dims`` dims (``input_ids [B, N]``; ``inputs_embeds [B, N, d]`` with
    ``dims=3``) holding at least one row of at least one token."""
    if isinstance(tokens, torch.Tensor) and tokens.dim() == dims and tokens.shape[0] and tokens.shape[1]:
        return
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"{owner} expects {name} as a tensor, got {type(tokens).__name__}")
    shape = "[batch, tokens]" if dims == 2 else "[batch, tokens, hidden]"
    if tokens.dim() == dims - 1:
        hint = f": one prompt needs its batch dim, {name}[None]"
    elif tokens.dim() == dims:
        hint = ": an empty prompt has no token to attend and no next token to predict; give at least one token"
    else:
        hint = ""
    raise ValueError(f"{owner} expects {name} {shape} with at least one row and one token, got "
                     f"{list(tokens.shape)}{hint}")


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer and not a bool (the one test of integer knobs): an int, or a numpy integer
    such as ``np.int64(256)``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """Whether ``value`` is a real number and not a bool (the one test of real-valued knobs): an int or a float, or
    a numpy integer or float such as ``np.float32(0.5)``."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def plain(value: Any) -> Any:
    """``value`` with a numpy integer or float (`is_int`, `is_number`) as Python's int or float, a tuple's items
    likewise; anything else as it is."""
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def plain_fields(knobs: Any) -> None:
    """Every field of the frozen dataclass ``knobs`` as `plain` makes it, in place (its ``__post_init__`` calls it
    before validating): a knob given as ``np.int64(256)`` is held as the int 256, which compiled code and JSON
    take like any other."""
    for field in fields(knobs):
        object.__setattr__(knobs, field.name, plain(getattr(knobs, field.name)))


def check_layer_idx(layer_idx: int | None, *, optional: bool = False) -> None:
    """Raise unless ``layer_idx`` is an int >= 0 (or, when ``optional``, None: no layer given)."""
    if optional and layer_idx is None:
        return
    if not is_int(layer_idx) or layer_idx < 0:
        expected = "an int >= 0 or None (no layer given: only the length decides)" if optional else "an int >= 0"
        raise ValueError(f"layer_idx must be {expected}, got {layer_idx!r}")


def label(owner: str, name: str) -> str:
    return f"{owner}.{name}" if owner else name


def check_int(owner: str, name: str, value: object, minimum: int | None = 0, maximum: int | None = None, *,
              minimum_is: str = "") -> int:
    """Raise unless ``value`` is an int (not a bool) ``>= minimum`` (any int when ``minimum`` is None) and, when
    ``maximum`` is given, ``<= maximum``. ``minimum_is`` says where a minimum that is another knob comes from (e.g.
    ``"window=64: ..."``), for the message. Returns ``value`` as Python's int (a numpy integer such as
    ``np.int64(3)`` becomes ``3``), what a public function passes on (transformers refuses numpy integers)."""
    if not is_int(value):
        raise TypeError(f"{label(owner, name)} must be an int, got {type(value).__name__} {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if maximum is None:
            expected = f">= {minimum}" + (f" ({minimum_is})" if minimum_is else "")
        elif minimum is None:
            expected = f"<= {maximum}"
        else:
            expected = f"in [{minimum}, {maximum}]"
        raise ValueError(f"{label(owner, name)} must be {expected}, got {value}")
    return int(value)


def check_number(owner: str, name: str, value: object, low: float = -math.inf, high: float = math.inf, *,
                 open_low: bool = False) -> None:
    """Raise unless ``value`` is a finite real number (int or float, not a bool) in ``[low, high]`` (``(low, high]``
    with ``open_low``). NaN and infinities are rejected whatever the bounds."""
    if not is_number(value):
        raise TypeError(f"{label(owner, name)} must be a number, got {type(value).__name__} {value!r}")
    inside = (low < value if open_low else low <= value) and value <= high
    if not math.isfinite(value) or not inside:
        if high == math.inf:
            bounds = "" if low == -math.inf else f" {'>' if open_low else '>='} {low}"
        else:
            bounds = f" in {'(' if open_low else '['}{low}, {high}]"
        raise ValueError(f"{label(owner, name)} must be a finite number{bounds}, got {value!r}")


def check_scale(owner: str, scale: object) -> float | None:
    """Raise unless the softmax ``scale`` is None (the default ``1 / sqrt(D)``) or a finite number > 0 (0 gives a
    plain mean of the values, a negative scale the opposite of attention, NaN a NaN output). Returns it as Python's
    float (a numpy number such as ``np.float64(0.25)`` would reach compiled code as a constant it cannot take)."""
    if scale is None:
        return None
    check_number(owner, "scale", scale, 0, open_low=True)
    return float(scale)


def check_odd(owner: str, name: str, value: object, maximum: int | None = None) -> None:
    """Raise unless ``value`` is an odd int >= 1 (1: off), at most ``maximum`` when given."""
    check_int(owner, name, value, 1, maximum)
    if value % 2 == 0:
        raise ValueError(f"{label(owner, name)} must be odd (1 = off), got {value}")


def check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{label(owner, name)} must be one of {choices}, got {value!r}")


def check_bool(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    """Raise unless ``value`` is True or False (or None when ``optional``: the default's choice). Any other value
    would be taken for its truth: the string ``"no"`` turns a flag on."""
    if not (isinstance(value, bool) or (optional and value is None)):
        expected = "a bool or None (None: the default's choice)" if optional else "a bool (True or False)"
        raise TypeError(f"{label(owner, name)} must be {expected}, got {type(value).__name__} {value!r}")


def check_has(owner: str, name: str, value: object, attributes: tuple[str, ...], expected: str) -> None:
    """Raise `TypeError` unless ``value`` has each of ``attributes`` (what ``owner`` reads of it); the message names
    ``expected``, what to pass (e.g. ``"a transformers model"``)."""
    missing = [attribute for attribute in attributes if not hasattr(value, attribute)]
    if missing:
        raise TypeError(f"{owner} expects {name} as {expected}, got {type(value).__name__} (it has no "
                        f"{', '.join('.' + attribute for attribute in missing)})")
