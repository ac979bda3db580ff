"""The NumPy engine's decode step over a q8_0, q4_0 or f16 KV cache: attention reading the stored
rows themselves (`block_attention_kernel`, this checkout) against unpacking them into float32
for BLAS first (as before it), and against a float32 cache, in one process (rounds alternate the
sides, best of each kept).

Sides: `blocks`, `floats` (the same cache, `ops.reads_blocks` off), `f32 cache` (another engine on
the same model with a float32 cache of the same prompt). Each at --contexts cached positions, for
one and for four streams (copies of one prefilled cache).

    python scripts/bench_block_attention.py [--model PATH] [--kv-type q8_0] [--rounds N] [--contexts 1000 4000 16000]
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

from lmserve.engine_cpu import CPUEngine, ops  # noqa: E402
from lmserve.model.config import ModelConfig  # noqa: E402
from lmserve.model.default_model import default_model_path  # noqa: E402
from lmserve.model.gguf_file import GGUFFile  # noqa: E402

READS_BLOCKS = ops.reads_blocks


def prefilled(engine: CPUEngine, ids: list[int], streams: int) -> list:
    """`streams` caches holding `ids`: one prefill, copied."""
    first = engine.new_cache(len(ids) + 8)
    engine.prefill(first, ids)
    copies = [engine.new_cache(len(ids) + 8) for _ in range(streams - 1)]
    for copy in copies:
        engine.copy_prefix(first, copy, len(ids))
    return [first, *copies]


def compare(caches: dict[CPUEngine, list], context: int, streams: int, rounds: int) -> dict[str, float]:
    """Each side's least seconds for a decode step of the first `streams` caches of each engine
    (`context` positions each; the quantized engine first)."""
    quantized, f32 = caches
    chosen = [quantized]

    def step() -> None:
        engine = chosen[0]
        engine.decode(caches[engine][:streams], [5] * streams)
        for cache in caches[engine][:streams]:
            engine.truncate(cache, context)

    def side(engine: CPUEngine, blocks: bool) -> Callable[[], None]:
        def choose() -> None:
            chosen[0] = engine
            ops.reads_blocks = READS_BLOCKS if blocks else (lambda rows: False)
        return choose

    sides = {"blocks": side(quantized, True), "floats": side(quantized, False), "f32 cache": side(f32, True)}
    return best_of(rounds, timed(step, 10), sides)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded SmolLM2)")
    p.add_argument("--kv-type", default="q8_0", choices=["q8_0", "q4_0", "f16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--contexts", type=int, nargs="+", default=[1000, 4000, 16000])
    args = p.parse_args()
    model = args.model or default_model_path()
    gguf = GGUFFile(model)
    config = ModelConfig.from_gguf(gguf)
    quantized, f32 = CPUEngine(gguf, config, kv_type=args.kv_type), CPUEngine(gguf, config, kv_type="f32")
    rng = np.random.default_rng(0)
    for context in args.contexts:
        ids = rng.integers(100, config.vocab_size, context).tolist()
        caches = {quantized: prefilled(quantized, ids, 4), f32: prefilled(f32, ids, 4)}
        for streams in (1, 4):
            best = compare(caches, context, streams, args.rounds)
            print(f"{model.name}, {args.kv_type} KV, {context} cached, {streams} streams: "
                  + ", ".join(f"{name} {seconds * 1e3:.2f} ms (blocks {seconds / best['blocks']:.2f}x)"
                              for name, seconds in best.items()), flush=True)


if __name__ == "__main__":
    main()
