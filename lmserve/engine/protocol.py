"""The engine protocol: what the scheduler needs from a backend, and nothing more.

Engines know tensors, not HTTP or sampling. Logits cross this boundary as NumPy float32 so that
everything above it (sampling, grammar masks, stop strings) is engine-agnostic.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from lmserve.model.config import ModelConfig


class CacheFullError(ValueError):
    """Appending would pass a cache's `max_tokens` (raised by every engine)."""


@runtime_checkable
class KVCache(Protocol):
    """One sequence's cached keys and values. Grows in steps; `length` positions are valid."""

    @property
    def length(self) -> int: ...

    @property
    def capacity(self) -> int:
        """The most positions this cache may ever hold (its `max_tokens`)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes currently allocated for this cache."""
        ...


class Engine(Protocol):
    """A model loaded for inference on one device."""

    config: ModelConfig
    name: str  # "cpu" or "mlx"
    device: str  # human-readable device, e.g. "numpy (2 threads)" or "gpu (Metal)"
    weight_bytes: int  # bytes the resident weights take

    def new_cache(self, max_tokens: int) -> KVCache:
        """An empty cache for up to `max_tokens` positions (memory is allocated as it fills)."""
        ...

    def prefill(self, cache: KVCache, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append `token_ids` to the cache; logits of the last position `[vocab]`,
        or of every new position `[len(token_ids), vocab]` when `all_logits`."""
        ...

    def decode(self, caches: Sequence[KVCache], token_ids: Sequence[int]) -> np.ndarray:
        """One step for several sequences at once (one pass over the weights): appends
        `token_ids[i]` to `caches[i]` and returns logits `[batch, vocab]`."""
        ...

    def truncate(self, cache: KVCache, n: int) -> None:
        """Keep only the first `n` positions."""
        ...

    def copy_prefix(self, src: KVCache, dst: KVCache, n: int) -> None:
        """Make `dst` hold exactly the first `n` positions of `src` (positions kept)."""
        ...

    def save_cache(self, cache: KVCache, path: Path) -> None:
        """Write the cache's valid positions to `path`."""
        ...

    def load_cache(self, path: Path, max_tokens: int) -> KVCache:
        """Read a cache written by `save_cache`."""
        ...
