"""Typed reads of JSON request fields that fail with a 400 naming the field.

Every dialect validates its body through these, so a wrong type or range reads the same way
everywhere: "temperature: must be a number between 0 and 2".
"""

from __future__ import annotations

import math
from typing import Any

from lmserve.core.errors import invalid

_MISSING = object()


def _present(body: dict[str, Any], key: str) -> Any:
    value = body.get(key, _MISSING)
    return _MISSING if value is None else value


def number(body: dict[str, Any], key: str, default: float, lo: float, hi: float, name: str | None = None) -> float:
    value = _present(body, key)
    if value is _MISSING:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(name or key, f"must be a number between {lo:g} and {hi:g}")
    if not lo <= value <= hi:
        raise invalid(name or key, f"must be between {lo:g} and {hi:g}, got {value:g}")
    return float(value)


def integer(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int | None = None,
            name: str | None = None) -> int | None:
    value = _present(body, key)
    if value is _MISSING:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name or key, "must be an integer")
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise invalid(name or key, f"must be {bound}, got {value}")
    return value


def boolean(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = _present(body, key)
    if value is _MISSING:
        return default
    if not isinstance(value, bool):
        raise invalid(key, "must be a boolean")
    return value


def string(body: dict[str, Any], key: str, default: str | None = None, name: str | None = None) -> str | None:
    value = _present(body, key)
    if value is _MISSING:
        return default
    if not isinstance(value, str):
        raise invalid(name or key, "must be a string")
    return value


def obj(body: dict[str, Any], key: str, name: str | None = None) -> dict[str, Any]:
    value = _present(body, key)
    if value is _MISSING:
        return {}
    if not isinstance(value, dict):
        raise invalid(name or key, "must be an object")
    return value


def array(body: dict[str, Any], key: str, name: str | None = None) -> list[Any]:
    value = _present(body, key)
    if value is _MISSING:
        return []
    if not isinstance(value, list):
        raise invalid(name or key, "must be an array")
    return value


def stop_strings(body: dict[str, Any], key: str, limit: int | None = 4) -> list[str]:
    """`stop` as OpenAI takes it: a string or a list of up to `limit` strings."""
    value = _present(body, key)
    if value is _MISSING:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid(key, "must be a string or an array of strings")
    if limit is not None and len(items) > limit:
        raise invalid(key, f"accepts at most {limit} sequences, got {len(items)}")
    return [s for s in items if s]


def logit_bias(body: dict[str, Any], key: str, vocab_size: int) -> dict[int, float]:
    """OpenAI's {"token id": bias in [-100, 100]} map."""
    raw = obj(body, key)
    bias: dict[int, float] = {}
    for token, value in raw.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            raise invalid(key, f"keys must be token ids, got {token!r}") from None
        if not 0 <= token_id < vocab_size:
            raise invalid(key, f"token id {token_id} is outside the vocabulary (0..{vocab_size - 1})")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise invalid(key, f"bias for token {token_id} must be a number between -100 and 100")
        bias[token_id] = float(value)
    return bias
