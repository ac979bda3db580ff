"""How fast this machine streams memory, and the decode speed that bounds: where a token reads more
weights than the caches hold, no server's one-stream decode beats it.

Sums float32 arrays of growing size (ones the L3 may hold, ones past it) on one thread and on
all, best of --rounds, in GB/s. With --model, the bytes one decode step reads (every tensor but
the embedding table, of which one row; of a MoE's expert stacks the routed experts' share) and
the tok/s those rates allow: every byte from memory; the dense part from cache (it is read every
step) and the experts from memory; every byte from cache. Bounds to hold measured decode speeds
against, not predictions: a step also computes, and how many experts the cache keeps varies.

    python scripts/bench_bandwidth.py [--model PATH] [--rounds N]
"""

from __future__ import annotations

import lmserve  # noqa: F401  (first: it tunes OpenBLAS before NumPy loads, as the server does)

# isort: split
import argparse
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

from lmserve.model.gguf_file import GGUFFile

SIZES_MIB = (16, 64, 256, 512)


@njit(parallel=True, fastmath=True, cache=True)
def _streamed(values: np.ndarray, parts: int) -> float:
    """The sum of `values`, `parts` runs of it on the threads: each byte read once."""
    sums = np.zeros(parts, np.float32)
    size = len(values) // parts
    for p in prange(parts):
        total = np.float32(0.0)
        for i in range(p * size, (p + 1) * size):
            total += values[i]
        sums[p] = total
    return sums.sum()


def bandwidth(mib: int, threads: int, rounds: int) -> float:
    """Best GB/s of `rounds` sums of a `mib` MiB array on `threads` threads."""
    values = np.ones(mib * 2**20 // 4, np.float32)
    numba.set_num_threads(threads)
    _streamed(values, threads)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        _streamed(values, threads)
        best = min(best, time.perf_counter() - start)
    return values.nbytes / best / 1e9


def step_bytes(gguf: GGUFFile) -> tuple[int, int]:
    """(dense bytes, expert bytes) one decode step of the model reads."""
    metadata = {key.split(".", 1)[-1]: value for key, value in gguf.metadata.items()}
    used, experts = int(metadata.get("expert_used_count", 0)), int(metadata.get("expert_count", 0))
    dense = routed = 0
    for info in gguf.tensors.values():
        if "_exps." in info.name:
            routed += info.nbytes * used // experts
        elif info.name == "token_embd.weight" and "output.weight" in gguf.tensors:
            dense += info.nbytes // info.shape[0]
        else:
            dense += info.nbytes
    return dense, routed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF whose decode step's bytes to bound")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    most = numba.config.NUMBA_NUM_THREADS
    rates = {(mib, threads): bandwidth(mib, threads, args.rounds) for mib in SIZES_MIB for threads in (1, most)}
    print(f"{'array':>10} {'1 thread':>10} {f'{most} threads':>11}   (GB/s)")
    for mib in SIZES_MIB:
        print(f"{mib:>6} MiB {rates[mib, 1]:10.1f} {rates[mib, most]:11.1f}")
    if args.model:
        dense, routed = step_bytes(GGUFFile(args.model))
        cached, memory = rates[SIZES_MIB[0], most], rates[SIZES_MIB[-1], most]
        print(f"\n{args.model.name}: a decode step reads {(dense + routed) / 1e6:.1f} MB "
              f"({dense / 1e6:.1f} dense, {routed / 1e6:.1f} of routed experts)")
        for label, seconds in (("every byte from memory", (dense + routed) / memory),
                               ("the dense part from cache, experts from memory", dense / cached + routed / memory),
                               ("every byte from cache", (dense + routed) / cached)):
            print(f"{label:48} {1e9 / seconds:6.0f} tok/s")


if __name__ == "__main__":
    main()
