"""KV caches as MLX arrays, built on mlx-lm's own cache classes.

A sequence on its own holds one `mlx_lm` `KVCache` per layer (preallocated in steps of 256
positions). Sequences decoded together are merged into one left-padded `BatchKVCache` per layer
(what mlx-lm's BatchGenerator does): the batch persists across steps while its membership holds,
so a steady batch copies nothing; a sequence that leaves it takes its row back, and the others
stay merged. Per-row lengths differ: the batch cache's mask hides each row's padding and its
per-row offsets drive RoPE. A row truncated while merged (a verify pass's rejected drafts) stays
merged: the positions every row drops are trimmed, the rest of a row's are rolled into its left
padding before the batch is next used.

A hybrid model's recurrent layers (Qwen3.5) cache mlx-lm's `ArraysCache`, merged, extracted and
filtered beside the attention layers (`ArraysCache.merge` / `extract` / `filter`); a row's state is
its own, so rows at different positions need no mask there. Their state cannot be trimmed: a row's
drop trims only its attention layers (what a verify pass drops is padding its recurrent layers were
masked from), and cutting a hybrid row back takes it out of the batch first (engine.py,
hybrid.py). The sequence's token ids, checkpoints and kept state are its `hybrid` record.

With `--kv-type q8_0 / q4_0` an attention layer's rows are packed quantized (kv_quant.py): the
same classes hold them, quantizing what a step appends and unpacking what attention reads.

A sliding-window layer (Gemma 3 and 4, gpt-oss) keeps every position too, not only its window as
mlx-lm's `RotatingKVCache` does, so that a cache can be truncated or copied to any prefix for KV
reuse; but it hands attention only the positions some query of the step can see (the window, plus
the step's own), with a mask in those coordinates: attention costs what the window costs, however
long the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from lmserve.engine.protocol import CacheFullError
from lmserve.engine_mlx.hybrid import Recurrence, snapshot
from lmserve.engine_mlx.kv_quant import Packing, Quantized, QuantizedBatchKVCache, QuantizedKVCache

Layer = KVCache | ArraysCache  # one layer of one sequence
MergedLayer = BatchKVCache | ArraysCache  # one layer of several


def layer_arrays(layers: Sequence[Layer | MergedLayer]) -> list[mx.array]:
    """The arrays these layer caches hold (what evaluating a cache evaluates)."""
    out = []
    for layer in layers:
        out += [a for a in (layer.cache if isinstance(layer, ArraysCache) else (layer.keys, layer.values))
                if a is not None]
    return out


class WindowKVCache(KVCache):
    """A sliding layer's cache: every position kept, the last `window` (and the step's) attended."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k, v = super().update_and_fetch(keys, values)
        seen = self.window + keys.shape[2] - 1
        return (k[..., -seen:, :], v[..., -seen:, :]) if k.shape[2] > seen else (k, v)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False) -> mx.array | None:
        if N == 1 and self.offset >= self.window - 1:
            return None  # exactly the window is fetched
        return create_causal_mask(N, min(self.offset, self.window - 1), window_size=self.window)


class BatchWindowKVCache(BatchKVCache):
    """`WindowKVCache` for merged rows: the fetched columns start where the window of the step's
    first query does; the left padding moves with them."""

    window = 0

    def _first(self) -> int:
        """The first column a step's queries can see: its first query's window starts there."""
        return max(0, self._idx - self.window + 1)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: object) -> mx.array:
        start = self._first()
        return create_causal_mask(N, offset=self._idx - start, window_size=self.window,
                                  left_padding=self.left_padding - start)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start = self._first()
        k, v = super().update_and_fetch(keys, values)
        return (k[..., start:, :], v[..., start:, :]) if start else (k, v)

    def extract(self, idx: int) -> KVCache:
        row = super().extract(idx)
        layer = WindowKVCache(self.window)
        layer.keys, layer.values, layer.offset = row.keys, row.values, row.offset
        return layer


class QuantizedWindowKVCache(Quantized, WindowKVCache):
    def __init__(self, window: int, packing: Packing) -> None:
        super().__init__(window)
        self.packing = packing


class QuantizedBatchWindowKVCache(Quantized, BatchWindowKVCache):
    def extract(self, idx: int) -> KVCache:
        row = super().extract(idx)
        layer = QuantizedWindowKVCache(self.window, self.packing)
        layer.keys, layer.values, layer.offset = row.keys, row.values, row.offset
        return layer


def merged(layers: Sequence[Layer]) -> MergedLayer:
    """One layer of several sequences as one batch cache, windowed and quantized when the layer is
    (merge makes a plain BatchKVCache of the rows as stored: packed ones stay packed)."""
    first = layers[0]
    if isinstance(first, ArraysCache):
        return ArraysCache.merge(layers)
    batch = BatchKVCache.merge(layers)
    quantized = isinstance(first, Quantized)
    if isinstance(first, WindowKVCache):
        batch.__class__ = QuantizedBatchWindowKVCache if quantized else BatchWindowKVCache
        batch.window = first.window
    elif quantized:
        batch.__class__ = QuantizedBatchKVCache
    if quantized:
        batch.packing = first.packing
    return batch


class MLXKVCache:
    """One sequence's keys and values on the device. `windows`: per layer, the positions a
    sliding layer attends (0: all); `recurrent`: per layer, whether it is a recurrent layer (then
    the cache is hybrid and keeps up to `checkpoints` recurrent-state checkpoints); `packing`:
    how attention layers quantize their keys and values (None: as computed)."""

    def __init__(self, n_layers: int, max_tokens: int, windows: Sequence[int] = (),
                 recurrent: Sequence[bool] = (), checkpoints: int = 1, packing: Packing | None = None) -> None:
        self.packing = packing
        self.windows = tuple(windows) or (0,) * n_layers
        self.recurrent = tuple(recurrent) or (False,) * n_layers
        self.layers: list[Layer] = [self.empty_layer(i) for i in range(n_layers)]
        self.batch: Batch | None = None  # while set, `layers` is stale and the batch holds the row
        self.hybrid = Recurrence(checkpoints) if any(self.recurrent) else None
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
            shared = self.batch.nbytes // len(self.batch.members)
            return shared + (self.hybrid.nbytes(()) if self.hybrid is not None else 0)
        kv = sum(layer.nbytes for layer in self.layers if not isinstance(layer, ArraysCache))
        return kv + (self.hybrid.nbytes(snapshot(self.layers)) if self.hybrid is not None else 0)

    def empty_layer(self, i: int) -> Layer:
        if self.recurrent[i]:
            return ArraysCache(size=2)
        window, packing = self.windows[i], self.packing
        if packing is not None:
            return QuantizedWindowKVCache(window, packing) if window else QuantizedKVCache(packing)
        return WindowKVCache(window) if window else KVCache()

    def own(self) -> list[Layer]:
        """This sequence's own per-layer caches, taking its row back from a batch if needed."""
        if self.batch is not None:
            self.batch.release([self])
        return self.layers

    def reserve(self, n: int) -> None:
        if self.n + n > self._capacity:
            raise CacheFullError(f"KV cache full: {self.n} + {n} positions exceed its {self._capacity}")

    def appended(self, token_ids: Sequence[int]) -> None:
        """Count positions the layers took (a hybrid cache remembers their ids)."""
        self.n += len(token_ids)
        if self.hybrid is not None:
            self.hybrid.tokens.extend(int(t) for t in token_ids)


class Batch:
    """Several sequences' caches merged, one `BatchKVCache` (or `ArraysCache`) per layer, rows in
    `members` order."""

    def __init__(self, members: Sequence[MLXKVCache]) -> None:
        for cache in members:
            cache.own()
        self.members = list(members)
        self._layers = [merged([m.layers[i] for m in members]) for i in range(len(members[0].layers))]
        self._drops = [0] * len(self.members)  # per row: trailing positions to drop before next use
        for cache in members:
            cache.layers = []
            cache.batch = self

    @property
    def layers(self) -> list[MergedLayer]:
        """The merged per-layer caches, with every drop asked for applied."""
        if any(self._drops):
            self._apply_drops()
        return self._layers

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self._layers)  # no drops applied: metrics read it from any thread

    def drop(self, cache: MLXKVCache, n: int) -> None:
        """Forget member `cache`'s last `n` positions (applied lazily, all rows at once)."""
        self._drops[next(i for i, m in enumerate(self.members) if m is cache)] += n

    def _apply_drops(self) -> None:
        """What every row drops is trimmed; the rest of a row's drop is rolled into its left
        padding (mlx-lm's right-padding `finalize`), and padding all rows share is cut off."""
        drops, self._drops = self._drops, [0] * len(self.members)
        common = min(drops)
        rest = [d - common for d in drops]
        for layer in self._layers:
            if isinstance(layer, ArraysCache):  # dropped positions never reached its state (verify's mask)
                continue
            layer.trim(common)
            if layer.keys is None or not any(rest):
                continue
            layer.prepare(right_padding=rest)
            layer.finalize()
            shared = min(layer.left_padding.tolist())
            if shared:  # as BatchKVCache.filter shifts, without its gather
                layer.keys, layer.values = layer.keys[..., shared:, :], layer.values[..., shared:, :]
                layer._idx -= shared
                layer.left_padding -= shared

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
            self._drops = [0] * len(self.members)

    def release(self, caches: Sequence[MLXKVCache]) -> None:
        """Give these members their rows back as their own caches; the rest stay merged."""
        if not caches:
            return
        layers = self.layers
        rows = [i for i, m in enumerate(self.members) if any(m is c for c in caches)]
        for i in rows:
            cache = self.members[i]
            cache.layers = [layer.extract(i) if not layer.empty() else cache.empty_layer(j)
                            for j, layer in enumerate(layers)]
            cache.batch = None
        mx.eval(layer_arrays([layer for c in caches for layer in c.layers]))
        kept = [i for i in range(len(self.members)) if i not in rows]
        self.members = [self.members[i] for i in kept]
        self._drops = [0] * len(self.members)
        if kept:
            index = mx.array(kept)
            for layer in layers:
                layer.filter(index)
        else:
            self._layers = []
