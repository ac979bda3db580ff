"""Deadlines on collectives. The ring raises on a closed socket but not always: measured with
MLX 0.32 on loopback, a collective whose peer was killed after sending its share can wait forever.
So every rank runs a `Watchdog` with a deadline per lockstep call (and a follower one per wait for
rank 0, which sends a no-op command every `HEARTBEAT_S` while idle); past it, the rank leaves the
group (`GroupEnd`)."""

from __future__ import annotations

import threading
import time

from lmserve.engine_mlx.distributed.group import GroupEnd
from lmserve.engine_mlx.distributed.wire import Op

HEARTBEAT_S = 1.0  # an idle rank 0 sends a no-op this often
WAIT_S = 5 * HEARTBEAT_S  # a follower hearing nothing from rank 0 this long gives up
# The most one lockstep call may take: STEP_S, plus per word of its command (about a token)
# SLACK times the slowest pace seen so far for calls of its op (FIRST_PACE_S before one has ended).
# Paces are kept per op: a prompt's word (a prefilled token) costs far more than a decode step's
# (a cache handle), and a PREFILL bounded by DECODE's pace was taken for a lost rank under load.
STEP_S = 10.0
SLACK = 4.0
FIRST_PACE_S = 1.0


class Watchdog:
    """Leaves the group (`end`) when a collective outlives its deadline: the ring may never
    return from one whose peer died."""

    def __init__(self, end: GroupEnd) -> None:
        self._end = end
        self._deadline: float | None = None
        self._what = ""
        self._cap: tuple[float, str] | None = None  # the most any collective may take from now on
        threading.Thread(target=self._watch, name="lmserve-distributed-watchdog", daemon=True).start()

    def arm(self, seconds: float, what: str) -> None:
        """Expect the current collective to end within `seconds`; `what` says what else happened."""
        if self._cap is not None and seconds > self._cap[0]:
            seconds, what = self._cap
        self._what, self._deadline = what, time.monotonic() + seconds

    def hurry(self, seconds: float, what: str) -> None:
        """Bring an armed deadline, and every later one, within `seconds` (a stop signal came:
        whatever the ranks still do, shutting down included, ends soon)."""
        self._cap = (seconds, what)
        deadline = self._deadline
        if deadline is not None and deadline > time.monotonic() + seconds:
            self.arm(seconds, what)

    def disarm(self) -> None:
        self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._end(self._what)


class Pace:
    """How long a lockstep call may take, from how long earlier calls of the same op took per
    command word: a slow machine (a large model, MLX's CPU backend, a busy core) gets longer, a
    fast one gives up sooner."""

    def __init__(self) -> None:
        self.per_word: dict[Op, float] = {}
        self._op = Op.NOOP
        self._start = 0.0
        self._words = 1

    def bound(self, op: Op, n_words: int) -> float:
        return STEP_S + SLACK * self.per_word.get(op, FIRST_PACE_S) * n_words

    def start(self, watchdog: Watchdog, op: Op, n_words: int) -> None:
        bound = self.bound(op, n_words)
        watchdog.arm(bound, f"no answer within {bound:.0f} s of {op.name}")
        self._op, self._start, self._words = op, time.monotonic(), max(1, n_words)

    def end(self, watchdog: Watchdog) -> None:
        watchdog.disarm()
        pace = (time.monotonic() - self._start) / self._words
        self.per_word[self._op] = max(self.per_word.get(self._op, 0.0), pace)
