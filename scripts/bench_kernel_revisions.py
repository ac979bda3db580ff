"""The int8 kernels of this checkout against another git revision's (`int8_kernels.py`), in one process.

The other revision's module is loaded beside this one's, and rounds alternate the two (the engine's
`int8_kernels.times` and `grouped_times` swapped), best of each kept:
- per type and shape, one product of 1, 4, 64 and 256 rows (a decode step's, a prompt chunk's);
- with --model, the model's prefill of --prompt-tokens random tokens and its decode step of one
  and of four streams. The decode steps run the layers' Python path on both sides: the compiled
  layer halves call this checkout's kernels themselves, so with them both sides would time the same
  code.

Needs a CPU with AVX-512 VNNI or AVX2 (int8 activations).

    python scripts/bench_kernel_revisions.py [--against REV] [--model PATH] [--rounds N] [--prompt-tokens N]
"""

from __future__ import annotations

import lmserve  # noqa: F401  (first: it tunes OpenBLAS before NumPy loads, as the server does)

# isort: split
import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_rounds import best_of, best_prefill, load_revision, timed  # noqa: E402  (scripts/, this script's own directory)

from lmserve.engine_cpu import decode_layer, int8_kernels  # noqa: E402
from tests.test_qmatrix import encoded_matrix  # noqa: E402

T = GGMLQuantizationType
PRODUCTS = ((T.Q4_K, 1024, 1024), (T.Q4_K, 4096, 4096), (T.Q3_K, 4096, 4096), (T.Q6_K, 4096, 4096), (T.Q4_0, 4096, 4096))
ROWS = (1, 4, 64, 256)
STREAMS = (1, 4)


def use(times: Callable, grouped_times: Callable) -> Callable[[], None]:
    """A side: the engine's int8 products through these two functions."""
    def choose() -> None:
        int8_kernels.times, int8_kernels.grouped_times = times, grouped_times
    return choose


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", default="HEAD", help="the git revision to compare with (default: HEAD)")
    p.add_argument("--model", type=Path, default=None, help="also time this GGUF's prefill and decode")
    p.add_argument("--prompt-tokens", type=int, default=1100)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if not int8_kernels.available():
        sys.exit("int8 activations need AVX-512 VNNI or AVX2, which this CPU lacks")
    int8_kernels.ENABLED = True
    with tempfile.TemporaryDirectory() as directory:
        then = load_revision(args.against, "lmserve/engine_cpu/int8_kernels.py", Path(directory))
        then.ENABLED = True
        sides = {"here": use(int8_kernels.times, int8_kernels.grouped_times),
                 args.against: use(then.times, then.grouped_times)}
        print(f"ms, this checkout / {args.against}, best of {args.rounds} alternating rounds (ratio > 1: this checkout faster)")
        for qtype, rows, columns in PRODUCTS:
            matrix, _ = encoded_matrix(qtype, rows, columns)
            cells = []
            for n in ROWS:
                x = np.random.default_rng(n).standard_normal((n, columns)).astype(np.float32)
                best = best_of(args.rounds, timed(lambda m=matrix, x=x: m.times(x), max(3, 2 ** 27 // (rows * columns * n))), sides)
                cells.append(f"{n} rows {best['here'] * 1e3:.3f} / {best[args.against] * 1e3:.3f} = {best[args.against] / best['here']:.2f}")
            print(f"{qtype.name:6} {rows:>5} x {columns:<5}  " + "  ".join(cells), flush=True)
        if args.model:
            engine_rows(args, sides)


def engine_rows(args: argparse.Namespace, sides: dict[str, Callable[[], None]]) -> None:
    """The model's prefill and decode steps, each side in turn."""
    engine, ids, best = best_prefill(args.model, args.prompt_tokens, args.rounds, sides)
    print(f"{args.model.name} prefill, {len(ids)} tokens: {len(ids) / best['here']:.0f} / "
          f"{len(ids) / best[args.against]:.0f} tok/s = {best[args.against] / best['here']:.2f}")
    engine._halves = [decode_layer.NONE] * len(engine._halves)  # the products through `use`'s functions
    for streams in STREAMS:
        caches = [engine.new_cache(256) for _ in range(streams)]
        for cache in caches:
            engine.prefill(cache, ids[:100])

        def step(caches: list = caches) -> None:
            engine.decode(caches, [5] * len(caches))
            for cache in caches:
                engine.truncate(cache, 100)

        best = best_of(args.rounds, timed(step, 30), sides)
        print(f"{args.model.name} decode step (Python path), {streams} streams: {best['here'] * 1e3:.2f} / "
              f"{best[args.against] * 1e3:.2f} ms = {best[args.against] / best['here']:.2f}")


if __name__ == "__main__":
    main()
