"""Long prompts on the NumPy engine: attention's scores written into one buffer a pass and its
softmax split between the CPUs, each toggled, in one process with alternating rounds (best of each
side kept; the machine's speed drifts within minutes):

- `now`: both; `one thread`: scores in the buffer, the softmax on the calling thread;
  `new arrays`: a new scores array a layer, the softmax split; `before`: neither.
- One layer's attention for a 256-token prompt chunk after each of --contexts cached positions,
  with the model's heads, and the model's prefill of a --prompt-tokens prompt (its chunks, as the
  server runs them).

    python scripts/bench_long_prompt.py [--model PATH] [--rounds N] [--prompt-tokens N] [--contexts A,B]
"""

from __future__ import annotations

import lmserve  # noqa: F401  (first: it tunes OpenBLAS before NumPy loads, as the server does)

# isort: split
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_rounds import best_of, best_prefill, timed  # noqa: E402  (scripts/, this script's own directory)

from lmserve.engine_cpu import ops  # noqa: E402
from lmserve.model.config import ModelConfig  # noqa: E402
from lmserve.model.default_model import default_model_path  # noqa: E402
from lmserve.model.gguf_file import GGUFFile  # noqa: E402

CHUNK = 256
TAKE, THREADED = ops.Scratch.take, ops.THREADED_SCORES


def _new_array(_: ops.Scratch, shape: tuple[int, ...]) -> np.ndarray:
    return np.empty(shape, np.float32)


def _side(buffer: bool, split: bool) -> None:
    ops.Scratch.take = TAKE if buffer else _new_array
    ops.THREADED_SCORES = THREADED if split else 1 << 62


SIDES = {"now": lambda: _side(True, True), "one thread": lambda: _side(True, False),
         "new arrays": lambda: _side(False, True), "before": lambda: _side(False, False)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded SmolLM2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--contexts", default="4096,9000", help="cached positions before the one-layer chunk")
    args = p.parse_args()
    model = args.model or default_model_path()
    config = ModelConfig.from_gguf(GGUFFile(model))
    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim = config.n_heads, config.n_kv_heads, config.head_size(0)
    rows = []
    for start in (int(c) for c in args.contexts.split(",")):
        q = rng.standard_normal((CHUNK, heads, head_dim)).astype(np.float32)
        keys, values = (rng.standard_normal((kv_heads, start + CHUNK, head_dim)).astype(np.float32) for _ in range(2))
        scratch = ops.Scratch()  # a pass's: its first layer grows it, the others reuse it
        best = best_of(args.rounds, timed(lambda q=q, k=keys, v=values, s=start, b=scratch:
                                          ops.attention(q, k, v, s, 0.125, scratch=b), 5), SIDES)
        rows.append((f"one layer's attention, {CHUNK} tokens after {start}", best, "ms", 1e3))
    _, _, best = best_prefill(model, args.prompt_tokens, args.rounds, SIDES)
    rows.append((f"prefill, {args.prompt_tokens} tokens", {k: args.prompt_tokens / v for k, v in best.items()},
                 "tok/s", 1.0))
    print(f"{'':48}" + "".join(f"{name:>12}" for name in SIDES) + f"{'now/before':>12}")
    for label, best, unit, factor in rows:
        ratio = best["now"] / best["before"] if unit == "tok/s" else best["before"] / best["now"]
        print(f"{label + f' ({unit})':48}" + "".join(f"{best[name] * factor:12.2f}" for name in SIDES) + f"{ratio:12.2f}")


if __name__ == "__main__":
    main()
