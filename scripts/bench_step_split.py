"""Where a NumPy-engine decode step's time goes: its quantized-matrix products against the rest.

Sides, alternating in one process (best of each kept): `whole` (the step as it runs), `no products`
(every `kernels.times` / `kernels.grouped_times` call answered at once with a ready array of its
shape: what is left is the Python between the products, attention, norms, rope, routing). A
third pass times each product call inside whole steps and prints them by matrix shape, with the
bytes each reads and the rate that gives; the step's own least time is the baseline of every share.

    python scripts/bench_step_split.py [--model PATH] [--streams 1 4] [--context 60] [--rounds 5]
"""

from __future__ import annotations

import lmserve  # noqa: F401  (first: it tunes OpenBLAS before NumPy loads, as the server does)

# isort: split
import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rounds import best_of, timed  # noqa: E402  (scripts/, this script's own directory)

from lmserve.engine_cpu import CPUEngine, kernels  # noqa: E402
from lmserve.model.config import ModelConfig  # noqa: E402
from lmserve.model.default_model import default_model_path  # noqa: E402
from lmserve.model.gguf_file import GGUFFile  # noqa: E402

PRODUCTS = {"times": kernels.times, "grouped_times": kernels.grouped_times}


def answered_at_once() -> dict[str, Callable[..., np.ndarray]]:
    """Stand-ins for the products: each returns a ready array of the product's shape."""
    ready: dict[tuple[int, int], np.ndarray] = {}

    def result(rows: int, outs: int) -> np.ndarray:
        return ready.setdefault((rows, outs), np.full((rows, outs), 0.01, np.float32))

    return {"times": lambda x, q, *_: result(len(x), len(q)),
            "grouped_times": lambda x, q, *_: result(len(x), q.shape[1])}


def use(products: dict[str, Callable[..., np.ndarray]]) -> None:
    for name, call in products.items():
        setattr(kernels, name, call)


def timed_products(spent: defaultdict[tuple, list[float]]) -> dict[str, Callable[..., np.ndarray]]:
    """The real products, each call counted in `spent` under (kind, matrix shape, dtype): calls,
    seconds and bytes read (a grouped call's: its routed experts')."""
    def wrap(name: str) -> Callable[..., np.ndarray]:
        real = PRODUCTS[name]

        def call(x: np.ndarray, q: np.ndarray, *rest: np.ndarray) -> np.ndarray:
            start = time.perf_counter()
            out = real(x, q, *rest)
            seconds = time.perf_counter() - start
            read = sum(part.nbytes for part in (q, *rest[:3]))
            if name == "grouped_times":  # the stack's bytes: read only the routed experts'
                read = read // len(q) * len(rest[3])
            entry = spent[(name, tuple(q.shape[-2:]), str(q.dtype))]
            entry[0] += 1
            entry[1] += seconds
            entry[2] += read
            return out
        return call
    return {name: wrap(name) for name in PRODUCTS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded SmolLM2)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    p.add_argument("--context", type=int, default=60, help="cached positions a stream starts from")
    p.add_argument("--steps", type=int, default=50, help="steps a timed run makes")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    model = args.model or default_model_path()
    gguf = GGUFFile(model)
    config = ModelConfig.from_gguf(gguf)
    engine = CPUEngine(gguf, config, tune_threads=False)  # the sides' pass times would set trials off
    rng = np.random.default_rng(0)
    sides = {"whole": lambda: use(PRODUCTS), "no products": lambda: use(answered_at_once())}
    for streams in args.streams:
        caches = [engine.new_cache(args.context + args.steps + 16) for _ in range(streams)]
        for cache in caches:
            engine.prefill(cache, rng.integers(100, config.vocab_size, args.context).tolist())

        tokens = rng.integers(100, config.vocab_size, streams).tolist()  # each its own: MoE routes differ

        def run(caches: list = caches, tokens: list = tokens) -> None:
            for _ in range(args.steps):
                engine.decode(caches, tokens)
            for cache in caches:
                engine.truncate(cache, args.context)

        best = best_of(args.rounds, timed(run, 1), sides)
        step = best["whole"] / args.steps
        rest = best["no products"] / args.steps
        print(f"{model.name}, {streams} stream(s): step {step * 1e3:.2f} ms; without the products "
              f"{rest * 1e3:.2f} ms ({rest / step:.0%}); the products {(step - rest) * 1e3:.2f} ms "
              f"({1 - rest / step:.0%})")
        spent: defaultdict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0])
        use(timed_products(spent))
        timed(run, 1)()
        use(PRODUCTS)
        steps = 2 * args.steps  # the warm run and the timed one
        total = sum(seconds for _, seconds, _ in spent.values())
        print(f"  in whole steps, timed one by one: {total / steps * 1e3:.2f} ms a step in "
              f"{sum(n for n, _, _ in spent.values()) // steps} calls")
        for (name, shape, dtype), (calls, seconds, read) in sorted(spent.items(), key=lambda kv: -kv[1][1]):
            print(f"    {name} {shape} {dtype}: {calls // steps} a step, {seconds / calls * 1e6:.1f} us a call, "
                  f"{read / calls / 1e3:.0f} KB read a call, {read / seconds / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
