"""The lockstep wire protocol: rank 0 broadcasts each engine call as a command of int32 words
(op code, cache handles, token ids, a path as bytes) with one `all_sum`; the others contribute zeros."""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence

import mlx.core as mx
import numpy as np


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
    EMBED = 13


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


def text_of(words: Sequence[int]) -> str:
    return bytes(words).decode()


def words_of(text: str) -> list[int]:
    return list(os.fsencode(text))
