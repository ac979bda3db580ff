"""Benchmark `--distributed` on loopback: one rank against two (`mlx.launch -n 2 --backend ring`),
tensor parallel and pipeline parallel.

Prompt and decode tokens/s (greedy `decode_argmax`, as the scheduler runs it) through the same
lockstep engine rank 0 serves with, and per rank: the weights it holds, its resident memory once
loaded and its peak (the peak includes loading: a tensor-parallel rank holds its share and one
whole layer at a time, a pipeline rank reads only its layers). The figure that must hold is the per-rank
weight share, about 1/ranks of one rank's.

By default the model is a random-weight Qwen3 written for the run (8 layers, hidden 1024, 16 heads,
8 KV heads, FFN 4096; a tiny vocabulary, so that the replicated embeddings do not hide the split):

    python scripts/bench_distributed.py [--model PATH] [--prompt N] [--decode N] [--modes tensor,pipeline]

On one machine the ranks share its cores and memory bandwidth, so the speeds say what lockstep and
the ring cost, not what two Macs gain; docs/DISTRIBUTED.md has the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.server_util import free_ports  # noqa: E402


def write_model(directory: Path) -> Path:
    """A Qwen3 GGUF of random F16 weights, about 250 MB (tests/fixture_models.py's writer)."""
    from tests import fixture_models

    fixture_models.SHAPES["qwen3"] = dataclasses.replace(
        fixture_models.SHAPES["qwen3"], hidden=1024, heads=16, kv_heads=8, head_dim=64, ffn=4096, layers=8)
    return fixture_models.write_model(directory / "bench-qwen3-F16.gguf", "qwen3", "F16")


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def worker(model: Path, out: Path, prompt: int, decode: int, ranks: int, mode: str) -> None:
    """One rank: load, then (rank 0) time prefill and greedy decode; every rank writes its memory."""
    import mlx.core as mx

    from lmserve.engine_mlx import MLXEngine, distributed
    from lmserve.model.loader import load_model

    loaded = load_model(model)
    engine = (MLXEngine(loaded.gguf, loaded.config) if ranks == 1
              else distributed.load(loaded.gguf, loaded.config, mode))
    rank = 0 if ranks == 1 else distributed.init_group().rank()
    report: dict = {"rank": rank}
    if engine is not None:
        report |= {"weights": engine.weight_bytes, "rss_loaded": rss()}
        vocab = loaded.config.vocab_size
        ids = [(i * 7919) % vocab for i in range(prompt)]
        engine.prefill(engine.new_cache(prompt + decode + 8), ids[:16])  # warm-up
        cache = engine.new_cache(prompt + decode + 8)
        start = time.perf_counter()
        token = int(engine.prefill(cache, ids).argmax())
        report["prompt_tok_s"] = prompt / (time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(decode):
            token = int(engine.decode_argmax([cache], [token])[0])
        report["decode_tok_s"] = decode / (time.perf_counter() - start)
        if ranks > 1:
            report["rank_weights"] = [rank.weight_bytes for rank in engine.ranks]
            engine.close()  # the followers' load() returns
    report["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report["mlx_peak"] = mx.get_peak_memory()
    (out / f"{mode}-rank{rank}-of-{ranks}.json").write_text(json.dumps(report))


def run(model: Path, ranks: int, mode: str, prompt: int, decode: int, out: Path) -> list[dict]:
    args = [str(Path(__file__).resolve()), "--worker", "--model", str(model), "--out", str(out),
            "--prompt", str(prompt), "--decode", str(decode), "--ranks", str(ranks), "--mode", mode]
    if ranks == 1:
        cmd = [sys.executable, *args]
    else:
        launch = Path(sys.executable).parent / "mlx.launch"
        cmd = [str(launch), "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_ports(ranks)),
               "--", sys.executable, *args]
    subprocess.run(cmd, check=True, cwd=REPO, timeout=900)
    return [json.loads((out / f"{mode}-rank{r}-of-{ranks}.json").read_text()) for r in range(ranks)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a GGUF whose heads split 2 ways (default: written)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--decode", type=int, default=64, help="decoded tokens (default 64)")
    p.add_argument("--modes", default="tensor,pipeline", help="the --distributed modes to run (default both)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="tensor", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.model, args.out, args.prompt, args.decode, args.ranks, args.mode)
        return
    with tempfile.TemporaryDirectory(prefix="lmserve-bench-dist-") as tmp:
        os.environ["XDG_CACHE_HOME"] = tmp  # converted weights, if any, stay out of the user's cache
        model = args.model or write_model(Path(tmp))
        runs = [(1, "one"), *((2, mode) for mode in args.modes.split(","))]
        results = {(n, mode): run(model, n, mode, args.prompt, args.decode, Path(tmp)) for n, mode in runs}
    mib = 2 ** 20
    single = results[1, "one"][0]
    print(f"\n{model.name}: {args.prompt}-token prompt, {args.decode} decoded tokens, loopback, "
          f"{os.cpu_count()} cores shared by every rank")
    print(f"{'ranks':>5} {'mode':>8} {'rank':>4} {'prompt tok/s':>12} {'decode tok/s':>12} {'weights MiB':>11} "
          f"{'x one rank':>10} {'RSS loaded':>10} {'RSS peak':>9} {'MLX peak':>9}")
    for (n, mode), reports in results.items():
        for r in reports:
            speed = (f"{r['prompt_tok_s']:>12.1f} {r['decode_tok_s']:>12.1f}" if "prompt_tok_s" in r
                     else f"{'':>12} {'':>12}")
            weights = reports[0].get("rank_weights", [single["weights"]])[r["rank"]]
            loaded = f"{r['rss_loaded'] / mib:>10.0f}" if "rss_loaded" in r else f"{'':>10}"
            print(f"{n:>5} {mode:>8} {r['rank']:>4} {speed} {weights / mib:>11.1f} {weights / single['weights']:>10.2f} "
                  f"{loaded} {r['rss_peak'] / mib:>9.0f} {r['mlx_peak'] / mib:>9.0f}")


if __name__ == "__main__":
    main()
