"""The NumPy engine's prompt passes (the fewest of at most 2,048 rows, evened out: `CPUEngine._pass_rows`)
against passes of 512 rows and a remainder, as before: the prefill of bench_peer.py's cold prompt
(text, not random ids: a MoE model routes text's tokens to fewer experts, whose groups are then
larger) in one process, with alternating rounds (best of each side kept; the machine's speed drifts
within minutes).

    python scripts/bench_prompt_passes.py [--model PATH ...] [--rounds N] [--prompt-tokens N ...]
"""

from __future__ import annotations

import lmserve  # noqa: F401  (first: it tunes OpenBLAS before NumPy loads, as the server does)

# isort: split
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_peer import system_prompt  # noqa: E402  (scripts/, this script's own directory)
from bench_rounds import best_of, timed  # noqa: E402

from lmserve.engine_cpu import CPUEngine  # noqa: E402
from lmserve.model.config import ModelConfig  # noqa: E402
from lmserve.model.default_model import default_model_path  # noqa: E402
from lmserve.model.gguf_file import GGUFFile  # noqa: E402
from lmserve.model.tokenizer import Tokenizer  # noqa: E402

OWN_PASSES = CPUEngine._pass_rows  # noqa: SLF001
SIDES = {"own passes": lambda: setattr(CPUEngine, "_pass_rows", OWN_PASSES),
         "512 rows": lambda: setattr(CPUEngine, "_pass_rows", lambda _self, _position, left: min(left, 512))}


def prefill_rates(engine: CPUEngine, tokenizer: Tokenizer, rounds: int, prompt_tokens: int) -> tuple[int, dict[str, float]]:
    """The prompt's length and each side's best prefill rate (tok/s)."""
    ids = tokenizer.encode(system_prompt(tokenizer, prompt_tokens))
    best = best_of(rounds, timed(lambda: engine.prefill(engine.new_cache(len(ids)), ids), 1), SIDES)
    return len(ids), {side: len(ids) / seconds for side, seconds in best.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, nargs="*", default=[], help="GGUFs (default: the embedded SmolLM2)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, nargs="*", default=[1100, 3000])
    args = p.parse_args()
    print(f"{'prefill (tok/s)':48}" + "".join(f"{side:>12}" for side in SIDES) + f"{'ratio':>12}")
    for model in args.model or [default_model_path()]:
        gguf = GGUFFile(model)
        engine, tokenizer = CPUEngine(gguf, ModelConfig.from_gguf(gguf)), Tokenizer.from_gguf(gguf)
        for prompt_tokens in args.prompt_tokens:
            tokens, rate = prefill_rates(engine, tokenizer, args.rounds, prompt_tokens)
            own, old = rate.values()
            print(f"{f'{model.name}, {tokens} tokens':48}{own:12.1f}{old:12.1f}{own / old:12.2f}", flush=True)


if __name__ == "__main__":
    main()
