"""`--distributed`: one model sharded across the ranks `mlx.launch` starts.

Every rank reads the GGUF and keeps only its share: tensor parallel, mlx-lm's `Model.shard(group)`
(attention heads and FFN columns split, embeddings and norms replicated; the sharded layers'
`all_sum` is MLX's ring backend, no transport of ours), or pipeline parallel, a run of whole
layers per rank (pipeline.py). Rank 0 serves HTTP, the scheduler and the KV slot pool over a
`LockstepEngine`: before each engine call it broadcasts a small command (op code, cache handles and
token ids as int32) to the other ranks, whose `follow` loop makes the same call on its own engine,
caches kept by handle. Every rank thus runs the same collectives in the same order.

A lost rank ends the group within seconds, with one line from each survivor (watchdog.py); how
the process then ends is the caller's (`exit_process`, from the CLI). The modules: group.py (the
group, what can be split, each rank's share, leaving), sharded.py (the engines on a share),
wire.py (the command words), leader.py (rank 0's LockstepEngine), follower.py (the others' loop),
watchdog.py (deadlines on collectives).
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from typing import NoReturn

from lmserve.engine.kv_types import AUTO
from lmserve.engine_mlx.distributed.follower import follow
from lmserve.engine_mlx.distributed.group import (
    GroupEnd,
    GroupRefused,
    check_shardable,
    gather_ranks,
    init_group,
    refuse,
)
from lmserve.engine_mlx.distributed.leader import LockstepEngine
from lmserve.engine_mlx.distributed.sharded import ENGINES
from lmserve.engine_mlx.engine import Progress
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile, ModelLoadError

__all__ = ["GroupRefused", "LockstepEngine", "init_group", "load"]


def load(gguf: GGUFFile, config: ModelConfig, mode: str, exit_process: Callable[[int], NoReturn],
         progress: Progress | None = None, kv_type: str = AUTO) -> LockstepEngine | None:
    """Build this rank's shard. Rank 0 gets its LockstepEngine; any other rank serves rank 0's
    commands here until the group stops and gets None (it must then exit, never binding HTTP).
    A broken group ends the process with `exit_process(1)` (the caller decides how a process ends)."""
    group = init_group()
    try:
        check_shardable(config, mode, group.size())
    except ModelLoadError as exc:
        refuse(group, exc)
    engine = ENGINES[mode](gguf, config, group, progress if group.rank() == 0 else None, kv_type)
    ranks = gather_ranks(group, engine.weight_bytes)
    end = GroupEnd(exit_process)
    if group.rank() != 0:
        follow(engine, end)
        return None
    tightest = min(range(len(ranks)), key=lambda r: ranks[r].available)
    if ranks[tightest].available < ranks[0].available * 0.9:
        logging.getLogger("lmserve.ram").warning(
            "RAM guard: KV slots are sized on rank %d's memory, the least free (%s), each rank holding its "
            "share of every slot", tightest,
            ", ".join(f"rank {r}: {rank.available / 2**30:.1f} GiB" for r, rank in enumerate(ranks)))
    lockstep = LockstepEngine(engine, ranks, end)
    atexit.register(lockstep.close)
    return lockstep
