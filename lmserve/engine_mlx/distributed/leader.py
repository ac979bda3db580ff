"""Rank 0's side of lockstep: an Engine whose every call is broadcast to the followers first."""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from lmserve.engine.protocol import Engine, RankShare
from lmserve.engine_mlx.distributed.group import GroupEnd
from lmserve.engine_mlx.distributed.sharded import ShardedMLXEngine
from lmserve.engine_mlx.distributed.watchdog import HEARTBEAT_S, WAIT_S, Pace, Watchdog
from lmserve.engine_mlx.distributed.wire import Op, broadcast, words_of
from lmserve.engine_mlx.kv import MLXKVCache

T = TypeVar("T")
STOP_S = 2.0  # after a stop signal, a call waiting longer on the other ranks is a lost rank (1 s: a busy runner's slow rank)
STOP_GRACE_S = 0.5  # and the steps go on this much longer, for the watchdog to name it first


class LockstepEngine(Engine[MLXKVCache]):
    """Rank 0's engine: each call is broadcast to the followers, then made on the local shard.

    Caches are the local engine's, tagged with an integer handle the followers know them by; a
    cache rank 0 drops is freed on the followers with the next command."""

    def __init__(self, inner: ShardedMLXEngine, ranks: list[RankShare], end: GroupEnd) -> None:
        self.inner = inner
        self._end = end
        self.group = inner.group
        self.world = self.group.size()
        self.config = inner.config
        self.name = inner.name
        self.parallelism = inner.parallelism
        self.device = f"{inner.device}, {inner.parallelism} over {self.world} ranks"
        self.kv_share = inner.kv_share
        self.weight_bytes = inner.weight_bytes
        self.kv_type, self.kv_dtype_bytes = inner.kv_type, inner.kv_dtype_bytes
        self.state_dtype_bytes = inner.state_dtype_bytes
        self.quant_summary = inner.quant_summary
        self.device_argmax = inner.device_argmax
        self.cheap_verify = inner.cheap_verify
        self.ranks: Sequence[RankShare] = ranks
        self.available_memory = min(rank.available for rank in ranks)  # slots must fit on every rank
        self._lock = threading.Lock()
        self._next = 1
        self._freed: collections.deque[int] = collections.deque()
        self._last = time.monotonic()
        self._closed = False
        self._watchdog = Watchdog(end)
        self._pace = Pace()
        threading.Thread(target=self._heartbeat, name="lmserve-distributed-heartbeat", daemon=True).start()

    # -- lockstep ---------------------------------------------------------------------------

    def _call(self, op: Op, args: Sequence[int], fn: Callable[[], T]) -> T:
        with self._lock:
            self._send(op, args)
            self._pace.start(self._watchdog, op, len(args))
            try:
                return fn()
            except RuntimeError as exc:  # a collective inside the step failed: the group is broken
                self._end(exc)
            finally:
                self._pace.end(self._watchdog)

    def _send(self, op: Op, args: Sequence[int]) -> None:
        self._watchdog.arm(WAIT_S, f"no answer within {WAIT_S:.0f} s of sending {op.name}")
        try:
            while self._freed:
                broadcast(self.group, [Op.FREE, self._freed.popleft()])
            broadcast(self.group, [op, *args])
        except RuntimeError as exc:
            self._end(exc)
        self._watchdog.disarm()
        self._last = time.monotonic()

    def _heartbeat(self) -> None:
        while not self._closed:
            time.sleep(HEARTBEAT_S / 4)
            if time.monotonic() - self._last >= HEARTBEAT_S and self._lock.acquire(blocking=False):
                try:
                    if not self._closed:
                        self._send(Op.NOOP, [])
                finally:
                    self._lock.release()

    def stopping(self, then: Callable[[], None]) -> None:
        """The server was told to stop (mlx.launch sends that to every rank when one exits): a
        call, now or later, still waiting on the other ranks STOP_S after it began is taken for a
        lost rank, within uvicorn's graceful shutdown (3 s), so open streams get the in-band error.
        `then` (stopping the worker) runs only STOP_GRACE_S after that: a worker stopped at once,
        between two steps, would end the streams as a plain shutdown, naming no lost rank."""
        self._watchdog.hurry(STOP_S, f"still waiting on the other ranks {STOP_S:.0f} s after the stop signal")
        threading.Timer(STOP_S + STOP_GRACE_S, then).start()

    def on_lost(self, abandon: Callable[[str], None]) -> None:
        self._end.farewells.append(abandon)

    def close(self) -> None:
        """Tell the followers to exit (at rank 0's exit)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._send(Op.STOP, [])

    def _tag(self, cache: MLXKVCache) -> MLXKVCache:
        handle, self._next = self._next, self._next + 1
        cache.handle = handle  # type: ignore[attr-defined]
        weakref.finalize(cache, self._freed.append, handle)
        return cache

    @staticmethod
    def _handles(caches: Sequence[MLXKVCache]) -> list[int]:
        return [c.handle for c in caches]  # type: ignore[attr-defined]

    # -- the engine protocol -----------------------------------------------------------------

    @property
    def checkpoints_per_cache(self) -> int:  # type: ignore[override]
        return self.inner.checkpoints_per_cache

    @checkpoints_per_cache.setter
    def checkpoints_per_cache(self, limit: int) -> None:
        self.inner.checkpoints_per_cache = limit  # the followers get it with each new cache

    def new_cache(self, capacity: int) -> MLXKVCache:
        with self._lock:
            handle = self._next
            self._send(Op.NEW_CACHE, [handle, capacity, self.checkpoints_per_cache])
            return self._tag(self.inner.new_cache(capacity))

    def resume_point(self, cache: MLXKVCache, n: int) -> int:
        return self.inner.resume_point(cache, n)  # bookkeeping every rank holds alike: no call

    def checkpoint(self, cache: MLXKVCache) -> None:
        self._call(Op.CHECKPOINT, [cache.handle], lambda: self.inner.checkpoint(cache))  # type: ignore[attr-defined]

    def prefill(self, cache: MLXKVCache, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        return self._call(Op.PREFILL, [cache.handle, int(all_logits), *token_ids],  # type: ignore[attr-defined]
                          lambda: self.inner.prefill(cache, token_ids, all_logits))

    def embed(self, token_ids: Sequence[int]) -> np.ndarray:
        """Every rank runs the pass on a temporary cache of its own (a tensor-parallel pass sums
        its shares inside each layer, a pipeline's last rank gathers the final state to every
        rank): rank 0's hidden states are the whole model's."""
        ids = [int(t) for t in token_ids]
        return self._call(Op.EMBED, ids, lambda: self.inner.embed(ids))

    def decode(self, caches: Sequence[MLXKVCache], token_ids: Sequence[int]) -> np.ndarray:
        return self._call(Op.DECODE, [len(caches), *self._handles(caches), *token_ids],
                          lambda: self.inner.decode(caches, token_ids))

    def decode_argmax(self, caches: Sequence[MLXKVCache], token_ids: Sequence[int]) -> np.ndarray:
        return self._call(Op.DECODE_ARGMAX, [len(caches), *self._handles(caches), *token_ids],
                          lambda: self.inner.decode_argmax(caches, token_ids))

    def verify(self, caches: Sequence[MLXKVCache], token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        lists = [list(ids) for ids in token_ids]
        args = [len(caches), *self._handles(caches), *map(len, lists), *(t for ids in lists for t in ids)]
        return self._call(Op.VERIFY, args, lambda: self.inner.verify(caches, lists))

    def truncate(self, cache: MLXKVCache, n: int) -> None:
        self._call(Op.TRUNCATE, [cache.handle, n], lambda: self.inner.truncate(cache, n))  # type: ignore[attr-defined]

    def copy_prefix(self, src: MLXKVCache, dst: MLXKVCache, n: int) -> None:
        self._call(Op.COPY_PREFIX, [*self._handles([src, dst]), n], lambda: self.inner.copy_prefix(src, dst, n))

    def save_cache(self, cache: MLXKVCache, path: Path) -> None:
        self._call(Op.SAVE_CACHE, [cache.handle, *words_of(str(path))],  # type: ignore[attr-defined]
                   lambda: self.inner.save_cache(cache, path))

    def load_cache(self, path: Path, capacity: int) -> MLXKVCache:
        with self._lock:
            handle = self._next
            self._send(Op.LOAD_CACHE, [handle, capacity, self.checkpoints_per_cache, *words_of(str(path))])
            return self._tag(self.inner.load_cache(path, capacity))
