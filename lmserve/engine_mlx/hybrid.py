"""The recurrent side of a hybrid cache (Qwen3.5's Gated DeltaNet layers) on MLX.

A recurrent layer caches mlx-lm's `ArraysCache(size=2)`: its convolution window and its delta-rule
state, replaced by new arrays on every forward pass (never changed in place). So a state is kept
by keeping references to those arrays: a checkpoint, or the state from before a verify pass, costs
nothing to take (the memory the arrays hold stays held; `Recurrence.nbytes` counts it once).

Going back to a position the layers have left is `restore` of a kept state, then the positions
from there recomputed from the token ids the cache remembers (`Recurrence.tokens`), through the
whole network (the recurrent layers' inputs depend on every layer below them); attention K/V of
those positions are cut first and written again. What to go back to is `Recurrence.resume`: the
latest checkpoint at or below the target (`engine/checkpoints.py`), or the state kept from before
the last verify pass when that is later, so that a rejected draft recomputes only the kept tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from lmserve.engine.checkpoints import Checkpoints

# One sequence's recurrent state: per recurrent layer (in layer order), its ArraysCache entries.
State = tuple[tuple[mx.array | None, ...], ...]


def recurrent(layers: Iterable[object]) -> list[ArraysCache]:
    return [layer for layer in layers if isinstance(layer, ArraysCache)]


def snapshot(layers: Sequence[object], row: int | None = None) -> State:
    """The current state of these layers (one sequence's, or row `row` of merged ones)."""
    if row is None:
        return tuple(tuple(layer.cache) for layer in recurrent(layers))
    return tuple(tuple(None if a is None else a[row:row + 1] for a in layer.cache) for layer in recurrent(layers))


def restore(layers: Sequence[object], state: State | None) -> None:
    """Put `state` back into these layers (None: the empty state, before any position)."""
    for i, layer in enumerate(recurrent(layers)):
        layer.cache = list(state[i]) if state is not None else [None] * len(layer.cache)


def flatten(state: State) -> list[mx.array | None]:
    """One list of a state's entries (how a saved cache holds a checkpoint)."""
    return [a for entries in state for a in entries]


def unflatten(flat: Sequence[mx.array | None], layers: Sequence[object]) -> State:
    """`flatten`'s list back in per-layer entries, shaped as these layers' states."""
    widths = [len(layer.cache) for layer in recurrent(layers)]
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return tuple(tuple(flat[start:start + width]) for start, width in zip(starts, widths, strict=True))


class Recurrence:
    """What a hybrid cache remembers beside its layers: the token ids it holds, checkpoints of its
    recurrent state, and the state kept from before the last verify pass."""

    def __init__(self, limit: int) -> None:
        self.tokens: list[int] = []
        self.checkpoints: Checkpoints[State] = Checkpoints(limit)
        self.kept: tuple[int, State] | None = None

    def resume(self, n: int) -> tuple[int, State | None]:
        """The latest kept state at or below `n`: (its position, the state; None: empty at 0)."""
        best = self.checkpoints.latest(n)
        if self.kept is not None and best[0] < self.kept[0] <= n:
            return self.kept
        return best

    def cut(self, n: int) -> None:
        """Forget what lies past position `n` (the cache is being cut back to it)."""
        del self.tokens[n:]
        self.checkpoints.drop_above(n)
        if self.kept is not None and self.kept[0] > n:
            self.kept = None

    def prefix(self, n: int, limit: int) -> Recurrence:
        """A copy for the first `n` positions (states shared: they are never changed in place)."""
        copy = Recurrence(limit)
        copy.tokens = self.tokens[:n]
        for position, state in self.checkpoints.up_to(n):
            copy.checkpoints.add(position, state)
        if self.kept is not None and self.kept[0] <= n:
            copy.kept = self.kept
        return copy

    def nbytes(self, current: State) -> int:
        """Bytes of the current state and every kept one, each array once (a checkpoint taken
        with nothing computed since shares the current state's arrays)."""
        states = [current, *(s for _, s in self.checkpoints), *([self.kept[1]] if self.kept else [])]
        unique = {id(a): a for state in states for a in flatten(state) if a is not None}
        return sum(a.nbytes for a in unique.values())
