"""What asking the caches for the rows ahead saves a decode step's products (`int8_kernels`'
PREFETCH_BYTES), measured against the same kernels without it, in alternating rounds.

One round runs, for every layer of the model in turn (so the weights come from memory, as in a
served step, not from a cache that still holds the last call's), the products of a decode step
of --rows x rows: the attention's and dense FFNs' matrices, and for a MoE each row's k experts, routed at random
as distinct stories route them (a fresh routing a round). It prints each setting's median ms a
step and the ratio; the products' results are the same bits either way.

    python scripts/bench_prefetch.py [--model /tmp/synth-moe.gguf] [--rows 1 4] [--rounds N]
"""

from __future__ import annotations

import lmserve  # noqa: F401  (first: it tunes OpenBLAS before NumPy loads, as the server does)

# isort: split
import argparse
import time
from pathlib import Path

import numpy as np

from lmserve.engine_cpu import CPUEngine, int8_kernels
from lmserve.engine_cpu.int8_kernels import (
    _columns,
    _grouped_columns,
    _quantize,
    _rows_ahead,
    by_superblock,
    x_layout,
)
from lmserve.engine_cpu.qmatrix import SUPERBLOCK, ExpertStack, MatrixStack, QuantMatrix
from lmserve.engine_cpu.weights import AttentionWeights
from lmserve.model.config import ModelConfig
from lmserve.model.default_model import default_model_path
from lmserve.model.gguf_file import GGUFFile


def quantized(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x as the kernels take it for this matrix (`int8_kernels._quantize`)."""
    size = x.shape[1] // scale.shape[-1]
    superblocks = by_superblock(q.dtype, scale.dtype)
    return _quantize(x, size, SUPERBLOCK if superblocks else size, x_layout(q.dtype))


def dense_products(engine: CPUEngine) -> list[QuantMatrix]:
    """Each layer's attention and dense FFN matrices on the int8 kernels, layer by layer."""
    matrices = []
    for layer in engine.weights.layers:
        attention = (layer.mixer.qkv, layer.mixer.o) if isinstance(layer.mixer, AttentionWeights) else ()
        for matrix in (*attention, layer.gate_up, layer.down):
            parts = matrix.parts if isinstance(matrix, MatrixStack) else (matrix,)
            matrices += [p for p in parts if isinstance(p, QuantMatrix) and int8_kernels.takes(p.q.dtype)]
    return matrices


def expert_stacks(engine: CPUEngine) -> list[ExpertStack]:
    """Each layer's expert stacks (gate/up, then down) on the int8 kernels."""
    return [stack for layer in engine.weights.layers if layer.experts is not None
            for stack in (layer.experts.gate_up, layer.experts.down)
            if isinstance(stack, ExpertStack) and int8_kernels.takes(stack.whole.q.dtype)]


def routing(rows: int, experts: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Groups (experts, firsts) of `rows` rows routed to k distinct experts each, as `moe` groups them."""
    pairs = np.concatenate([rng.choice(experts, k, replace=False) for _ in range(rows)])
    chosen = np.sort(pairs)
    firsts = np.concatenate(([0], np.flatnonzero(chosen[1:] != chosen[:-1]) + 1, [len(chosen)]))
    return chosen[firsts[:-1]].astype(np.int64), firsts.astype(np.int64)


def step(dense: list[QuantMatrix], stacks: list[ExpertStack], rows: int, k: int, prefetch: bool,
         rng: np.random.Generator) -> float:
    """Seconds for one step's products of `rows` rows, with or without the prefetches: the
    inputs are made first, so the products run back to back, as in a pass."""
    calls = []
    for matrix in dense:
        x = rng.standard_normal((rows, matrix.shape[1])).astype(np.float32)
        out = np.empty((rows, len(matrix)), np.float32)
        xq, dx, xsum = quantized(x, matrix.q, matrix.scale)
        calls.append((_columns, (xq, *matrix.arrays, dx, xsum, out), matrix.q))
    for stack in stacks:
        groups, firsts = routing(rows, stack.experts, k, rng)
        x = rng.standard_normal((int(firsts[-1]), stack.whole.shape[1])).astype(np.float32)
        q, scale, offset, supers = stack.cubes
        out = np.empty((len(x), stack.rows_each), np.float32)
        xq, dx, xsum = quantized(x, q, scale)
        calls.append((_grouped_columns, (xq, q, scale, offset, supers, dx, xsum, groups, firsts, out), q))
    start = time.perf_counter()
    for product, arguments, q in calls:
        product(*arguments, _rows_ahead(q) if prefetch else 0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="x rows a step (decode streams)")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    args.model = args.model or default_model_path()
    gguf = GGUFFile(args.model)
    config = ModelConfig.from_gguf(gguf)
    engine = CPUEngine(gguf, config)
    dense, stacks = dense_products(engine), expert_stacks(engine)
    print(f"{args.model.name}: {len(dense)} dense matrices, {len(stacks)} expert stacks "
          f"(k = {config.n_experts_used}); PREFETCH_BYTES {int8_kernels.PREFETCH_BYTES}")
    rng = np.random.default_rng(0)
    for rows in args.rows:
        times: dict[bool, list[float]] = {False: [], True: []}
        for prefetch in (False, True):  # compiled and warmed before the timed rounds
            step(dense, stacks, rows, config.n_experts_used, prefetch, rng)
        for _ in range(args.rounds):
            for prefetch in (False, True):
                times[prefetch].append(step(dense, stacks, rows, config.n_experts_used, prefetch, rng))
        without, with_ = (float(np.median(times[p])) * 1e3 for p in (False, True))
        print(f"{rows} row(s): without {without:.2f} ms a step, with {with_:.2f} ms; "
              f"speed-up {without / with_:.2f}x (medians of {args.rounds} alternating rounds)")


if __name__ == "__main__":
    main()
