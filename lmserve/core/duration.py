"""Durations as Ollama writes them (`keep_alive`): "30s", "5m", "1h30m", a number of seconds, 0, or a
negative number for never."""

from __future__ import annotations

import math
import re

_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str | float | int) -> float:
    """Seconds (`math.inf` for a negative value: never); ValueError naming what is allowed."""
    if isinstance(value, bool):
        raise ValueError(f"must be a duration such as 30s, 5m or 1h, or -1 for never, not {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            parts = _PART.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise ValueError(f"must be a duration such as 30s, 5m or 1h, or -1 for never, not {value!r}") from None
            seconds = sum(float(n) * _UNIT[u] for n, u in parts)
    if math.isnan(seconds):
        raise ValueError("must be a duration, not NaN")
    return math.inf if seconds < 0 else seconds
