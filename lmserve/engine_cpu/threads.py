"""How many threads the compiled kernels and BLAS run a step with, chosen from measured step times.

A parallel region ends when its slowest thread does. With another process busy on one of two
cores, every two-thread region of a decode step waited a scheduler time slice for the thread whose
core was taken: SmolLM2's decode fell from 50 to 2 tok/s, where one thread still made 33. Users'
laptops and CI runners are rarely idle, and the load changes while a server runs, so the count is
not fixed at start: the tuner runs each pass shape (by its row count) with its best count so far,
now and then tries another count, and keeps whichever the measured times favour. A trial that
loses waits twice as long before the next one (every thread's count, beaten by far more than a
slowdown that sets off a trial, the longest wait at once), so a machine whose load holds steady
pays for trials rarely; a best count whose passes grow much slower than they were (load arrived) gets a
trial at once, and if it keeps winning, its slower pace is what later passes are held against:
held against its fastest ever, four served MoE streams (two threads 12-13 ms a pass, one 19,
after 7 ms ones early on) tried one thread at every other pass and ran two thirds of them there.

A count stands for the median of its last few passes, not a moving average: one slow pass (a page
fault, a burst of the HTTP thread or another process) once raised a two-thread average enough to
start a trial and lose to one thread, which then ran a served SmolLM2 reply's next ~300 passes at
7 ms where two threads took 5. A trial runs two passes and keeps the faster: the first pass after a
switch wakes the other count's threads and ran 1.3-1.5 ms slower, enough to lose every trial back
(figures: docs/PERFORMANCE.md).
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

FIRST_TRIAL = 16  # passes of a shape between trials of another thread count, at first
LAST_TRIAL = 1024  # the longest wait a run of lost trials reaches
RECENT = 5  # the best count's last passes whose median stands for it
TRIAL_PASSES = 2  # passes a trial runs; the faster one is its measure
SLOWED = 1.5  # the best count's median past this many times its lowest: try another at once
MARGIN = 0.9  # a trial's pass must take less than this share of the best count's median to win


@dataclass
class _Shape:
    """What the tuner knows of passes with one row count."""

    best: int
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))  # the best count's last passes
    lowest: float = float("inf")  # the lowest median the best count reached
    warm: bool = False  # whether the best count has run a pass (the first starts its threads: not a measure)
    wait: int = FIRST_TRIAL
    until_trial: int = 3  # the first trial comes early (after the best count's first measured pass): a busy machine is found out at once
    trial_left: int = 0  # passes of the running trial still to come
    trial_fastest: float = float("inf")  # the running trial's fastest pass so far
    passes: int = 0  # passes of this shape so far

    def median(self) -> float:
        """The best count's median pass (it has run one)."""
        return statistics.median(self.recent)


class ThreadTuner:
    """Picks the kernels' thread count of each pass of up to `tuned_rows` rows (decode, verify,
    short prompts), each row count on its own; wider passes (prompt chunks: large BLAS products,
    whose threads pay off even on a busy machine) run with every thread. `set_threads(count,
    wide)` applies a pass's count to the calling thread."""

    def __init__(self, most: int, set_threads: Callable[[int, bool], None], narrow_rows: int,
                 tuned_rows: int | None = None, trials: bool = True) -> None:
        """Passes of up to `tuned_rows` rows (default `narrow_rows`: decode steps; more: verify
        passes of several streams, short prompts) are tuned; `set_threads(count, wide)` is told
        whether a pass is past `narrow_rows` (the engine gives BLAS one thread in a narrow pass,
        every thread in a wide one). `trials` False: every pass keeps `most`, the count a tuned
        shape starts from (benchmarks whose sides differ several-fold in pass time, which would
        set trials off and hand one side's passes to one thread)."""
        self.counts = tuple(sorted({1, most})) if trials else (most,)
        self.narrow_rows = narrow_rows
        self.tuned_rows = narrow_rows if tuned_rows is None else tuned_rows
        self._set = set_threads
        self._shapes: dict[int, _Shape] = {}
        self._applied = threading.local()  # the count set on each thread (Numba's is per thread)

    def choose(self, rows: int) -> int:
        """The count for a pass of `rows` rows (set on the calling thread): its best so far, or on
        a trial another one; 0 for an untuned pass (every thread), which `record` ignores."""
        if rows > self.tuned_rows:
            self._apply(self.counts[-1], wide=True)
            return 0
        shape = self._shapes.get(rows)
        if shape is None:
            shape = self._shapes[rows] = self._new_shape()
        if not shape.trial_left:
            shape.until_trial -= 1
            if shape.until_trial <= 0 and len(self.counts) > 1:
                shape.trial_left, shape.trial_fastest = TRIAL_PASSES, float("inf")
        shape.passes += 1
        count = shape.best
        if shape.trial_left:
            count = next(c for c in self.counts if c != shape.best)  # with two counts: the other one
        self._apply(count, wide=rows > self.narrow_rows)
        return count

    def _new_shape(self) -> _Shape:
        """A new shape starts from the best count of the shape that has run the most passes (the
        decode steps', whose trials found out the machine's load), every thread when none has.
        With a core busy, a new shape's first pass on every thread waited a time slice a region:
        a served MoE's 20-row prompt took 150-190 ms, not 50. Where that count is every thread and
        has since won a trial's comparison (its wait past FIRST_TRIAL: the machine is idle), the new
        shape waits as long for its first trial: four served MoE streams' rarer shapes (a 16-row
        verify pass, the last streams' 3-row steps) each ran an early trial of one thread at 1.5-1.6x
        their two-thread time. On a busy machine a new shape tries every thread early: a wider pass
        may favour it."""
        busiest = max(self._shapes.values(), key=lambda shape: shape.passes, default=None)
        if busiest is None:
            return _Shape(best=self.counts[-1])
        if busiest.best == self.counts[-1] and busiest.wait > FIRST_TRIAL:
            return _Shape(best=busiest.best, wait=busiest.wait, until_trial=busiest.wait)
        return _Shape(best=busiest.best)

    def _apply(self, count: int, wide: bool) -> None:
        if getattr(self._applied, "setting", None) != (count, wide):
            self._set(count, wide)
            self._applied.setting = (count, wide)

    def record(self, rows: int, count: int, seconds: float) -> None:
        """A pass of `rows` rows took `seconds` with `count` threads (0: untuned, ignored)."""
        if not count:
            return
        shape = self._shapes[rows]
        if count == shape.best:
            if not shape.warm:
                shape.warm = True
                return
            shape.recent.append(seconds)
            typical = shape.median()
            shape.lowest = min(shape.lowest, typical)
            if typical > SLOWED * shape.lowest and shape.until_trial > 1:
                shape.wait, shape.until_trial = FIRST_TRIAL, 1
            return
        # A trial's pass: its fastest, once all are run, against the best count's median.
        shape.trial_left -= 1
        shape.trial_fastest = min(shape.trial_fastest, seconds)
        if shape.trial_left:
            return
        if not shape.recent:  # the best count has no measured pass yet: compare again after two
            shape.until_trial = 2
            return
        if shape.trial_fastest < MARGIN * shape.median():
            shape.best, shape.lowest, shape.wait = count, shape.trial_fastest, FIRST_TRIAL
            shape.recent.clear()
            shape.recent.append(shape.trial_fastest)
        else:  # the best count's pace now is the one to hold later passes against
            shape.lowest, shape.wait = shape.median(), self._next_wait(shape)
        shape.until_trial = shape.wait

    def _next_wait(self, shape: _Shape) -> int:
        """Passes until the next trial after one that lost: twice the last wait, or at once the
        longest where every thread's count won by more than a slowdown that sets off a trial
        (SLOWED) could take back. Fewer threads win only when load slows every thread's passes,
        and that sets off a trial anyway; on an idle machine each lost trial of one thread cost a
        served MoE reply two passes 1.6-1.8x slower (about 3% of 128 tokens)."""
        if shape.best == self.counts[-1] and shape.trial_fastest >= SLOWED * MARGIN * shape.median():
            return LAST_TRIAL
        return min(LAST_TRIAL, shape.wait * 2)


def blas_threads() -> Callable[[int], None]:
    """Sets how many threads the BLAS NumPy uses runs with (process-wide: the decode thread is
    its one caller during a pass). A decode step (a narrow pass) gives BLAS one: its products
    there are attention's small ones, and two pools of spinning threads on two cores (OpenMP's
    kernels, OpenBLAS's) made an idle decode step at 4,096 cached tokens take 446 ms instead of 49."""
    from threadpoolctl import ThreadpoolController

    blas = ThreadpoolController().select(user_api="blas")
    return lambda n: blas.limit(limits=n)
