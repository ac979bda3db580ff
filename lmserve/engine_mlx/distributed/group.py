"""The group `mlx.launch` starts: forming it, refusing what cannot be split, every rank's share
and memory, and how a rank leaves a broken group."""

from __future__ import annotations

import functools
import importlib
import socket
import sys
import time
from collections.abc import Callable
from typing import NoReturn

import mlx.core as mx
import numpy as np
import psutil

from lmserve.engine.protocol import RankShare
from lmserve.engine_mlx.model import FAMILIES, family_of
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import ModelLoadError

FAREWELL_S = 0.5  # what the server has to send in-band errors on its open streams before exiting


class GroupRefused(ModelLoadError):
    """Every rank refused the model alike and has said so: the process exits with status 1."""

    reported = True


@functools.cache
def init_group() -> mx.distributed.Group:
    """The group `mlx.launch` set up; refused when this process was not started by it."""
    if not mx.distributed.is_available():
        raise ModelLoadError("--distributed needs an MLX build with distributed support")
    group = mx.distributed.init()
    if group.size() < 2:
        raise ModelLoadError("--distributed runs one process per rank, started by mlx.launch "
                              "(e.g. mlx.launch --hosts 10.0.0.1,10.0.0.2 -- lmserve-mac model.gguf --distributed)")
    return group


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
    raise GroupRefused(str(exc))


class GroupEnd:
    """How a rank leaves a broken group: one clear line, the farewells (rank 0's scheduler ends
    its requests with the line as their in-band error), then `exit_process(1)`, which the CLI
    chose; a rank never hangs on a group that is gone."""

    def __init__(self, exit_process: Callable[[int], NoReturn]) -> None:
        self.exit_process = exit_process
        self.farewells: list[Callable[[str], None]] = []

    def __call__(self, exc: BaseException | str) -> NoReturn:
        line = f"rank {init_group().rank()} of the distributed group stops: a rank is gone ({exc})"
        print(f"lmserve: {line}", file=sys.stderr, flush=True)
        if self.farewells:
            for farewell in self.farewells:
                farewell(line)
            time.sleep(FAREWELL_S)
        self.exit_process(1)
