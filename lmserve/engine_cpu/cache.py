"""The CPU engine's KV cache: float32 keys and values that grow in steps up to a fixed capacity.

Storage is one array per K and V for all layers, `[layer, kv_head, position, head_dim]`: a head's
keys for the first `n` positions are one contiguous run, so attention reads them without a copy,
and growing, copying a prefix or saving the valid part is one slice per array.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lmserve.engine.protocol import CacheFullError
from lmserve.model.config import ModelConfig

GROW_STEP = 256  # positions added per reallocation
_FORMAT = "lmserve-cpu-kv-1"


class CPUCache:
    """One sequence's keys and values; `length` positions are valid."""

    def __init__(self, config: ModelConfig, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.geometry = (config.n_layers, config.n_kv_heads, config.head_dim)
        self._capacity = max_tokens
        self.length = 0
        self.k, self.v = self._empty(0), self._empty(0)

    def _empty(self, positions: int) -> np.ndarray:
        layers, heads, head_dim = self.geometry
        return np.zeros((layers, heads, positions, head_dim), dtype=np.float32)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def allocated(self) -> int:
        """Positions the current arrays can hold."""
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def reserve(self, n: int) -> None:
        """Make room for `n` positions in all, growing by whole steps; refuse past capacity."""
        if n > self._capacity:
            raise CacheFullError(f"KV cache full: {n} positions needed, capacity is {self._capacity}")
        if n <= self.allocated:
            return
        size = min(self._capacity, -(-n // GROW_STEP) * GROW_STEP)
        k, v = self._empty(size), self._empty(size)
        k[:, :, :self.length] = self.k[:, :, :self.length]
        v[:, :, :self.length] = self.v[:, :, :self.length]
        self.k, self.v = k, v

    def truncate(self, n: int) -> None:
        """Keep the first `n` positions (the allocation stays for reuse)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {n}")
        self.length = n

    def copy_prefix_to(self, dst: CPUCache, n: int) -> None:
        """Make `dst` hold exactly this cache's first `n` positions."""
        if dst.geometry != self.geometry:
            raise ValueError("caches belong to different model geometries")
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot copy {n} positions from a cache of {self.length}")
        if dst is self:
            self.truncate(n)
            return
        dst.reserve(n)
        dst.k[:, :, :n] = self.k[:, :, :n]
        dst.v[:, :, :n] = self.v[:, :, :n]
        dst.length = n

    def save(self, path: Path) -> None:
        """Write the valid positions and the geometry they belong to (uncompressed .npz)."""
        with open(path, "wb") as f:
            np.savez(f, format=np.array(_FORMAT), geometry=np.array(self.geometry),
                     k=self.k[:, :, :self.length], v=self.v[:, :, :self.length])

    @classmethod
    def load(cls, config: ModelConfig, path: Path, max_tokens: int) -> CPUCache:
        """Read a cache written by `save`; refuse one from another model geometry."""
        cache = cls(config, max_tokens)
        with np.load(path, allow_pickle=False) as data:
            if "format" not in data or str(data["format"]) != _FORMAT:
                raise ValueError(f"{path} is not a saved CPU KV cache")
            geometry = tuple(int(x) for x in data["geometry"])
            if geometry != cache.geometry:
                raise ValueError(f"{path} holds a KV cache of geometry {geometry} "
                                 f"(layers, KV heads, head size); this model needs {cache.geometry}")
            k, v = data["k"], data["v"]
        n = k.shape[2]
        cache.reserve(n)
        cache.k[:, :, :n] = k
        cache.v[:, :, :n] = v
        cache.length = n
        return cache
