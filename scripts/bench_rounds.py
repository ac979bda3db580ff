"""What the in-process A/B benchmarks share: timing a call, and the best of alternating rounds
(this machine's speed drifts within minutes, so the two sides take turns)."""

from __future__ import annotations

import time
from collections.abc import Callable


def timed(call: Callable[[], object], times: int) -> Callable[[], float]:
    """A run: one warm call (first-call setup, the threads), then the mean seconds of `times` calls."""
    def run() -> float:
        call()
        start = time.perf_counter()
        for _ in range(times):
            call()
        return (time.perf_counter() - start) / times
    return run


def best_of(rounds: int, run: Callable[[], float], sides: dict[str, Callable[[], None]]) -> dict[str, float]:
    """`run`'s least seconds per side over `rounds` rounds, each round setting every side in turn."""
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(rounds):
        for name, choose in sides.items():
            choose()
            best[name] = min(best[name], run())
    return best
