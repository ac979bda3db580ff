"""The NumPy engine's attention with the compiled softmax (`softmax_kernel`) against NumPy's, in one process.

Rounds alternate the two (`ops._compiled_softmax` swapped), best of each kept:
- one layer's attention for a 256-token prompt chunk after 0, 768 and 3,840 cached positions,
  with the model's heads;
- the model's prefill of a --prompt-token prompt (its chunks, as the server runs them), and its
  decode step after it.

    python scripts/bench_attention.py [--model PATH] [--rounds N] [--prompt-tokens N]
"""

from __future__ import annotations

import lmserve  # noqa: F401  (first: it tunes OpenBLAS before NumPy loads, as the server does)

# isort: split
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_rounds import best_of, timed  # noqa: E402  (scripts/, this script's own directory)

from lmserve.engine_cpu import CPUEngine, ops  # noqa: E402
from lmserve.model.config import ModelConfig  # noqa: E402
from lmserve.model.default_model import default_model_path  # noqa: E402
from lmserve.model.gguf_file import GGUFFile  # noqa: E402

CHUNK, STARTS = 256, (0, 768, 3840)
COMPILED = ops._compiled_softmax  # noqa: SLF001  (the switch this compares)
SIDES = {"compiled": lambda: setattr(ops, "_compiled_softmax", COMPILED),
         "numpy": lambda: setattr(ops, "_compiled_softmax", lambda: None)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded SmolLM2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=1100)
    args = p.parse_args()
    gguf = GGUFFile(args.model or default_model_path())
    config = ModelConfig.from_gguf(gguf)
    engine = CPUEngine(gguf, config)
    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim = config.n_heads, config.n_kv_heads, config.head_size(0)
    rows = []
    for start in STARTS:
        q = rng.standard_normal((CHUNK, heads, head_dim)).astype(np.float32)
        keys, values = (rng.standard_normal((kv_heads, start + CHUNK, head_dim)).astype(np.float32) for _ in range(2))
        best = best_of(args.rounds, timed(lambda q=q, k=keys, v=values, s=start: ops.attention(q, k, v, s, 0.125), 10), SIDES)
        rows.append((f"one layer's attention, {CHUNK} tokens after {start}", best, "ms", 1e3))
    ids = rng.integers(100, config.vocab_size, args.prompt_tokens).tolist()
    cache = engine.new_cache(args.prompt_tokens + 64)

    def prefill() -> None:
        engine.truncate(cache, 0)
        engine.prefill(cache, ids)

    best = best_of(args.rounds, timed(prefill, 1), SIDES)
    rows.append((f"prefill, {args.prompt_tokens} tokens", {k: args.prompt_tokens / v for k, v in best.items()},
                 "tok/s", 1.0))
    best = best_of(args.rounds, timed(lambda: (engine.decode([cache], [5]), engine.truncate(cache, len(ids))), 30), SIDES)
    rows.append((f"decode step after {args.prompt_tokens} tokens", best, "ms", 1e3))
    print(f"{'':48} {'compiled':>10} {'numpy':>10} {'ratio':>6}")
    for label, best, unit, factor in rows:
        ratio = best["compiled"] / best["numpy"] if unit == "tok/s" else best["numpy"] / best["compiled"]
        print(f"{label + f' ({unit})':48} {best['compiled'] * factor:10.2f} {best['numpy'] * factor:10.2f} {ratio:6.2f}")


if __name__ == "__main__":
    main()
