"""The rows of one forward pass and the caches they extend.

A pass stacks the hidden states of every row it advances, so each weight matrix is read once:
all new tokens of one cache (prefill), one token of each of several caches (decode), or the same
number of tokens of each (a verify pass, whose shorter lists are padded to the longest). Only the
mixers (attention, the recurrence) run per cache, over that cache's own rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lmserve.engine_cpu.cache import CPUCache
from lmserve.engine_cpu.ops import Scratch


@dataclass(frozen=True)
class Span:
    """One cache's rows in a pass: `lo:hi`, at positions `start` on; the first `real` are kept
    (the rest pad a verify pass: their keys are written past the cache's length and forgotten,
    and they must not reach a recurrent state)."""

    cache: CPUCache
    start: int
    lo: int
    hi: int
    real: int


class Batch:
    """`width` rows for each cache, in cache order; `real[i]` of cache i's are kept (all of them
    when not given). Room for the rows is reserved already. `scratch`: the buffer the layers
    write their attention scores into, one after another (the engine's, kept between passes)."""

    def __init__(self, caches: list[CPUCache], width: int, real: list[int] | None, scratch: Scratch) -> None:
        real = real or [width] * len(caches)
        self.width = width
        self.spans = [Span(c, c.length, i * width, (i + 1) * width, n)
                      for i, (c, n) in enumerate(zip(caches, real, strict=True))]
        self.positions = np.concatenate([np.arange(s.start, s.start + width) for s in self.spans])
        self.scratch = scratch

    def finish(self, ids: np.ndarray) -> None:
        """Advance every cache past its kept rows, remembering their token ids."""
        for s in self.spans:
            s.cache.tokens[s.start:s.start + s.real] = ids[s.lo:s.lo + s.real]
            s.cache.length = s.start + s.real
