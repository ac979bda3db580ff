"""The NumPy engine's decode step with this checkout's compiled RMSNorm and decode-shaped attention,
against their NumPy forms, in one process (rounds alternate the sides, best of each kept).

Sides: `numpy` (the norm as macOS runs it, scores as queries times keys), `norm` (the compiled
norm), `both` (and the scores of a decode step's few query rows as keys times queries), `one call`
(and a float32 cache's attention as one compiled call a cache, `row_attention_kernel`, up to
`ops.ONE_CALL_POSITIONS` positions), `halves` (and a plain layer's halves as one compiled call each,
`decode_layer`, where int8 activations run). Each at --contexts cached positions, for one and for
four streams; the same bits on the first three sides, and on the last two, within float32 rounding
between them.

    python scripts/bench_decode_paths.py [--model PATH] [--rounds N] [--contexts 100 500 2000 8000] [--kv-type q8_0]
"""

from __future__ import annotations

import lmserve  # noqa: F401  (first: it tunes OpenBLAS before NumPy loads, as the server does)

# isort: split
import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rounds import best_of, timed  # noqa: E402  (scripts/, this script's own directory)

from lmserve.engine_cpu import CPUEngine, decode_layer, ops  # noqa: E402
from lmserve.model.config import ModelConfig  # noqa: E402
from lmserve.model.default_model import default_model_path  # noqa: E402
from lmserve.model.gguf_file import GGUFFile  # noqa: E402

COMPILED_NORM, FEW_QUERY_ROWS, ONE_CALL_POSITIONS = ops._compiled_norm, ops.FEW_QUERY_ROWS, ops.ONE_CALL_POSITIONS


def sides(engine: CPUEngine) -> dict[str, Callable[[], None]]:
    """Each side's settings, applied before its steps."""
    halves = engine._halves

    def side(norm: bool, scores: bool, one_call: bool = False, compiled_halves: bool = False) -> Callable[[], None]:
        def choose() -> None:
            ops._compiled_norm = COMPILED_NORM if norm else (lambda: None)
            ops.FEW_QUERY_ROWS = FEW_QUERY_ROWS if scores else 0
            ops.ONE_CALL_POSITIONS = ONE_CALL_POSITIONS if one_call else 0
            engine._halves = halves if compiled_halves else [decode_layer.NONE] * len(halves)
        return choose

    return {"numpy": side(False, False), "norm": side(True, False), "both": side(True, True),
            "one call": side(True, True, True), "halves": side(True, True, True, True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded SmolLM2)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--contexts", type=int, nargs="+", default=[100, 500, 2000, 8000])
    p.add_argument("--kv-type", default="auto", help="what the cache holds (as the server's --kv-type)")
    args = p.parse_args()
    model = args.model or default_model_path()
    gguf = GGUFFile(model)
    config = ModelConfig.from_gguf(gguf)
    engine = CPUEngine(gguf, config, kv_type=args.kv_type, tune_threads=False)  # sides apart set off trials
    rng = np.random.default_rng(0)
    for context in args.contexts:
        for streams in (1, 4):
            caches = [engine.new_cache(context + 8) for _ in range(streams)]
            for cache in caches:
                engine.prefill(cache, rng.integers(100, config.vocab_size, context).tolist())

            def step(caches: list = caches, context: int = context) -> None:
                engine.decode(caches, [5] * len(caches))
                for cache in caches:
                    engine.truncate(cache, context)

            best = best_of(args.rounds, timed(step, 20), sides(engine))
            base = best["numpy"]
            print(f"{model.name}, {engine.kv_type} KV, {context} cached, {streams} streams: "
                  + ", ".join(f"{name} {seconds * 1e3:.2f} ms ({base / seconds:.2f}x)" for name, seconds in best.items()))


if __name__ == "__main__":
    main()
