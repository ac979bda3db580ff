"""The NumPy engine's products with int8 activations against float32 ones (`--cpu-dots`), in one process.

Rounds alternate the two (`int8_kernels.ENABLED` is process-wide), best of each kept:
- per type, one matrix product of 1 and 4 rows, 16 matrices 2048 x 4096 of random quants
  (about 64-150 MB: larger than the caches, as a model's weights are);
- a model's decode steps, 1 and 4 streams, after a 32-token prompt.

    python scripts/bench_dots.py [--model PATH] [--rounds N] [--steps N]
"""

from __future__ import annotations

import lmserve  # noqa: F401  (first: it tunes OpenBLAS before NumPy loads, as the server does)

# isort: split
import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_rounds import timed  # noqa: E402  (scripts/, this script's own directory)

from lmserve.engine_cpu import CPUEngine, int8_kernels  # noqa: E402
from lmserve.engine_cpu.encodings import encode  # noqa: E402
from lmserve.engine_cpu.qmatrix import QuantMatrix  # noqa: E402
from lmserve.model.config import ModelConfig  # noqa: E402
from lmserve.model.default_model import default_model_path  # noqa: E402
from lmserve.model.gguf_file import GGUFFile  # noqa: E402
from tests.test_quant_blocks import random_blocks  # noqa: E402

T = GGMLQuantizationType
TYPES = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K, T.Q8_0, T.Q3_K)
MATRICES, ROWS, COLUMNS = 16, 2048, 4096


def best_of(rounds: int, runs: dict[str, Callable[[], float]]) -> dict[str, float]:
    """Each run's least seconds over `rounds` alternating rounds, int8 then float32 each round."""
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            int8_kernels.ENABLED = name.endswith("int8")
            best[name] = min(best[name], run())
    return best


def products(qtype: GGMLQuantizationType, rows: int) -> Callable[[], object]:
    matrices = [QuantMatrix(*encode(random_blocks(qtype, ROWS, COLUMNS, seed=i), qtype, COLUMNS))
                for i in range(MATRICES)]
    x = np.random.default_rng(0).standard_normal((rows, COLUMNS)).astype(np.float32)
    return lambda: [m.times(x) for m in matrices]


def decode_steps(engine: CPUEngine, streams: int) -> Callable[[], object]:
    caches = [engine.new_cache(4096) for _ in range(streams)]
    for i, cache in enumerate(caches):
        engine.prefill(cache, list(range(100 + i, 132 + i)))

    def step() -> None:
        if caches[0].length >= 4000:
            for cache in caches:
                engine.truncate(cache, 32)
        engine.decode(caches, [7] * streams)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded SmolLM2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64, help="decode steps a round")
    args = parser.parse_args()
    if not int8_kernels.available():
        raise SystemExit("this CPU lacks AVX-512 VNNI and AVX2: no int8 activations to compare")
    print(f"{'products (16 x 2048 x 4096)':32} {'float32 ms':>11} {'int8 ms':>9} {'float32/int8':>13}")
    for qtype in TYPES:
        for rows in (1, 4):
            call = products(qtype, rows)
            best = best_of(args.rounds, {"float32": timed(call, 5), "int8": timed(call, 5)})
            print(f"{qtype.name + f', {rows} row' + ('s' if rows > 1 else ''):32} {best['float32'] * 1e3:11.2f} "
                  f"{best['int8'] * 1e3:9.2f} {best['float32'] / best['int8']:13.2f}")
    gguf = GGUFFile(args.model or default_model_path())
    engine = CPUEngine(gguf, ModelConfig.from_gguf(gguf))
    print(f"\n{gguf.path.name}: decode steps{'':9} {'float32 ms':>11} {'int8 ms':>9} {'float32/int8':>13}")
    for streams in (1, 4):
        step = decode_steps(engine, streams)
        best = best_of(args.rounds, {"float32": timed(step, args.steps), "int8": timed(step, args.steps)})
        print(f"{f'{streams} stream' + ('s' if streams > 1 else ''):32} {best['float32'] * 1e3:11.2f} "
              f"{best['int8'] * 1e3:9.2f} {best['float32'] / best['int8']:13.2f}")


if __name__ == "__main__":
    main()
