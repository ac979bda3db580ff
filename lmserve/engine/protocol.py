"""The engine protocol: everything the scheduler, runtime and CLI use of a backend, and nothing more.

Engines know tensors, not HTTP or sampling. Logits cross this boundary as NumPy float32 so that
everything above it (sampling, grammar masks, stop strings) is engine-agnostic. Each engine has one
cache type: `Engine[C]` takes and returns only its own `C` (a cache of another engine is refused).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol, TypeVar, runtime_checkable

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


C = TypeVar("C", bound=KVCache)


class RankShare(NamedTuple):
    """One process of a distributed engine, as the banner shows it and the RAM guard checks it."""

    host: str
    weight_bytes: int
    available: int  # bytes of memory available once its weights loaded


class Engine(Protocol[C]):
    """A model loaded for inference on one device, with its own cache type `C`."""

    config: ModelConfig
    name: str  # "cpu" or "mlx"
    device: str  # human-readable device, e.g. "numpy (2 threads)" or "gpu (Metal)"
    weight_bytes: int  # bytes the resident weights take
    kv_type: str  # what keys and values are cached as: a name of `kv_types.KV_TYPES` (`--kv-type`)
    kv_dtype_bytes: float  # bytes per cached key or value element, block scales included (the RAM guard prices slots with it)
    state_dtype_bytes: int  # bytes per element of a recurrent state (kept unquantized)
    # The part of each cached position this process holds: 1, or a distributed rank's (its KV
    # heads, or its layers; the largest rank's).
    kv_share: float = 1.0
    # The memory the RAM guard sizes KV slots and the default context with: None for this machine's
    # (measured when asked); a distributed group's is its tightest rank's.
    available_memory: int | None = None
    quant_summary: str  # how weights were converted at load, for the banner; "" when none were
    # First-use work done at load so that the first request is as fast as the tenth (compiling
    # kernels), for the banner; "" when there was none.
    prepared: str = ""
    # True when `decode_argmax` saves work over `decode` + a host argmax (it runs on the device and
    # copies only ids back): the scheduler then uses it for batches that need no host logits.
    device_argmax: bool
    # True when a `verify` pass of up to 16 rows costs a few decode steps at most (a GPU, BLAS
    # matrix products); False where every row costs a full step (MLX's CPU backend), and prompt
    # lookup is then off unless asked for.
    cheap_verify: bool = True
    # Hybrid models: recurrent-state checkpoints each cache keeps (`engine/checkpoints.py`); the
    # runtime sets it (--kv-checkpoints) before making caches.
    checkpoints_per_cache: int = 8
    # A distributed engine: its ranks and how the model is split over them; () and "" otherwise.
    ranks: Sequence[RankShare] = ()
    parallelism: str = ""

    # -- lifecycle: the same calls for a single-process engine and a distributed one -------------

    def stopping(self, then: Callable[[], None]) -> None:
        """The server was told to stop; `then` stops the worker. A single process stops it now;
        a distributed engine first lets a step stuck on a lost rank fail, naming the rank."""
        then()

    def on_lost(self, abandon: Callable[[str], None]) -> None:
        """Where a distributed engine reports a lost rank (`abandon` ends the open requests with
        its message); a single process has no ranks to lose."""

    def close(self) -> None:
        """At the server's exit: a distributed engine tells its followers to exit too."""

    def kv_bytes_per_token(self) -> int:
        """Bytes one cached position costs this process (what the RAM guard prices)."""
        return math.ceil(self.config.kv_bytes_per_token(self.kv_dtype_bytes) * self.kv_share)

    def state_bytes(self) -> int:
        """Bytes one copy of a sequence's recurrent state costs this process (0 without recurrent
        layers): a hybrid cache holds its current state and up to `checkpoints_per_cache` more."""
        return math.ceil(self.config.recurrent_state_bytes(self.state_dtype_bytes) * self.kv_share)

    def resume_point(self, cache: C, n: int) -> int:
        """The longest prefix of at most `n` positions that `truncate` and `copy_prefix` reach
        without recomputing any position: `n` where every layer is attention; for a hybrid cache
        the latest checkpoint at or below `n` (0 when none), or `n` itself at the cache's length."""
        return n

    def checkpoint(self, cache: C) -> None:
        """Keep a hybrid cache's recurrent state at its current length, so that it can later be cut
        back there exactly and cheaply (nothing to keep where every layer is attention)."""

    def new_cache(self, capacity: int) -> C:
        """An empty cache for up to `capacity` positions (memory is allocated as it fills)."""
        ...

    def prefill(self, cache: C, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append `token_ids` to the cache; logits of the last position `[vocab]`,
        or of every new position `[len(token_ids), vocab]` when `all_logits`."""
        ...

    def prefill_together(self, caches: Sequence[C], token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Prompts that arrived together: appends each `token_ids[i]` (one or more) to
        `caches[i]` (distinct caches) and returns the logits of each list's last position
        `[batch, vocab]`. Here one prefill after another; an engine that can runs them as one pass
        (shorter lists padded, as `verify` pads them), each weight read once for all of them."""
        return np.stack([self.prefill(cache, ids) for cache, ids in zip(caches, token_ids, strict=True)])

    def embed(self, token_ids: Sequence[int]) -> np.ndarray:
        """The final hidden states of `token_ids` run as one sequence from position 0: every
        position's, after the output norm and before the output head, float32 `[n, hidden]`
        (what an embedding is pooled from, `serving/embeddings.py`). Runs on a temporary cache of
        its own: no cache the server holds is read or changed. Called, as every engine call, from
        the thread that drives the engine (MLX's stream is that thread's). ValueError for no
        tokens or an id outside the vocabulary."""
        ...

    def decode(self, caches: Sequence[C], token_ids: Sequence[int]) -> np.ndarray:
        """One step for several sequences at once (one pass over the weights): appends
        `token_ids[i]` to `caches[i]` and returns logits `[batch, vocab]`."""
        ...

    def decode_argmax(self, caches: Sequence[C], token_ids: Sequence[int]) -> np.ndarray:
        """`decode` followed by a greedy pick: the int64 ids `[batch]` its logits argmax to."""
        ...

    def verify(self, caches: Sequence[C], token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Several tokens per sequence in one pass (speculative decoding checks a draft with it):
        appends each `token_ids[i]` (one or more) to `caches[i]` and returns, per sequence, the
        logits of every new position `[len(token_ids[i]), vocab]`. Shorter lists may be padded
        inside the pass, so every cache needs room for the longest; the caller truncates back
        whatever it rejects. A hybrid cache keeps its recurrent state from before the pass, so
        that cutting back into the pass recomputes only the positions kept."""
        ...

    def truncate(self, cache: C, n: int) -> None:
        """Keep only the first `n` positions. A hybrid cache restores its latest checkpoint at or
        below `n` and recomputes the positions after it (`resume_point` says how far that is)."""
        ...

    def copy_prefix(self, src: C, dst: C, n: int) -> None:
        """Make `dst` hold exactly the first `n` positions of `src` (positions kept; a hybrid
        cache's checkpoints up to `n` too, and the positions past `resume_point(src, n)` are
        recomputed)."""
        ...

    def save_cache(self, cache: C, path: Path) -> None:
        """Write the cache's valid positions to exactly `path` (whatever its suffix); a hybrid
        cache's recurrent state, checkpoints and token ids with them."""
        ...

    def load_cache(self, path: Path, capacity: int) -> C:
        """Read a cache written by `save_cache` of this model on this engine; ValueError for a
        file of another model or engine, or one holding more than `capacity` positions."""
        ...


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """`token_ids` as a flat int64 array; ValueError when one is outside the vocabulary."""
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token id out of range 0..{vocab_size - 1}")
    return ids


def verify_rows(caches: Sequence[KVCache], token_ids: Sequence[Sequence[int]],
                vocab_size: int, what: str = "verify") -> tuple[list[int], np.ndarray]:
    """`verify`'s (or `prefill_together`'s) arguments checked (distinct caches, one list of one or
    more ids each) and padded to the longest with each list's own last token: (the lists'
    lengths, int64 ids `[batch, width]`)."""
    lists = [check_token_ids(ids, vocab_size) for ids in token_ids]
    if not lists or len(caches) != len(lists) or len({id(c) for c in caches}) != len(caches) or not all(map(len, lists)):
        raise ValueError(f"{what} needs distinct caches, each with one or more tokens")
    width = max(map(len, lists))
    return [len(ids) for ids in lists], np.stack([np.pad(ids, (0, width - len(ids)), mode="edge") for ids in lists])
