"""The NumPy engine's prompt-sized products on AMX tiles against the VNNI kernels, in one process.

Rounds alternate the two (`LMSERVE_CPU_TILES`, read at each product), best of each kept:
- per type with a recipe (Q4_K, Q5_K, Q6_K), one product of 64 and 512 rows with 8 matrices
  1024 x 1024 of random quants;
- a MoE's grouped product: 2,048 rows (512 tokens, 4 experts each) over 32 experts of 1024 x 1024,
  routed unevenly, as a prompt chunk of the synthetic MoE routes;
- with --model, a prompt's passes (`--prompt-tokens`, in chunks of 512 as the server runs them).

    python scripts/bench_tiles.py [--model PATH] [--rounds N] [--prompt-tokens N]
"""

from __future__ import annotations

import lmserve  # noqa: F401  (first: it tunes OpenBLAS before NumPy loads, as the server does)

# isort: split
import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_rounds import best_of, chunked_prompt, timed  # noqa: E402  (scripts/, this script's own directory)

from lmserve.engine_cpu import CPUEngine, amx_kernels, int8_kernels  # noqa: E402
from lmserve.engine_cpu.encodings import encode  # noqa: E402
from lmserve.engine_cpu.qmatrix import ExpertStack, QuantMatrix  # noqa: E402
from lmserve.model.config import ModelConfig  # noqa: E402
from lmserve.model.gguf_file import GGUFFile  # noqa: E402
from tests.test_quant_blocks import random_blocks  # noqa: E402

T = GGMLQuantizationType
TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)
MATRICES, SIZE = 8, 1024
SIDES = {"vnni": lambda: os.environ.__setitem__(amx_kernels.ENV, "off"),
         "tiles": lambda: os.environ.__setitem__(amx_kernels.ENV, "auto")}


def matrix(qtype: GGMLQuantizationType, rows: int, seed: int) -> QuantMatrix:
    return QuantMatrix(*encode(random_blocks(qtype, rows, SIZE, seed=seed), qtype, SIZE))


def products(qtype: GGMLQuantizationType, rows: int) -> Callable[[], object]:
    matrices = [matrix(qtype, SIZE, i) for i in range(MATRICES)]
    x = np.random.default_rng(0).standard_normal((rows, SIZE)).astype(np.float32)
    return lambda: [m.times(x) for m in matrices]


def grouped(qtype: GGMLQuantizationType) -> Callable[[], object]:
    """32 experts, the group sizes of one of the synthetic MoE's prompt chunks."""
    stack = ExpertStack(matrix(qtype, 32 * SIZE, 1), 32)
    sizes = np.array([9, 3, 312, 7, 7, 488, 2, 9, 1, 38, 205, 2, 2, 454, 509])
    experts, firsts = np.arange(len(sizes)) * 2, np.concatenate([[0], np.cumsum(sizes)])
    x = np.random.default_rng(0).standard_normal((firsts[-1], SIZE)).astype(np.float32)
    return lambda: stack.times_grouped(x, experts, firsts)


def report(label: str, best: dict[str, float], unit: float = 1e3) -> None:
    print(f"{label:40} {best['vnni'] * unit:10.2f} {best['tiles'] * unit:10.2f} {best['vnni'] / best['tiles']:11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF whose prompt passes to time too")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=1100)
    args = parser.parse_args()
    if not amx_kernels.available():
        raise SystemExit("this CPU (or kernel) has no AMX-INT8 tiles to compare")
    int8_kernels.choose("int8")
    print(f"{'products (ms)':40} {'vnni':>10} {'tiles':>10} {'vnni/tiles':>11}")
    for qtype in TYPES:
        for rows in (64, 512):
            report(f"{qtype.name}, {MATRICES} x {SIZE} x {SIZE}, {rows} rows",
                   best_of(args.rounds, timed(products(qtype, rows), 3), SIDES))
        report(f"{qtype.name}, 32 experts, 2,048 rows grouped", best_of(args.rounds, timed(grouped(qtype), 3), SIDES))
    if args.model:
        gguf = GGUFFile(args.model)
        engine = CPUEngine(gguf, ModelConfig.from_gguf(gguf), tune_threads=False)
        best = best_of(args.rounds, timed(chunked_prompt(engine, args.prompt_tokens), 1), SIDES)
        print(f"\n{gguf.path.name}, {args.prompt_tokens}-token prompt: vnni {args.prompt_tokens / best['vnni']:.0f} tok/s, "
              f"tiles {args.prompt_tokens / best['tiles']:.0f} tok/s, tiles/vnni {best['vnni'] / best['tiles']:.2f}")


if __name__ == "__main__":
    main()
