"""The NumPy engine's prompt passes of 512 rows against 256: the prefill of bench_peer.py's cold
prompt (text, not random ids: a MoE model routes text's tokens to fewer experts, whose groups
are then larger) in one process, with alternating rounds (best of each side kept; the machine's
speed drifts within minutes).

    python scripts/bench_prompt_passes.py [--model PATH ...] [--rounds N] [--prompt-tokens N]
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

ROWS = (512, 256)


def _rows(n: int) -> None:
    """Every pass `n` rows, whatever the model (`CPUEngine._pass_rows` picks by model and position)."""
    CPUEngine._pass_rows = lambda _self, _position: n  # noqa: SLF001  (the side a round runs)


def prefill_rates(model: Path, rounds: int, prompt_tokens: int) -> tuple[int, dict[int, float]]:
    """The prompt's length and each pass size's best prefill rate (tok/s) on `model`."""
    gguf = GGUFFile(model)
    engine = CPUEngine(gguf, ModelConfig.from_gguf(gguf))
    tokenizer = Tokenizer.from_gguf(gguf)
    ids = tokenizer.encode(system_prompt(tokenizer, prompt_tokens))
    sides = {n: (lambda n=n: _rows(n)) for n in ROWS}
    best = best_of(rounds, timed(lambda: engine.prefill(engine.new_cache(len(ids)), ids), 1), sides)
    return len(ids), {n: len(ids) / seconds for n, seconds in best.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, nargs="*", default=[], help="GGUFs (default: the embedded SmolLM2)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=1100)
    args = p.parse_args()
    print(f"{'prefill (tok/s)':48}" + "".join(f"{f'{n} rows':>12}" for n in ROWS) + f"{'512/256':>12}")
    for model in args.model or [default_model_path()]:
        tokens, rate = prefill_rates(model, args.rounds, args.prompt_tokens)
        print(f"{f'{model.name}, {tokens} tokens':48}" + "".join(f"{rate[n]:12.1f}" for n in ROWS)
              + f"{rate[512] / rate[256]:12.2f}")


if __name__ == "__main__":
    main()
