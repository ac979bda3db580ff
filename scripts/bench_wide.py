"""Prompt-chunk products on the int8 kernels against dequantizing for BLAS (`QuantMatrix.kernel_rows`), in one process.

Rounds alternate the two (`int8_kernels.wide_rows` swapped for one that sends every product of more
than KERNEL_ROWS rows to BLAS), best of each kept:
- per type and shape, one product of 64, 128 and 256 rows (a prompt chunk's, an expert group's);
- with --model, the model's prefill of --prompt-tokens tokens in its 256-token passes, where the
  kernels' and BLAS's threads take turns.

Needs a CPU with AVX-512 VNNI or AVX2 (int8 activations).

    python scripts/bench_wide.py [--model PATH [--no-products]] [--prompt-tokens N] [--rounds N]
"""

from __future__ import annotations

import lmserve  # noqa: F401  (first: it tunes OpenBLAS before NumPy loads, as the server does)

# isort: split
import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_rounds import best_of, best_prefill, timed  # noqa: E402  (scripts/, this script's own directory)

from lmserve.engine_cpu import int8_kernels  # noqa: E402
from tests.test_qmatrix import encoded_matrix  # noqa: E402

T = GGMLQuantizationType
SHAPES = ((1024, 1024), (2048, 1024), (4096, 4096), (11008, 4096), (4096, 11008))
TYPES = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K, T.Q8_0)
ROWS = (64, 128, 256)
KERNELS = int8_kernels.wide_rows
SIDES = {"kernels": lambda: setattr(int8_kernels, "wide_rows", KERNELS),
         "blas": lambda: setattr(int8_kernels, "wide_rows", lambda values, columns: 0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="also time this GGUF's prefill")
    p.add_argument("--prompt-tokens", type=int, default=1100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-products", action="store_true", help="only the model's prefill")
    args = p.parse_args()
    if not int8_kernels.available():
        sys.exit("int8 activations need AVX-512 VNNI or AVX2, which this CPU lacks")
    int8_kernels.ENABLED = True
    print(f"{'type':6} {'shape':>12}  " + "  ".join(f"{n} rows: kernels/BLAS ms" for n in ROWS))
    for qtype in () if args.no_products else TYPES:
        for shape in SHAPES:
            matrix, _ = encoded_matrix(qtype, *shape)
            cells = []
            for n in ROWS:
                x = np.random.default_rng(n).standard_normal((n, shape[1])).astype(np.float32)
                best = best_of(args.rounds, timed(lambda m=matrix, x=x: m.times(x), 3), SIDES)
                cells.append(f"{best['kernels'] * 1e3:7.2f} / {best['blas'] * 1e3:7.2f} = {best['blas'] / best['kernels']:4.2f}x")
            print(f"{qtype.name:6} {shape[0]:>5} x {shape[1]:<5}  " + "  ".join(cells), flush=True)
    if args.model:
        _, ids, best = best_prefill(args.model, args.prompt_tokens, args.rounds, SIDES)
        print(f"{args.model.name} prefill, {len(ids)} tokens: kernels {len(ids) / best['kernels']:.0f} tok/s, "
              f"BLAS {len(ids) / best['blas']:.0f} tok/s = {best['blas'] / best['kernels']:.2f}x")


if __name__ == "__main__":
    main()
