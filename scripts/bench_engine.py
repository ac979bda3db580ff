"""Benchmark an engine on one model: startup, prompt and decode speed against the memory-bandwidth bound.

Decode reads every weight once per step, so the fastest possible single-stream decode is the
memory bandwidth divided by the bytes of weights a token reads. The bandwidth is measured in the
same run (machines and their neighbours vary), with the kernel decode itself uses: a BLAS
matrix-vector product over a matrix much larger than the caches.

    python scripts/bench_engine.py [--engine cpu|cpu-float32|mlx] [--model PATH ...] [--rounds N] [--grammar] [--speculate]

With several models, a summary table follows their reports (on MLX: the best of `--rounds`
interleaved runs of the engine and of mlx-lm's `generate_step` on the same model object).
"""

from __future__ import annotations

import lmserve  # noqa: F401  (first: it tunes OpenBLAS before NumPy loads, as the server does)

# isort: split
import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from lmserve.chat.grammar import Grammars
from lmserve.chat.grammar_sources import output_grammar
from lmserve.core.types import OutputFormat
from lmserve.engine.protocol import Engine
from lmserve.model.config import ModelConfig
from lmserve.model.default_model import default_model_path
from lmserve.model.gguf_file import GGUFFile
from lmserve.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from lmserve.engine_mlx import MLXEngine

T = TypeVar("T")
BANDWIDTH_BYTES = 512 << 20  # 16x the largest L3 cache on the machines we bench on
KQUANT_FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "data" / "fixtures" / "tiny-llama" / "tiny-llama-Q4_K_M.gguf"
READY_CHILD = """
import sys
from lmserve.cli import seconds_since_process_start
from lmserve.engine_mlx import MLXEngine
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile
gguf = GGUFFile(sys.argv[1])
engine = MLXEngine(gguf, ModelConfig.from_gguf(gguf))
source = engine.weights_from
tag = "cached" if source.startswith("cache ") else "converted" if "converted" in source else "native"
print(seconds_since_process_start(), tag)
"""


@dataclass
class Loaded:
    """An engine ready to run, and the weight bytes one decoded token reads."""

    engine: Engine
    bytes_per_token: int


def load_cpu(gguf: GGUFFile, config: ModelConfig, quantized: bool | None = None) -> Loaded:
    """The NumPy engine: a token reads every matrix, and of the embeddings only its own row
    unless they double as the output head."""
    from lmserve.engine_cpu import CPUEngine

    engine = CPUEngine(gguf, config, quantized=quantized)
    skipped = 0 if config.tied_embeddings else engine.weights.embed.nbytes
    return Loaded(engine, engine.weight_bytes - skipped)


def load_cpu_float32(gguf: GGUFFile, config: ModelConfig) -> Loaded:
    """The NumPy engine on float32 weights throughout: the baseline of its quantized kernels."""
    return load_cpu(gguf, config, quantized=False)


def load_mlx(gguf: GGUFFile, config: ModelConfig) -> Loaded:
    """The MLX engine; a token reads the same weights as on the NumPy engine."""
    from mlx.utils import tree_flatten

    from lmserve.engine_mlx import MLXEngine

    engine = MLXEngine(gguf, config)
    embed = tree_flatten(engine.model.model.embed_tokens.parameters())
    skipped = 0 if config.tied_embeddings else sum(v.nbytes for _, v in embed)
    return Loaded(engine, engine.weight_bytes - skipped)


LOADERS: dict[str, Callable[[GGUFFile, ModelConfig], Loaded]] = {
    "cpu": load_cpu, "cpu-float32": load_cpu_float32, "mlx": load_mlx}


def seconds_to_ready(args: argparse.Namespace) -> float:
    """Wall time from launching a fresh Python to its engine being ready, interpreter start-up
    and imports included, timed by this process. (psutil's `create_time` is not precise enough
    on Linux: it adds the boot time in whole seconds, measured here as 0.76 s off.)"""
    command = [sys.executable, __file__, "--engine", args.engine, "--probe-ready"]
    if args.model:
        command += ["--model", str(args.model)]
    start = time.perf_counter()
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as probe:
        assert probe.stdout is not None
        ready = probe.stdout.readline().strip() == "ready"
        elapsed = time.perf_counter() - start
    if not ready:
        raise SystemExit("the start-up probe failed")
    return elapsed


def load(args: argparse.Namespace) -> tuple[Loaded, ModelConfig]:
    gguf = GGUFFile(args.model or default_model_path())
    config = ModelConfig.from_gguf(gguf)
    return LOADERS[args.engine](gguf, config), config


def measure_bandwidth() -> tuple[float, float]:
    """Bytes per second: (BLAS matrix-vector read, NumPy copy read + write), best of 5."""
    matrix = np.ones((BANDWIDTH_BYTES // 4 // 4096, 4096), dtype=np.float32)
    vector = np.ones(4096, dtype=np.float32)
    copy = np.empty_like(matrix)
    gemv, copied = [], []
    for _ in range(5):
        start = time.perf_counter()
        matrix @ vector
        gemv.append(time.perf_counter() - start)
        start = time.perf_counter()
        np.copyto(copy, matrix)
        copied.append(time.perf_counter() - start)
    return matrix.nbytes / min(gemv), 2 * matrix.nbytes / min(copied)


def bench_prompt(engine: Engine, ids: list[int]) -> float:
    cache = engine.new_cache(len(ids))
    start = time.perf_counter()
    engine.prefill(cache, ids)
    return len(ids) / (time.perf_counter() - start)


def bench_decode(engine: Engine, prompt: list[int], steps: int, streams: int) -> tuple[float, float]:
    """Aggregate tokens per second of greedy decoding `streams` sequences together, and the fastest
    step in seconds (neighbours' load only ever slows a step down: on a shared machine the fastest
    step is the one to compare across runs)."""
    caches = [engine.new_cache(len(prompt) + steps + 1) for _ in range(streams)]
    tokens = [int(engine.prefill(c, prompt[i:]).argmax()) for i, c in enumerate(caches)]
    fastest = float("inf")
    start = time.perf_counter()
    for _ in range(steps):
        step = time.perf_counter()
        tokens = engine.decode(caches, tokens).argmax(-1).tolist()
        fastest = min(fastest, time.perf_counter() - step)
    return streams * steps / (time.perf_counter() - start), fastest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=sorted(LOADERS), default="cpu")
    parser.add_argument("--model", type=Path, nargs="*", default=[],
                        help="GGUF files, benched one after another (default: the embedded SmolLM2)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=4, help="sequences in the batched decode row")
    parser.add_argument("--kquant", type=Path, default=KQUANT_FIXTURE,
                        help="mlx: the K-quant GGUF whose cold (converting) and warm (cached) start is timed")
    parser.add_argument("--rounds", type=int, default=3, help="mlx: interleaved runs against mlx-lm, best kept")
    parser.add_argument("--grammar", action="store_true", help="also time a JSON-schema grammar per token")
    parser.add_argument("--speculate", action="store_true",
                        help="also time greedy replies through the scheduler with prompt lookup against without")
    parser.add_argument("--probe-ready", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = args.model or [None]
    if args.probe_ready:  # the child of seconds_to_ready
        load(argparse.Namespace(**{**vars(args), "model": models[0]}))
        print("ready", flush=True)
        return
    bandwidth = measure_bandwidth()
    summary = [bench_model(argparse.Namespace(**{**vars(args), "model": model}), bandwidth, first=i == 0)
               for i, model in enumerate(models)]
    if len(summary) > 1:
        print_summary(summary, args)


def bench_model(args: argparse.Namespace, bandwidth: tuple[float, float], first: bool) -> dict[str, object]:
    """One model's full report, printed; returns its line of the summary table."""
    ready_s = seconds_to_ready(args)
    load_start = time.perf_counter()
    loaded, config = load(args)
    load_s = time.perf_counter() - load_start
    engine = loaded.engine

    prompt = np.random.default_rng(0).integers(min(100, config.vocab_size // 2), config.vocab_size,
                                               args.prompt_tokens).tolist()
    decode_prompt = prompt[:32]

    def direct() -> tuple[float, float, float, float, float]:
        engine.prefill(engine.new_cache(8), prompt[:8])  # warm up: BLAS threads, first-call setup
        return (bench_prompt(engine, prompt), *bench_decode(engine, decode_prompt, args.decode_tokens, 1),
                *bench_decode(engine, decode_prompt, args.decode_tokens // 2, args.streams))

    prompt_tps, decode_tps, decode_step, batch_tps, batch_step = on_a_thread_that_ends(direct)
    gemv_bw, copy_bw = bandwidth
    bound = gemv_bw / loaded.bytes_per_token

    rows = [
        ("engine", f"{engine.name}: {engine.device}"),
        ("model", f"{config.name} ({config.architecture}, {config.n_params / 1e6:.0f}M params, "
                  f"{', '.join(f'{k}x{v}' for k, v in config.quant_mix.items())})"),
        ("process start to ready", f"{ready_s:.2f} s (engine load alone {load_s:.2f} s)"),
        ("resident weights", f"{engine.weight_bytes / 1e6:.0f} MB"),
        ("prompt", f"{prompt_tps:.1f} tok/s ({args.prompt_tokens} tokens)"),
        ("decode, 1 stream", f"{decode_tps:.1f} tok/s, {1e3 / decode_tps:.1f} ms a step, fastest "
                             f"{decode_step * 1e3:.1f} ms ({args.decode_tokens} tokens greedy)"),
        (f"decode, {args.streams} streams", f"{batch_tps:.1f} tok/s aggregate, {1e3 * args.streams / batch_tps:.1f} "
                                            f"ms a step, fastest {batch_step * 1e3:.1f} ms"),
        ("memory bandwidth", f"{gemv_bw / 1e9:.1f} GB/s BLAS matrix-vector read "
                             f"(NumPy copy: {copy_bw / 1e9:.1f} GB/s read + write)"),
        ("weights read per token", f"{loaded.bytes_per_token / 1e6:.0f} MB"),
        ("bandwidth bound", f"{bound:.1f} tok/s"),
        ("decode / bound", f"{decode_tps / bound:.2f}"),
    ]
    line: dict[str, object] = {"model": Path(args.model or default_model_path()).name, "load": load_s,
                               "ready": ready_s, "prompt": prompt_tps, "decode": decode_tps, "batch": batch_tps}
    if args.engine == "mlx":
        mlx, best = mlx_rows(engine, prompt, decode_prompt, args, starts=first)
        rows += mlx
        line |= best
    if args.grammar:
        rows += grammar_rows(engine, args)
    if args.speculate:
        rows += speculate_rows(engine, args)
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    print(flush=True)
    return line


def on_a_thread_that_ends(fn: Callable[[], T]) -> T:
    """`fn()` on a thread of its own, which then ends. libgomp keeps a team of threads for each
    thread that ran a parallel region, and once it has more threads than cores they stop spinning
    between regions: the NumPy engine's kernels would then run slower on the scheduler's thread
    (--speculate) than in a server, whose one worker thread runs them all."""
    outcome: list[T | BaseException] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:  # noqa: BLE001  (raised again on the calling thread)
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def print_summary(lines: list[dict[str, object]], args: argparse.Namespace) -> None:
    """One row per model; on MLX the best-of-rounds figures against mlx-lm's own loop."""
    columns = [("model", "{}"), ("ready", "{:.2f} s"), ("load", "{:.2f} s"), ("prompt", "{:.0f} tok/s"),
               ("decode", "{:.0f} tok/s")]
    if args.engine == "mlx":
        columns += [("greedy", "{:.0f} tok/s"), ("mlx-lm decode", "{:.0f} tok/s"), ("decode ratio", "{:.3f}"),
                    ("mlx-lm prompt", "{:.0f} tok/s"), ("prompt ratio", "{:.3f}"), ("same ids", "{}")]
    cells = [[fmt.format(line[key]) for key, fmt in columns] for line in lines]
    widths = [max(len(key), *(len(row[i]) for row in cells)) for i, (key, _) in enumerate(columns)]
    print(f"{args.engine}: {args.prompt_tokens}-token prompt, {args.decode_tokens} greedy tokens"
          + (f", best of {args.rounds} interleaved rounds" if args.engine == "mlx" else ""))
    for row in [[key for key, _ in columns], *cells]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


# -- grammar: llguidance's mask and consume per token against one decode step -------------------

GRAMMAR_SCHEMA = {"type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "minItems": 8, "items": {"type": "object", "required": ["name", "count"], "properties": {
        "name": {"type": "string"}, "count": {"type": "integer"}}}}}}


def grammar_rows(engine: Engine, args: argparse.Namespace) -> list[tuple[str, str]]:
    """Greedy decode under a JSON-schema grammar, the grammar's share (bitmask, -inf fill, consume)
    timed apart from the engine's decode step; plus compiling it cold and from the cache."""
    tokenizer = Tokenizer.from_gguf(GGUFFile(args.model or default_model_path()))
    grammars = Grammars(tokenizer)
    source = output_grammar(OutputFormat("json_schema", GRAMMAR_SCHEMA, "bench"))
    start = time.perf_counter()
    grammar = grammars.compile(source)
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    grammars.compile(source)
    cached_s = time.perf_counter() - start
    prompt = tokenizer.encode("<|im_start|>user\nList fruits and counts as JSON.<|im_end|>\n<|im_start|>assistant\n")
    constraint = grammar.constraint()
    assert constraint is not None
    cache = engine.new_cache(len(prompt) + args.decode_tokens + 1)
    logits = engine.prefill(cache, prompt)
    grammar_s = decode_s = 0.0
    steps = 0
    while steps < args.decode_tokens and not constraint.finished:
        start = time.perf_counter()
        token = int(np.argmax(constraint.mask(logits)))
        constraint.consume(token)
        grammar_s += time.perf_counter() - start
        start = time.perf_counter()
        logits = engine.decode([cache], [token])[0]
        decode_s += time.perf_counter() - start
        steps += 1
    return [
        ("grammar compile", f"{cold_s * 1e3:.0f} ms cold (with llguidance's tokenizer), "
                            f"{cached_s * 1e6:.0f} us cached"),
        ("grammar per token", f"{grammar_s / steps * 1e3:.2f} ms against a {decode_s / steps * 1e3:.1f} ms decode "
                              f"step over {steps} tokens"),
        ("grammar / decode step (< 10%)", f"{grammar_s / decode_s:.1%}"),
    ]


# -- mlx: the engine against mlx-lm's own generation loop on the same weights ------------------


def bench_greedy(engine: MLXEngine, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Single-stream greedy decode on the device path the scheduler uses when it can."""
    cache = engine.new_cache(len(prompt) + steps + 1)
    tokens = [int(engine.prefill(cache, prompt).argmax())]
    start = time.perf_counter()
    for _ in range(steps):
        tokens.append(int(engine.decode_argmax([cache], tokens[-1:])[0]))
    return steps / (time.perf_counter() - start), tokens


def bench_mlx_lm(engine: MLXEngine, prompt: list[int], steps: int) -> tuple[float, float, list[int]]:
    """mlx-lm's `generate_step` on the engine's model and stream: prompt tok/s (to its first
    token), decode tok/s, and the greedy ids."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    start = time.perf_counter()
    generator = generate_step(mx.array(prompt), engine.model, stream=engine.stream, max_tokens=steps + 1)
    tokens = [next(generator)[0]]
    prompt_tps = len(prompt) / (time.perf_counter() - start)
    start = time.perf_counter()
    tokens += [token for token, _ in generator]
    return prompt_tps, steps / (time.perf_counter() - start), tokens


def start_times(path: Path) -> list[tuple[float, str]]:
    """Seconds from process start to a ready MLX engine, cold (empty weight cache) then warm."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache}
        runs = [subprocess.run([sys.executable, "-c", READY_CHILD, str(path)], env=env, check=True,
                               capture_output=True, text=True).stdout.split() for _ in range(2)]
    return [(float(seconds), source) for seconds, source in runs]


def mlx_rows(engine: MLXEngine, prompt: list[int], decode_prompt: list[int], args: argparse.Namespace,
             starts: bool = True) -> tuple[list[tuple[str, str]], dict[str, object]]:
    best = dict.fromkeys(("prompt", "greedy", "mlx-lm prompt", "mlx-lm decode"), 0.0)
    for _ in range(args.rounds):  # interleaved, best of each: the neighbours' load hits both alike
        decode_tps, ours = bench_greedy(engine, decode_prompt, args.decode_tokens)
        _, their_decode_tps, theirs = bench_mlx_lm(engine, decode_prompt, args.decode_tokens)
        runs = (bench_prompt(engine, prompt), decode_tps, bench_mlx_lm(engine, prompt, 1)[0], their_decode_tps)
        best = {key: max(best[key], value) for key, value in zip(best, runs, strict=True)}
    summary = {**best, "decode ratio": best["greedy"] / best["mlx-lm decode"],
               "prompt ratio": best["prompt"] / best["mlx-lm prompt"], "same ids": ours == theirs}
    rows = [
        ("conversion", engine.quant_summary),
        ("greedy decode (device argmax)", f"{best['greedy']:.2f} tok/s; mlx-lm generate_step "
                                          f"{best['mlx-lm decode']:.2f} tok/s (best of {args.rounds})"),
        ("decode ratio (>= 0.95)", f"{summary['decode ratio']:.3f}"),
        ("prompt", f"{best['prompt']:.2f} tok/s; mlx-lm {best['mlx-lm prompt']:.2f} tok/s; "
                   f"ratio {summary['prompt ratio']:.3f}"),
        ("greedy ids equal mlx-lm's", str(ours == theirs)),
    ]
    if starts:
        (cold, cold_from), (warm, warm_from) = start_times(args.kquant)
        rows += [(f"ready, cold ({args.kquant.name})", f"{cold:.2f} s ({cold_from})"),
                 ("ready, warm (weight cache)", f"{warm:.2f} s ({warm_from})")]
    return rows, summary


# -- speculation: prompt lookup against plain decoding, through the real scheduler --------------

SPEC_CODE = '''import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 1

    def total(self) -> float:
        return self.price * self.quantity


@dataclass
class Cart:
    items: list[Item] = field(default_factory=list)

    def add(self, name: str, price: float, quantity: int = 1) -> None:
        for item in self.items:
            if item.name == name:
                item.quantity += quantity
                return
        self.items.append(Item(name, price, quantity))

    def remove(self, name: str) -> None:
        self.items = [item for item in self.items if item.name != name]

    def total(self) -> float:
        return sum(item.total() for item in self.items)

    def save(self, path: Path) -> None:
        data = [{"name": i.name, "price": i.price, "quantity": i.quantity} for i in self.items]
        path.write_text(json.dumps(data, indent=2))

    @classmethod
    def load(cls, path: Path) -> "Cart":
        cart = cls()
        for entry in json.loads(path.read_text()):
            cart.add(entry["name"], entry["price"], entry["quantity"])
        return cart
'''
SPEC_EDIT = f"```python\n{SPEC_CODE}```\n\nRewrite this file with `remove` renamed to `discard`. Output the complete file."
SPEC_STORIES = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
                "Write a short story about a girl who builds a robot out of old bicycle parts.",
                "Write a short story about a chef who loses his sense of taste.",
                "Write a short story about a fox who befriends a lonely farmer."]
# (name, prompts decoded together, tokens per reply)
SPEC_CASES = [("edit (~300-token file)", [SPEC_EDIT], 320), ("story", SPEC_STORIES[:1], 128),
              (f"story, {len(SPEC_STORIES)} streams", SPEC_STORIES, 64)]


def speculate_rows(engine: Engine, args: argparse.Namespace) -> list[tuple[str, str]]:
    """Greedy replies through the runtime and scheduler with `--speculate off` and `ngram`,
    interleaved, best of `--rounds`: decode tok/s from each reply's first text to its end (its
    prefill excluded), and whether both modes wrote the same text."""
    import asyncio

    from lmserve.core.events import Finished, TextDelta
    from lmserve.core.types import ChatRequest, Message, SamplingParams
    from lmserve.model.loader import load_model
    from lmserve.runtime import Runtime
    from lmserve.serving.handle import SpeculationUsage as Usage
    from lmserve.settings import Settings

    model = load_model(args.model or default_model_path())
    greedy = SamplingParams(temperature=0, given=frozenset({"temperature"}))

    async def reply(runtime: Runtime, prompt: str, tokens: int) -> tuple[float, int, str, Usage]:
        handle = runtime.start_chat(ChatRequest([Message("user", prompt)], greedy, tokens))
        first, text, usage = None, [], None
        async for event in handle.events():
            if isinstance(event, TextDelta):
                first = first or time.perf_counter()
                text.append(event.text)
            elif isinstance(event, Finished):
                usage = event.usage
        assert first is not None and usage is not None
        return time.perf_counter() - first, usage.completion_tokens - 1, "".join(text), usage

    def run(mode: str, prompts: list[str], tokens: int) -> tuple[float, list[str], list[Usage]]:
        runtime = Runtime(model, engine, Settings(ctx=2048, kv_slots=len(prompts), batch=len(prompts),
                                                        speculate=mode))
        runtime.scheduler.start()  # not runtime.start(): its warm-up thread would compete with the decode timed

        async def together() -> list[tuple[float, int, str, Usage]]:
            return await asyncio.gather(*(reply(runtime, p, tokens) for p in prompts))

        try:
            replies = asyncio.run(together())
        finally:
            runtime.stop()
        seconds, tokens, texts, usages = zip(*replies, strict=True)
        return sum(tokens) / max(seconds), list(texts), list(usages)

    rows = []
    for name, prompts, tokens in SPEC_CASES:
        best = {"off": 0.0, "ngram": 0.0}
        texts, usages = {}, []
        for _ in range(args.rounds):
            for mode in best:
                tps, texts[mode], usages = run(mode, prompts, tokens)
                best[mode] = max(best[mode], tps)
        drafted, accepted = sum(u.drafted for u in usages), sum(u.accepted for u in usages)
        rows.append((f"speculate: {name}", f"{best['ngram']:.1f} tok/s with ngram, {best['off']:.1f} off: "
                                           f"ratio {best['ngram'] / best['off']:.2f} ({accepted} of {drafted} drafted "
                                           f"accepted; same text: {texts['off'] == texts['ngram']})"))
    return rows


if __name__ == "__main__":
    main()
