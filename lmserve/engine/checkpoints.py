"""Checkpoints of a hybrid cache's recurrent state: the positions it can be cut back to exactly.

Attention keys and values are cut to any prefix by forgetting positions. A recurrent state (Gated
DeltaNet's, in Qwen3.5 / 3.6) summarizes every position it has seen and cannot be cut, so a hybrid
cache keeps its recurrent state as it was at chosen positions: cutting the cache back to `n`
restores the latest checkpoint at or below `n`, and the engine recomputes the positions from there
to `n` from the token ids the cache remembers. The scheduler places checkpoints (serving/
scheduler.py: the end of every prefill chunk and the prompt's last two positions), the slot pool
adopts prefixes only at checkpoints (`Engine.resume_point`), so that recomputing is left to
speculative decoding's short rollbacks.

A checkpoint costs one full recurrent state whatever the position (`ModelConfig.
recurrent_state_bytes`), so a cache keeps at most `limit`: beyond it the one whose removal leaves
the smallest gap goes (never one of the newest two, the ends of the latest prompt), which keeps
them spread over the whole sequence, denser where new ones keep arriving.

States are snapshots: an engine never changes a checkpointed state in place (each forward pass
makes new state arrays), so copying a cache's checkpoints shares them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Generic, TypeVar

S = TypeVar("S")

PROTECTED = 2  # the newest checkpoints never evicted: the last prompt's last two positions


class Checkpoints(Generic[S]):
    """Recurrent states by position, at most `limit` of them."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a hybrid cache keeps at least one checkpoint, got {limit}")
        self.limit = limit
        self._positions: list[int] = []
        self._states: dict[int, S] = {}

    def __len__(self) -> int:
        return len(self._positions)

    def __iter__(self) -> Iterator[tuple[int, S]]:
        return ((p, self._states[p]) for p in self._positions)

    @property
    def positions(self) -> list[int]:
        return list(self._positions)

    def add(self, position: int, state: S) -> None:
        """Keep `state` as the state after `position` tokens (replacing one kept there)."""
        if position <= 0:
            return  # the empty state needs no copy
        if position not in self._states:
            bisect.insort(self._positions, position)
        self._states[position] = state
        while len(self._positions) > self.limit:
            self._evict()

    def _evict(self) -> None:
        """Drop the evictable checkpoint whose neighbours are closest together."""
        candidates = range(len(self._positions) - PROTECTED) if len(self._positions) > PROTECTED else range(1)
        positions = [0, *self._positions]

        def gap(i: int) -> int:  # the gap removing checkpoint i leaves between its neighbours
            return positions[i + 2] - positions[i]

        victim = min(candidates, key=gap)
        del self._states[self._positions.pop(victim)]

    def latest(self, n: int) -> tuple[int, S | None]:
        """The latest checkpoint at or below `n`: (its position, its state), or (0, None) for the
        empty state when there is none."""
        i = bisect.bisect_right(self._positions, n)
        if not i:
            return 0, None
        position = self._positions[i - 1]
        return position, self._states[position]

    def drop_above(self, n: int) -> None:
        """Forget the checkpoints past `n` (the cache was cut back to `n`)."""
        keep = bisect.bisect_right(self._positions, n)
        for position in self._positions[keep:]:
            del self._states[position]
        del self._positions[keep:]

    def up_to(self, n: int) -> Checkpoints[S]:
        """A copy holding the checkpoints at or below `n` (states shared: they are snapshots)."""
        copy: Checkpoints[S] = Checkpoints(self.limit)
        keep = bisect.bisect_right(self._positions, n)
        copy._positions = self._positions[:keep]
        copy._states = {p: self._states[p] for p in copy._positions}
        return copy
