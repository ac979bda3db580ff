"""How many threads the compiled kernels and BLAS run a step with, chosen from measured step times.

A parallel region ends when its slowest thread does. With another process busy on one of two
cores, every two-thread region of a decode step waited a scheduler time slice for the thread whose
core was taken: SmolLM2's decode fell from 50 to 2 tok/s, where one thread still made 33. Users'
laptops and CI runners are rarely idle, and the load changes while a server runs, so the count is
not fixed at start: the tuner runs each pass shape (by its row count) with its best count so far,
now and then tries another count on one pass, and keeps whichever the measured times favour. A
trial that loses waits twice as long before the next one, so a machine whose load holds steady
pays for trials rarely; a best count whose passes grow much slower than they were (load arrived)
gets a trial at once (figures: docs/PERFORMANCE.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

FIRST_TRIAL = 16  # passes of a shape between trials of another thread count, at first
LAST_TRIAL = 1024  # the longest wait a run of lost trials reaches
WEIGHT = 0.3  # of a new time in a count's moving average
SLOWED = 1.5  # the best count's average past this many times its lowest: try another at once
MARGIN = 0.9  # a trial's pass must take less than this share of the best count's average to win


@dataclass
class _Shape:
    """What the tuner knows of passes with one row count."""

    best: int
    seconds: dict[int, float] = field(default_factory=dict)  # moving average per thread count
    lowest: dict[int, float] = field(default_factory=dict)  # the lowest average each count reached
    warm: set[int] = field(default_factory=set)  # the counts that have run a pass
    wait: int = FIRST_TRIAL
    until_trial: int = 2  # the first trial comes early: a busy machine is found out at once


class ThreadTuner:
    """Picks the kernels' thread count of each pass of up to `tuned_rows` rows (decode, verify);
    wider passes (prompt chunks: large BLAS products, whose threads pay off even on a busy
    machine) run with every thread. `set_threads(count, wide)` applies a pass's count to the
    calling thread."""

    def __init__(self, most: int, set_threads: Callable[[int, bool], None], tuned_rows: int) -> None:
        self.counts = tuple(sorted({1, most}))
        self.tuned_rows = tuned_rows
        self._set = set_threads
        self._shapes: dict[int, _Shape] = {}
        self._applied = threading.local()  # the count set on each thread (Numba's is per thread)

    def choose(self, rows: int) -> int:
        """The count for a pass of `rows` rows (set on the calling thread): its best so far, or on
        a trial another one; 0 for an untuned pass (every thread), which `record` ignores."""
        if rows > self.tuned_rows:
            self._apply(self.counts[-1], wide=True)
            return 0
        shape = self._shapes.setdefault(rows, _Shape(best=self.counts[-1]))
        shape.until_trial -= 1
        count = shape.best
        if shape.until_trial <= 0 and len(self.counts) > 1:
            count = next(c for c in self.counts if c != shape.best)  # with two counts: the other one
        self._apply(count, wide=False)
        return count

    def _apply(self, count: int, wide: bool) -> None:
        if getattr(self._applied, "setting", None) != (count, wide):
            self._set(count, wide)
            self._applied.setting = (count, wide)

    def record(self, rows: int, count: int, seconds: float) -> None:
        """A pass of `rows` rows took `seconds` with `count` threads (0: untuned, ignored)."""
        if not count:
            return
        shape = self._shapes[rows]
        if count not in shape.warm:  # a count's first pass starts its threads: not a measure
            shape.warm.add(count)
            shape.until_trial = min(shape.until_trial, 1)
            return
        if count == shape.best:
            old = shape.seconds.get(count)
            average = shape.seconds[count] = seconds if old is None else (1 - WEIGHT) * old + WEIGHT * seconds
            shape.lowest[count] = min(average, shape.lowest.get(count, average))
            if average > SLOWED * shape.lowest[count] and shape.until_trial > 1:
                shape.wait, shape.until_trial = FIRST_TRIAL, 1
            return
        # A trial: one pass against the best count's average; it must win by a margin to take over.
        best = shape.seconds.get(shape.best)
        if best is None:  # the best count has no measured pass yet: compare again after two
            shape.until_trial = 2
            return
        if seconds < MARGIN * best:
            shape.seconds[count], shape.lowest[count] = seconds, seconds
            shape.best, shape.wait = count, FIRST_TRIAL
        else:
            shape.wait = min(LAST_TRIAL, shape.wait * 2)
        shape.until_trial = shape.wait


def blas_threads() -> Callable[[int], None]:
    """Sets how many threads the BLAS NumPy uses runs with (process-wide: the decode thread is
    its one caller during a pass). A tuned pass gives BLAS one: its products there are attention's
    small ones, and two pools of spinning threads on two cores (OpenMP's kernels, OpenBLAS's)
    made an idle decode step at 4,096 cached tokens take 446 ms instead of 49."""
    from threadpoolctl import ThreadpoolController

    blas = ThreadpoolController().select(user_api="blas")
    return lambda n: blas.limit(limits=n)
