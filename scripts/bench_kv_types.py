"""What `--kv-type` costs and saves, engine-direct: bytes a cached position takes, prompt speed, and
decode speed with many positions cached, for each type against the engine's own (`auto`) in the
same run (best of --rounds alternating rounds; these machines are noisy).

    python scripts/bench_kv_types.py [--engine cpu|mlx] [--model PATH] [--cached 512 4096] [--rounds 2]

The peer figure (decode at 16k cached tokens against llama-server's `-ctk q8_0 -ctv q8_0`) comes
from `scripts/bench_peer.py --long-context`.
"""

from __future__ import annotations

import lmserve  # noqa: F401  (first: it tunes OpenBLAS before NumPy loads, as the server does)

# isort: split
import argparse
import sys
import time
from pathlib import Path

import numpy as np

from lmserve.engine.select import load_engine
from lmserve.model.config import ModelConfig
from lmserve.model.default_model import default_model_path
from lmserve.model.gguf_file import GGUFFile

TYPES = ("auto", "f16", "q8_0", "q4_0")
CHUNK = 256  # prompt tokens a pass, as the scheduler prefills


def figures(engine, ids: list[int], cached: list[int], steps: int) -> dict[str, float]:
    """Prompt tok/s over the longest context, then per cached length one stream's decode tok/s."""
    out: dict[str, float] = {}
    for n in cached:
        cache = engine.new_cache(n + steps)
        start = time.perf_counter()
        for i in range(0, n, CHUNK):
            engine.prefill(cache, ids[i:min(i + CHUNK, n)])
        if n == max(cached):
            out["prompt"] = n / (time.perf_counter() - start)
        token = ids[n]
        start = time.perf_counter()
        for _ in range(steps):
            token = int(engine.decode([cache], [token])[0].argmax())
        out[f"decode@{n}"] = steps / (time.perf_counter() - start)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("cpu", "mlx"), default="cpu")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--cached", type=int, nargs="+", default=[512, 4096], help="positions cached before decoding")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per cached length")
    p.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    path = args.model or default_model_path()
    gguf = GGUFFile(path)
    config = ModelConfig.from_gguf(gguf)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, max(args.cached) + 1).tolist()
    engines = {t: load_engine(args.engine, gguf, config, kv_type=t) for t in args.types}
    best: dict[str, dict[str, float]] = {t: {} for t in args.types}
    for r in range(args.rounds):
        for t in args.types if r % 2 == 0 else reversed(args.types):
            for key, value in figures(engines[t], ids, args.cached, args.steps).items():
                best[t][key] = max(best[t].get(key, 0.0), value)
            print(f"round {r + 1} {t}: " + ", ".join(f"{k} {v:.1f}" for k, v in best[t].items()), file=sys.stderr)
    base = best["auto"] if "auto" in best else best[args.types[0]]
    keys = list(base)
    print(f"\n{path.name} on {engines[args.types[0]].device}, best of {args.rounds} alternating rounds; "
          f"each figure as tok/s and its ratio to {engines[args.types[0]].kv_type} (auto)")
    print(f"{'kv type':<8} {'bytes/position':>14}  " + "  ".join(f"{k:>16}" for k in keys))
    for t in args.types:
        cells = "  ".join(f"{best[t][k]:>8.1f} ({best[t][k] / base[k]:.2f}x)" for k in keys)
        print(f"{engines[t].kv_type:<8} {engines[t].kv_bytes_per_token():>14,}  {cells}")


if __name__ == "__main__":
    main()
