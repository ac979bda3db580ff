"""KV caches as MLX arrays, built on mlx-lm's own cache classes.

A sequence on its own holds one `mlx_lm` `KVCache` per layer (preallocated in steps of 256
positions). Sequences decoded together are merged into one left-padded `BatchKVCache` per layer
(what mlx-lm's BatchGenerator does): the batch persists across steps while its membership holds,
so a steady batch copies nothing; a sequence that leaves it takes its row back, and the others
stay merged. Per-row lengths differ: the batch cache's mask hides each row's padding and its
per-row offsets drive RoPE.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from lmserve.engine.protocol import CacheFullError


class MLXKVCache:
    """One sequence's keys and values on the device."""

    def __init__(self, n_layers: int, max_tokens: int) -> None:
        self.layers: list[KVCache] = [KVCache() for _ in range(n_layers)]
        self.batch: Batch | None = None  # while set, `layers` is stale and the batch holds the row
        self.n = 0
        self._capacity = max_tokens

    @property
    def length(self) -> int:
        return self.n

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def nbytes(self) -> int:
        if self.batch is not None:
            return self.batch.nbytes // len(self.batch.members)
        return sum(layer.nbytes for layer in self.layers)

    def own(self) -> list[KVCache]:
        """This sequence's own per-layer caches, taking its row back from a batch if needed."""
        if self.batch is not None:
            self.batch.release([self])
        return self.layers

    def reserve(self, n: int) -> None:
        if self.n + n > self._capacity:
            raise CacheFullError(f"KV cache full: {self.n} + {n} positions exceed its {self._capacity}")


class Batch:
    """Several sequences' caches merged, one `BatchKVCache` per layer, rows in `members` order."""

    def __init__(self, members: Sequence[MLXKVCache]) -> None:
        for cache in members:
            cache.own()
        self.members = list(members)
        self.layers = [BatchKVCache.merge([m.layers[i] for m in members]) for i in range(len(members[0].layers))]
        for cache in members:
            cache.layers = []
            cache.batch = self

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @classmethod
    def of(cls, caches: Sequence[MLXKVCache]) -> Batch:
        """A batch holding exactly `caches`, in order: the current one when they all share it."""
        batch = caches[0].batch
        if batch is None or any(c.batch is not batch for c in caches):
            return cls(caches)
        batch.keep(caches)
        return batch

    def keep(self, caches: Sequence[MLXKVCache]) -> None:
        """Release every other member and reorder rows to `caches`."""
        self.release([m for m in self.members if all(m is not c for c in caches)])
        rows = [next(i for i, m in enumerate(self.members) if m is c) for c in caches]
        if rows != list(range(len(self.members))):
            index = mx.array(rows)
            for layer in self.layers:
                layer.filter(index)
            self.members = list(caches)

    def release(self, caches: Sequence[MLXKVCache]) -> None:
        """Give these members their rows back as their own caches; the rest stay merged."""
        if not caches:
            return
        rows = [i for i, m in enumerate(self.members) if any(m is c for c in caches)]
        for i in rows:
            cache = self.members[i]
            cache.layers = [layer.extract(i) if layer.keys is not None else KVCache() for layer in self.layers]
            cache.batch = None
        mx.eval([(layer.keys, layer.values) for c in caches for layer in c.layers if layer.keys is not None])
        kept = [i for i in range(len(self.members)) if i not in rows]
        self.members = [self.members[i] for i in kept]
        if kept:
            index = mx.array(kept)
            for layer in self.layers:
                layer.filter(index)
        else:
            self.layers = []
