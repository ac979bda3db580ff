"""A follower rank's side of lockstep: rank 0's commands, made on its own engine and caches."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from lmserve.engine_mlx.distributed.group import GroupEnd
from lmserve.engine_mlx.distributed.sharded import ShardedMLXEngine
from lmserve.engine_mlx.distributed.watchdog import WAIT_S, Pace, Watchdog
from lmserve.engine_mlx.distributed.wire import Op, broadcast, text_of
from lmserve.engine_mlx.kv import MLXKVCache


def rank_path(path: Path, rank: int) -> Path:
    """Where rank `rank` keeps its share of a saved cache (rank 0: the path itself)."""
    return Path(path) if rank == 0 else Path(f"{path}.rank{rank}")


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
        engine.save_cache(caches[args[0]], rank_path(Path(text_of(args[1:])), rank))
    elif op == Op.LOAD_CACHE:
        engine.checkpoints_per_cache = args[2]
        caches[args[0]] = engine.load_cache(rank_path(Path(text_of(args[3:])), rank), args[1])
    elif op == Op.CHECKPOINT:
        engine.checkpoint(caches[args[0]])
    elif op == Op.EMBED:
        engine.embed(args)  # on a cache of its own, as rank 0's: its collectives meet rank 0's


def follow(engine: ShardedMLXEngine, end: GroupEnd) -> None:
    """A follower's life: run rank 0's commands until it says STOP or the group breaks.
    A ValueError is one rank 0 meets too (the same checks on the same state): the loop goes on."""
    caches: dict[int, MLXKVCache] = {}
    watchdog, pace = Watchdog(end), Pace()
    wait = WAIT_S  # rank 0 may still be in the call this rank has just done: it has that long too
    with mx.stream(engine.stream):
        while True:
            watchdog.arm(wait, f"rank 0 silent for {wait:.0f} s")
            try:
                words = broadcast(engine.group, None)
            except RuntimeError as exc:
                end(exc)
            op = Op(words[0]) if words else Op.NOOP
            if op == Op.STOP:
                return
            wait = WAIT_S + (pace.bound(op, len(words)) if op > Op.FREE else 0)
            if op == Op.NOOP:
                continue
            pace.start(watchdog, op, len(words))
            try:
                execute(engine, caches, op, words[1:])
            except ValueError:
                pass
            except RuntimeError as exc:
                end(exc)
            pace.end(watchdog)
