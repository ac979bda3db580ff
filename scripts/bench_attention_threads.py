"""A decode step's attention over a float32 cache (`row_attention_kernel`) with its (row, KV
head) units on the calling thread against the kernels' threads, at several context lengths: one
decode row over each layer's own cache in turn (a step reads every layer's keys and values once,
from memory rather than cache), in alternating rounds (best of each side kept). With --against REV,
also that git revision's kernel on the kernels' threads, loaded beside this checkout's.

    python scripts/bench_attention_threads.py [--heads 16 --kv-heads 4 --layers 12] [--rounds N] [--against REV]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_rounds import best_of, load_revision, timed  # noqa: E402

from lmserve.engine_cpu.row_attention_kernel import PARALLEL_SCORES, attend_serial, attend_threaded  # noqa: E402

CONTEXTS = (64, 128, 256, 512, 1024, 2048, 4096)
HEAD_DIM = 64


def step_seconds(heads: int, kv_heads: int, layers: int, rounds: int, context: int,
                 kernel: dict[str, Callable]) -> dict[str, float]:
    """Each side's (`kernel`'s) best seconds for one decode row's attention over `layers` caches
    of `context` positions."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, heads, HEAD_DIM)).astype(np.float32)
    caches = [[rng.standard_normal((kv_heads, context, HEAD_DIM)).astype(np.float32) for _ in range(2)]
              for _ in range(layers)]
    out = np.empty((1, heads, HEAD_DIM), np.float32)
    no_sinks = np.empty(0, np.float32)
    side = ["serial"]

    def step() -> None:
        for keys, values in caches:
            kernel[side[0]](q, keys, values, context - 1, np.float32(0.125), 0, no_sinks, out)

    sides = {name: (lambda name=name: side.__setitem__(0, name)) for name in kernel}
    return best_of(rounds, timed(step, 20), sides)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, nargs="*", default=[16, 9], help="query heads of each shape")
    p.add_argument("--kv-heads", type=int, nargs="*", default=[4, 3], help="KV heads of each shape")
    p.add_argument("--layers", type=int, nargs="*", default=[12, 30], help="layers of each shape")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--against", default=None, metavar="REV", help="also time this git revision's threaded kernel")
    args = p.parse_args()
    kernel = {"serial": attend_serial, "threaded": attend_threaded}
    with tempfile.TemporaryDirectory() as directory:
        if args.against:
            then = load_revision(args.against, "lmserve/engine_cpu/row_attention_kernel.py", Path(directory))
            kernel[args.against] = then.attend_threaded
        print(f"threaded from {PARALLEL_SCORES} scores (positions x query heads)")
        against = f"{f'{args.against} ms':>13}{f'{args.against}/threaded':>20}" if args.against else ""
        print(f"{'heads/kv, layers':18}{'positions':>10}{'serial ms':>12}{'threaded ms':>13}{'serial/threaded':>17}{against}")
        for heads, kv_heads, layers in zip(args.heads, args.kv_heads, args.layers, strict=True):
            for context in CONTEXTS:
                best = step_seconds(heads, kv_heads, layers, args.rounds, context, kernel)
                then = (f"{best[args.against] * 1e3:13.3f}{best[args.against] / best['threaded']:20.2f}"
                        if args.against else "")
                print(f"{f'{heads}/{kv_heads}, {layers}':18}{context:>10}{best['serial'] * 1e3:12.3f}"
                      f"{best['threaded'] * 1e3:13.3f}{best['serial'] / best['threaded']:17.2f}{then}", flush=True)


if __name__ == "__main__":
    main()
