"""A prompt pass's attention on AMX-BF16 tiles against BLAS's, in one process.

Rounds alternate the two (the tiles' `takes` switched off for BLAS's turn), best of each kept:
- one pass of 512 query positions (4 KV heads of 4 query heads, head size 64: the synthetic MoE's
  shape) after 0, 2,048, 8,192 and 16,384 positions, and the tiles' share spent laying out the
  keys and values ("pack");
- with --model, a prompt's passes (`--prompt-tokens`, 512-token passes as the server runs them).

    python scripts/bench_attention_tiles.py [--model PATH] [--rounds N] [--prompt-tokens N] [--positions 0,2048]
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
from bench_rounds import best_of, chunked_prompt, timed  # noqa: E402  (scripts/, this script's own directory)

from lmserve.engine_cpu import CPUEngine, amx_attention, ops  # noqa: E402
from lmserve.model.config import ModelConfig  # noqa: E402
from lmserve.model.gguf_file import GGUFFile  # noqa: E402

KV_HEADS, GROUP, HEAD, QUERIES = 4, 4, 64, 512
TAKES = amx_attention.takes
SIDES = {"blas": lambda: setattr(amx_attention, "takes", lambda *_: False),
         "tiles": lambda: setattr(amx_attention, "takes", TAKES)}


def attention(start: int) -> tuple[Callable[[], object], Callable[[], object]]:
    """A pass of QUERIES positions after `start` through `ops`' attention (either side), and the
    tiles' layout of its keys and values alone. Keys and values are views of a longer cache."""
    rng = np.random.default_rng(0)
    seen = start + QUERIES
    qg = rng.standard_normal((KV_HEADS, QUERIES * GROUP, HEAD)).astype(np.float32)
    keys, values = (rng.standard_normal((KV_HEADS, seen + 64, HEAD)).astype(np.float32)[:, :seen] for _ in range(2))
    scratch = ops.Scratch()

    def run() -> object:
        return ops.grouped_attention(qg, QUERIES, keys, values, start, HEAD ** -0.5, 0, None, scratch)

    def pack() -> object:
        return [amx_attention._pack(rows.view(np.uint32), is_keys) for rows, is_keys in ((keys, True), (values, False))]  # noqa: SLF001
    return run, pack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF whose prompt passes to time too")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1100)
    parser.add_argument("--positions", default="0,2048,8192,16384", help="positions before the timed pass")
    args = parser.parse_args()
    if not amx_attention.available():
        raise SystemExit("this CPU (or kernel) has no AMX-BF16 tiles to compare")
    print(f"{'positions before a 512-query pass (ms)':40} {'blas':>8} {'tiles':>8} {'blas/tiles':>11} {'pack':>8}")
    for start in (int(p) for p in args.positions.split(",")):
        run, pack = attention(start)
        best = best_of(args.rounds, timed(run, 2), SIDES)
        packing = best_of(args.rounds, timed(pack, 2), {"pack": SIDES["tiles"]})["pack"]
        print(f"{start:40,} {best['blas'] * 1e3:8.2f} {best['tiles'] * 1e3:8.2f} {best['blas'] / best['tiles']:11.2f}"
              f" {packing * 1e3:8.2f}")
    if args.model:
        gguf = GGUFFile(args.model)
        engine = CPUEngine(gguf, ModelConfig.from_gguf(gguf), tune_threads=False)
        best = best_of(args.rounds, timed(chunked_prompt(engine, args.prompt_tokens), 1), SIDES)
        print(f"\n{gguf.path.name}, {args.prompt_tokens}-token prompt: blas {args.prompt_tokens / best['blas']:.0f} tok/s, "
              f"tiles {args.prompt_tokens / best['tiles']:.0f} tok/s, tiles/blas {best['blas'] / best['tiles']:.2f}")
    SIDES["tiles"]()


if __name__ == "__main__":
    main()
