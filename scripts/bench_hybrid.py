"""A hybrid model (Qwen3.5: Gated DeltaNet beside full attention) against attention only, same shape.

Speed: the qwen35 fixture (8 layers: 6 Gated DeltaNet, 2 gated full attention; hidden 256, 4 heads
of 64, FFN 256) beside a Qwen3 model of its trunk's shape written here with random weights (8
attention layers, the same heads, head size and FFN), both F16, on each engine asked for: prompt
tok/s (one prefill), decode tok/s of 1 and 4 streams, best of alternating rounds, and the ratio
hybrid / attention.

Memory: a slot filled to `--ctx` tokens in 256-token chunks, checkpointed after each as the
scheduler does (`--kv-checkpoints` kept), its bytes (`nbytes`) against the attention model's slot of
the same context; and the same arithmetic for Qwen3.5-35B-A3B (transformers' Qwen3_5MoeTextConfig
defaults, which are that checkpoint's: 40 layers, 10 of them attention with 2 KV heads of 256; 30
Gated DeltaNet with 16 key and 32 value heads of 128) at 65,536 tokens, against the same 40 layers
all attention.

    python scripts/bench_hybrid.py [--engine cpu mlx] [--rounds 3] [--ctx 4096]
"""

from __future__ import annotations

import lmserve  # noqa: F401  (first: it tunes OpenBLAS before NumPy loads, as the server does)

# isort: split
import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from lmserve.engine.protocol import Engine
from lmserve.engine.select import load_engine
from lmserve.model.config import LinearAttention, ModelConfig
from lmserve.model.gguf_file import GGUFFile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.fixture_models import Shape, write_model  # noqa: E402

HYBRID = REPO / "tests" / "data" / "fixtures" / "arch" / "qwen35" / "tiny-qwen35-F16.gguf"
TWIN = Shape(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256, layers=8, qkv_bias=False, qk_norm=True)
CHUNK = 256  # the scheduler's prefill chunk, where it checkpoints
PROMPT, STEPS = 1024, 64
# Qwen3.5-35B-A3B, as transformers' Qwen3_5MoeTextConfig defaults give it (float16 K/V and conv
# window on a GPU; the delta state is float32).
REAL_LAYERS, REAL_ATTENTION = 40, 10
REAL_KV = 2 * 2 * 256 * 2  # K and V, 2 heads of 256, 2 bytes
REAL_LINEAR = LinearAttention(conv_kernel=4, k_heads=16, v_heads=32, head_k_dim=128, head_v_dim=128)
REAL_CTX = 65_536


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", nargs="+", default=["cpu"], choices=["cpu", "mlx"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--kv-checkpoints", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        twin = write_model(Path(tmp) / "tiny-qwen3-twin-F16.gguf", "qwen3", "F16", shape=TWIN)
        for name in args.engine:
            engines = {"qwen35 (hybrid)": load(name, HYBRID, args.kv_checkpoints),
                       "qwen3 (attention)": load(name, twin, args.kv_checkpoints)}
            speed(name, engines, args.rounds)
            memory(name, engines, args.ctx)
    real_model(args.kv_checkpoints)


def load(engine: str, path: Path, checkpoints: int) -> Engine:
    gguf = GGUFFile(path)
    loaded = load_engine(engine, gguf, ModelConfig.from_gguf(gguf))
    loaded.checkpoints_per_cache = checkpoints
    return loaded


def best(rounds: int, engines: dict[str, Engine], measure: Callable[[Engine], float]) -> dict[str, float]:
    """The best of `rounds` alternating measurements of each engine (machines are noisy)."""
    results: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            results[name].append(measure(engine))
    return {name: max(values) for name, values in results.items()}


def prompt_speed(engine: Engine) -> float:
    ids = np.random.default_rng(0).integers(20, engine.config.vocab_size, PROMPT).tolist()
    cache = engine.new_cache(PROMPT + 1)
    start = time.perf_counter()
    for at in range(0, PROMPT, CHUNK):
        engine.prefill(cache, ids[at:at + CHUNK])
    return PROMPT / (time.perf_counter() - start)


def decode_speed(engine: Engine, streams: int) -> float:
    rng = np.random.default_rng(streams)
    caches = [engine.new_cache(PROMPT + STEPS + 1) for _ in range(streams)]
    tokens = []
    for cache in caches:
        tokens.append(int(engine.prefill(cache, rng.integers(20, engine.config.vocab_size, 200).tolist()).argmax()))
    start = time.perf_counter()
    for _ in range(STEPS):
        tokens = engine.decode(caches, tokens).argmax(-1).tolist()
    return streams * STEPS / (time.perf_counter() - start)


def speed(engine: str, engines: dict[str, Engine], rounds: int) -> None:
    print(f"\n## speed, {engine} engine ({next(iter(engines.values())).device}), best of {rounds}")
    print("| figure | qwen35 (hybrid) | qwen3 (attention) | hybrid / attention |\n| --- | ---: | ---: | ---: |")
    figures = {f"prompt, {PROMPT} tokens (tok/s)": prompt_speed,
               "decode, 1 stream (tok/s)": lambda e: decode_speed(e, 1),
               "decode, 4 streams (tok/s)": lambda e: decode_speed(e, 4)}
    for label, measure in figures.items():
        hybrid, attention = best(rounds, engines, measure).values()
        print(f"| {label} | {hybrid:.1f} | {attention:.1f} | {hybrid / attention:.2f} |")


def memory(engine: str, engines: dict[str, Engine], ctx: int) -> None:
    print(f"\n## a slot filled to {ctx} tokens, {engine} engine")
    print("| model | slot bytes | beyond its K/V (states, token ids) | checkpoints kept |\n| --- | ---: | ---: | ---: |")
    sizes = []
    for name, e in engines.items():
        cache = e.new_cache(ctx)
        ids = np.random.default_rng(1).integers(20, e.config.vocab_size, ctx).tolist()
        for at in range(0, ctx, CHUNK):
            e.prefill(cache, ids[at:at + CHUNK])
            e.checkpoint(cache)
        kept = sum(1 for p in range(CHUNK, ctx + 1, CHUNK) if e.resume_point(cache, p) == p)
        kv = e.kv_bytes_per_token() * ctx
        sizes.append(cache.nbytes)
        print(f"| {name} | {mib(cache.nbytes)} | {mib(max(cache.nbytes - kv, 0))} | {kept if e.config.is_hybrid else '-'} |")
    print(f"hybrid / attention: {sizes[0] / sizes[1]:.2f} (arithmetic: {arithmetic(engines, ctx)})")


def arithmetic(engines: dict[str, Engine], ctx: int) -> str:
    hybrid = next(iter(engines.values()))
    return (f"{hybrid.kv_bytes_per_token()} bytes a position x {ctx} + "
            f"({hybrid.checkpoints_per_cache} + 1) x {mib(hybrid.state_bytes())} of state")


def real_model(checkpoints: int) -> None:
    state = (REAL_LAYERS - REAL_ATTENTION) * REAL_LINEAR.state_bytes(2)
    hybrid = REAL_ATTENTION * REAL_KV * REAL_CTX + (checkpoints + 1) * state
    attention = REAL_LAYERS * REAL_KV * REAL_CTX
    print(f"\n## Qwen3.5-35B-A3B at {REAL_CTX} tokens (arithmetic), {checkpoints} checkpoints")
    print(f"one recurrent state {mib(state)}; hybrid slot {mib(hybrid)} "
          f"({mib(REAL_ATTENTION * REAL_KV * REAL_CTX)} K/V + {checkpoints + 1} states); "
          f"the same 40 layers all attention {mib(attention)}; ratio {hybrid / attention:.2f}")


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


if __name__ == "__main__":
    main()
