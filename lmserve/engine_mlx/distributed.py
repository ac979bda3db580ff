"""`--distributed`: one model sharded across the ranks `mlx.launch` starts.

Every rank reads the GGUF and keeps only its share: tensor parallel, mlx-lm's `Model.shard(group)`
(attention heads and FFN columns split, embeddings and norms replicated; the sharded layers'
`all_sum` is MLX's ring backend, no transport of ours), or pipeline parallel, a run of whole
layers per rank (pipeline.py). Rank 0 serves HTTP, the scheduler and the KV slot pool over a
`LockstepEngine`: before each engine call it broadcasts a small command (op code, cache handles and
token ids as int32) to the other ranks, whose `follow` loop makes the same call on its own engine,
caches kept by handle. Every rank thus runs the same collectives in the same order.

A lost rank ends the group within seconds, with one line from each survivor. The ring raises on
a closed socket ("connection to a peer was lost") but not always: measured with MLX 0.32 on
loopback, a collective whose peer was killed after sending its share can wait forever. So every
rank runs a `Watchdog` with a deadline per lockstep call (and a follower one per wait for rank 0,
which sends a no-op command every `HEARTBEAT_S` while idle); past it, the rank gives up.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import enum
import functools
import importlib
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import psutil

from lmserve.engine.protocol import Engine, RankShare
from lmserve.engine_mlx import pipeline
from lmserve.engine_mlx.engine import MLXEngine, Progress
from lmserve.engine_mlx.kv import MLXKVCache
from lmserve.engine_mlx.model import FAMILIES, family_of, text_model
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile, ModelLoadError, TensorInfo

T = TypeVar("T")
HEARTBEAT_S = 1.0  # an idle rank 0 sends a no-op this often
WAIT_S = 5 * HEARTBEAT_S  # a follower hearing nothing from rank 0 this long gives up
# The most one lockstep call may take: STEP_S, plus per word of its command (about a token)
# SLACK times the slowest pace seen so far (FIRST_PACE_S before any call has ended).
STEP_S = 10.0
SLACK = 4.0
FIRST_PACE_S = 1.0
STOP_S = 1.0  # after a stop signal, a call waiting longer on the other ranks is a lost rank
STOP_GRACE_S = 0.5  # and the steps go on this much longer, for the watchdog to name it first
FAREWELL_S = 0.5  # what the server has to send in-band errors on its open streams before exiting


class Op(enum.IntEnum):
    NOOP = 0
    STOP = 1
    FREE = 2
    NEW_CACHE = 3
    PREFILL = 4
    DECODE = 5
    DECODE_ARGMAX = 6
    VERIFY = 7
    TRUNCATE = 8
    COPY_PREFIX = 9
    SAVE_CACHE = 10
    LOAD_CACHE = 11
    CHECKPOINT = 12


@functools.cache
def init_group() -> mx.distributed.Group:
    """The group `mlx.launch` set up; refused when this process was not started by it."""
    if not mx.distributed.is_available():
        raise SystemExit("lmserve: --distributed needs an MLX build with distributed support")
    group = mx.distributed.init()
    if group.size() < 2:
        raise SystemExit("lmserve: --distributed runs one process per rank, started by mlx.launch "
                         "(e.g. mlx.launch --hosts 10.0.0.1,10.0.0.2 -- lmserve-mac model.gguf --distributed)")
    return group


def check_args(args: argparse.Namespace) -> int:
    """This rank's number, once the group has formed; flags a sharded model cannot honour refused."""
    if args.engine == "cpu":
        raise SystemExit("lmserve: --distributed runs on the MLX engine (not --engine cpu)")
    if args.draft is not None or args.kv_cache_dir is not None:
        raise SystemExit("lmserve: --distributed does not support --draft or --kv-cache-dir yet")
    return init_group().rank()


def check_shardable(config: ModelConfig, mode: str, world: int) -> None:
    """Refuse (on every rank alike) what cannot be split `world` ways, before any weight loads."""
    if config.architecture not in FAMILIES:
        raise ModelLoadError(f"the MLX engine does not support architecture '{config.architecture}'")
    if mode == "pipeline":
        if config.n_layers < world:
            raise ModelLoadError(f"this model's {config.n_layers} layers cannot be split across {world} ranks")
        return
    if config.architecture not in shardable():
        raise ModelLoadError(f"mlx-lm's {config.architecture} model has no tensor-parallel shard(); "
                             f"--distributed pipeline splits it by layers "
                             f"(families tensor parallelism can split: {', '.join(shardable())})")
    la = config.linear_attention
    sizes = {"attention heads": config.n_heads, "KV heads": config.n_kv_heads, "FFN size": config.ffn_size,
             "expert FFN size": config.expert_ffn_size if config.is_moe else 0,
             "shared expert FFN size": config.shared_expert_ffn_size,
             "linear-attention key heads": la.k_heads if la else 0, "value heads": la.v_heads if la else 0,
             "vocabulary": config.vocab_size if family_of(config).shards_head and not config.tied_embeddings else 0}
    uneven = [f"{name} {n}" for name, n in sizes.items() if n % world]
    if uneven:
        raise ModelLoadError(f"this model's {', '.join(uneven)} cannot be split evenly across {world} ranks "
                             "(--distributed pipeline splits it by layers)")


def shardable() -> list[str]:
    """The architectures whose mlx-lm class has `shard` (tensor parallelism)."""
    return [arch for arch, fam in FAMILIES.items() if hasattr(importlib.import_module(fam.module).Model, "shard")]


class ShardedMLXEngine(MLXEngine):
    """An MLX engine holding its rank's share of the weights; every step is a collective."""

    queue_next_step = False  # no greedy step left in flight between two lockstep calls
    parallelism = ""  # for the banner

    def __init__(self, gguf: GGUFFile, config: ModelConfig, group: mx.distributed.Group,
                 progress: Progress | None = None) -> None:
        self.group = group
        super().__init__(gguf, config, progress)


class TensorParallelEngine(ShardedMLXEngine):
    """A share of every layer: mlx-lm's `shard` (heads and FFN columns split)."""

    parallelism = "tensor parallel"

    def __init__(self, gguf: GGUFFile, config: ModelConfig, group: mx.distributed.Group,
                 progress: Progress | None = None) -> None:
        self.kv_share = 1 / group.size()  # each rank caches 1/N of the KV heads (and recurrent state)
        self._sharded_a_layer = False
        super().__init__(gguf, config, group, progress)

    def _layer_loaded(self, layer: int) -> None:
        """mlx-lm's `shard`, on this one layer (it shards every layer of the list it finds),
        evaluated so that the whole layer's arrays are let go now. qwen3_5's `shard` splits its
        untied output head too, whenever it runs: after the first layer it is told the head is
        tied (what it checks), so that the head is split once."""
        inner, text = self.model.model, text_model(self.model, self.config)
        keep_head = self._sharded_a_layer and family_of(self.config).shards_head
        tied = keep_head and text.args.tie_word_embeddings
        layers, inner.layers = inner.layers, [inner.layers[layer]]
        if keep_head:
            text.args.tie_word_embeddings = True
        try:
            self.model.shard(self.group)
        finally:
            inner.layers = layers
            if keep_head:
                text.args.tie_word_embeddings = tied
        self._sharded_a_layer = True
        mx.eval(layers[layer].parameters())


class PipelineParallelEngine(ShardedMLXEngine):
    """A run of whole layers (pipeline.py)."""

    def __init__(self, gguf: GGUFFile, config: ModelConfig, group: mx.distributed.Group,
                 progress: Progress | None = None) -> None:
        self.layer_split = pipeline.LayerSplit(config.n_layers, group, family_of(config).tuple_layers)
        self.parallelism = f"pipeline parallel ({self.layer_split.describe()})"
        self.kv_share = self.layer_split.kv_share
        super().__init__(gguf, config, group, progress)

    def _build_model(self, config: ModelConfig, gguf: GGUFFile) -> nn.Module:
        model = super()._build_model(config, gguf)
        self.layer_split.prune(model)
        return model

    def _tensors(self, gguf: GGUFFile) -> dict[str, TensorInfo]:
        return self.layer_split.tensors(gguf.tensors)

    def _loaded(self) -> None:
        self.layer_split.connect(self.model)


ENGINES = {"tensor": TensorParallelEngine, "pipeline": PipelineParallelEngine}


def broadcast(group: mx.distributed.Group, words: Sequence[int] | None) -> list[int]:
    """Rank 0's `words` on every rank: a length, then the words (others contribute zeros)."""
    lead = group.rank() == 0
    header = np.array([len(words) if lead and words is not None else 0], dtype=np.int32)
    (n,) = _all_sum(group, header)
    if not n:
        return []
    body = np.asarray(words, dtype=np.int32) if lead else np.zeros(n, dtype=np.int32)
    return _all_sum(group, body)


def _all_sum(group: mx.distributed.Group, values: np.ndarray) -> list[int]:
    out = mx.distributed.all_sum(mx.array(values), group=group, stream=mx.cpu)
    return np.array(out).tolist()


def _text(words: Sequence[int]) -> str:
    return bytes(words).decode()


def _words(text: str) -> list[int]:
    return list(os.fsencode(text))


def rank_path(path: Path, rank: int) -> Path:
    """Where rank `rank` keeps its share of a saved cache (rank 0: the path itself)."""
    return Path(path) if rank == 0 else Path(f"{path}.rank{rank}")


_farewells: list[Callable[[str], None]] = []


def on_gone(farewell: Callable[[str], None]) -> None:
    """Have `farewell(message)` run when the group breaks, before the process ends (rank 0's
    scheduler ends its requests with the message as their in-band error)."""
    _farewells.append(farewell)


def gone(exc: BaseException | str) -> None:
    """The group is broken: one clear line, the farewells, and this process ends (no hang)."""
    line = f"rank {init_group().rank()} of the distributed group stops: a rank is gone ({exc})"
    print(f"lmserve: {line}", file=sys.stderr, flush=True)
    if _farewells:
        for farewell in _farewells:
            farewell(line)
        time.sleep(FAREWELL_S)
    os._exit(1)


class Watchdog:
    """Ends the process (`gone`) when a collective outlives its deadline: the ring may never
    return from one whose peer died."""

    def __init__(self) -> None:
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
                gone(self._what)


class Pace:
    """How long a lockstep call may take, from how long the calls so far took per command word:
    a slow machine (a large model, MLX's CPU backend) gets longer, a fast one gives up sooner."""

    def __init__(self) -> None:
        self.per_word: float | None = None
        self._start = 0.0
        self._words = 1

    def bound(self, n_words: int) -> float:
        return STEP_S + SLACK * (self.per_word or FIRST_PACE_S) * n_words

    def start(self, watchdog: Watchdog, op: Op, n_words: int) -> None:
        bound = self.bound(n_words)
        watchdog.arm(bound, f"no answer within {bound:.0f} s of {op.name}")
        self._start, self._words = time.monotonic(), max(1, n_words)

    def end(self, watchdog: Watchdog) -> None:
        watchdog.disarm()
        pace = (time.monotonic() - self._start) / self._words
        self.per_word = pace if self.per_word is None else max(self.per_word, pace)


class LockstepEngine(Engine[MLXKVCache]):
    """Rank 0's engine: each call is broadcast to the followers, then made on the local shard.

    Caches are the local engine's, tagged with an integer handle the followers know them by; a
    cache rank 0 drops is freed on the followers with the next command."""

    def __init__(self, inner: ShardedMLXEngine, ranks: list[RankShare]) -> None:
        self.inner = inner
        self.group = inner.group
        self.world = self.group.size()
        self.config = inner.config
        self.name = inner.name
        self.parallelism = inner.parallelism
        self.device = f"{inner.device}, {inner.parallelism} over {self.world} ranks"
        self.kv_share = inner.kv_share
        self.weight_bytes = inner.weight_bytes
        self.kv_dtype_bytes = inner.kv_dtype_bytes
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
        self._watchdog = Watchdog()
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
                gone(exc)
                raise
            finally:
                self._pace.end(self._watchdog)

    def _send(self, op: Op, args: Sequence[int]) -> None:
        self._watchdog.arm(WAIT_S, f"no answer within {WAIT_S:.0f} s of sending {op.name}")
        try:
            while self._freed:
                broadcast(self.group, [Op.FREE, self._freed.popleft()])
            broadcast(self.group, [op, *args])
        except RuntimeError as exc:
            gone(exc)
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
        call, now or later, still waiting on the other ranks a second after it began is taken for
        a lost rank, well within uvicorn's graceful shutdown, so open streams get the in-band error.
        `then` (stopping the worker) runs only after that second and a half: a worker stopped at
        once, between two steps, would end the streams as a plain shutdown, naming no lost rank."""
        self._watchdog.hurry(STOP_S, f"still waiting on the other ranks {STOP_S:.0f} s after the stop signal")
        threading.Timer(STOP_S + STOP_GRACE_S, then).start()

    def on_lost(self, abandon: Callable[[str], None]) -> None:
        on_gone(abandon)

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
        self._call(Op.SAVE_CACHE, [cache.handle, *_words(str(path))],  # type: ignore[attr-defined]
                   lambda: self.inner.save_cache(cache, path))

    def load_cache(self, path: Path, capacity: int) -> MLXKVCache:
        with self._lock:
            handle = self._next
            self._send(Op.LOAD_CACHE, [handle, capacity, self.checkpoints_per_cache, *_words(str(path))])
            return self._tag(self.inner.load_cache(path, capacity))


def execute(engine: ShardedMLXEngine, caches: dict[int, MLXKVCache], op: Op, args: list[int]) -> None:
    """A follower's side of one lockstep command, on its own engine and caches."""
    rank = engine.group.rank()
    if op == Op.FREE:
        for handle in args:
            caches.pop(handle, None)
    elif op == Op.NEW_CACHE:
        engine.checkpoints_per_cache = args[2]
        caches[args[0]] = engine.new_cache(args[1])
    elif op == Op.PREFILL:
        engine.prefill(caches[args[0]], args[2:], bool(args[1]))
    elif op in (Op.DECODE, Op.DECODE_ARGMAX, Op.VERIFY):
        k = args[0]
        batch, rest = [caches[h] for h in args[1:1 + k]], args[1 + k:]
        if op == Op.DECODE:
            engine.decode(batch, rest)
        elif op == Op.DECODE_ARGMAX:
            engine.decode_argmax(batch, rest)
        else:
            lengths, flat = rest[:k], rest[k:]
            starts = np.cumsum([0, *lengths]).tolist()
            engine.verify(batch, [flat[a:b] for a, b in zip(starts, starts[1:], strict=False)])
    elif op == Op.TRUNCATE:
        engine.truncate(caches[args[0]], args[1])
    elif op == Op.COPY_PREFIX:
        engine.copy_prefix(caches[args[0]], caches[args[1]], args[2])
    elif op == Op.SAVE_CACHE:
        engine.save_cache(caches[args[0]], rank_path(Path(_text(args[1:])), rank))
    elif op == Op.LOAD_CACHE:
        engine.checkpoints_per_cache = args[2]
        caches[args[0]] = engine.load_cache(rank_path(Path(_text(args[3:])), rank), args[1])
    elif op == Op.CHECKPOINT:
        engine.checkpoint(caches[args[0]])


def follow(engine: ShardedMLXEngine) -> None:
    """A follower's life: run rank 0's commands until it says STOP or the group breaks.
    A ValueError is one rank 0 meets too (the same checks on the same state): the loop goes on."""
    caches: dict[int, MLXKVCache] = {}
    watchdog, pace = Watchdog(), Pace()
    wait = WAIT_S  # rank 0 may still be in the call this rank has just done: it has that long too
    with mx.stream(engine.stream):
        while True:
            watchdog.arm(wait, f"rank 0 silent for {wait:.0f} s")
            try:
                words = broadcast(engine.group, None)
            except RuntimeError as exc:
                gone(exc)
            op = Op(words[0]) if words else Op.NOOP
            if op == Op.STOP:
                return
            wait = WAIT_S + (pace.bound(len(words)) if op > Op.FREE else 0)
            if op == Op.NOOP:
                continue
            pace.start(watchdog, op, len(words))
            try:
                execute(engine, caches, op, words[1:])
            except ValueError:
                pass
            except RuntimeError as exc:
                gone(exc)
            pace.end(watchdog)


HOST_BYTES = 64  # a host name is cut to this many bytes in the gather


def gather_ranks(group: mx.distributed.Group, weight_bytes: int) -> list[RankShare]:
    """Every rank's host, weights and available memory, on every rank."""
    host = socket.gethostname().encode()[:HOST_BYTES]
    mine = np.zeros((1, 2 + HOST_BYTES), dtype=np.float32)
    mine[0, :2] = [weight_bytes / 2**20, psutil.virtual_memory().available / 2**20]
    mine[0, 2:2 + len(host)] = list(host)
    out = np.array(mx.distributed.all_gather(mx.array(mine), group=group, stream=mx.cpu))
    return [RankShare(bytes(int(b) for b in row[2:] if b).decode(errors="replace"), int(row[0] * 2**20),
                 int(row[1] * 2**20)) for row in out]


def refuse(group: mx.distributed.Group, exc: ModelLoadError) -> NoReturn:
    """Every rank refuses alike: each says so, then waits for the others to have said so before
    exiting (mlx.launch stops the rest the moment one rank exits; a CI run once lost two of three
    ranks' lines that way)."""
    print(f"lmserve: {exc}", file=sys.stderr, flush=True)
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group, stream=mx.cpu))
    raise SystemExit(1)


def load(gguf: GGUFFile, config: ModelConfig, mode: str, progress: Progress | None = None) -> LockstepEngine | None:
    """Build this rank's shard. Rank 0 gets its LockstepEngine; any other rank serves rank 0's
    commands here until the group stops and gets None (it must then exit, never binding HTTP)."""
    group = init_group()
    try:
        check_shardable(config, mode, group.size())
    except ModelLoadError as exc:
        refuse(group, exc)
    engine = ENGINES[mode](gguf, config, group, progress if group.rank() == 0 else None)
    ranks = gather_ranks(group, engine.weight_bytes)
    if group.rank() != 0:
        follow(engine)
        return None
    tightest = min(range(len(ranks)), key=lambda r: ranks[r].available)
    if ranks[tightest].available < ranks[0].available * 0.9:
        logging.getLogger("lmserve.ram").warning(
            "RAM guard: KV slots are sized on rank %d's memory, the least free (%s), each rank holding its "
            "share of every slot", tightest,
            ", ".join(f"rank {r}: {rank.available / 2**30:.1f} GiB" for r, rank in enumerate(ranks)))
    lockstep = LockstepEngine(engine, ranks)
    atexit.register(lockstep.close)
    return lockstep
