"""What the in-process A/B benchmarks share: timing a call, the best of alternating rounds (this
machine's speed drifts within minutes, so the two sides take turns), and a model's prefill."""

from __future__ import annotations

import importlib.util
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np

from lmserve.engine_cpu import CPUEngine
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile

REPO = Path(__file__).resolve().parents[1]


def timed(call: Callable[[], object], times: int) -> Callable[[], float]:
    """A run: one warm call (first-call setup, the threads), then the mean seconds of `times` calls."""
    def run() -> float:
        call()
        start = time.perf_counter()
        for _ in range(times):
            call()
        return (time.perf_counter() - start) / times
    return run


def best_of(rounds: int, run: Callable[[], float], sides: dict[str, Callable[[], None]]) -> dict[str, float]:
    """`run`'s least seconds per side over `rounds` rounds, each round setting every side in turn."""
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(rounds):
        for name, choose in sides.items():
            choose()
            best[name] = min(best[name], run())
    return best


def best_prefill(model: Path, tokens: int, rounds: int,
                 sides: dict[str, Callable[[], None]]) -> tuple[CPUEngine, list[int], dict[str, float]]:
    """The NumPy engine on `model`, a prompt of `tokens` random ids (past the first 100, which
    hold special tokens), and each side's least seconds to prefill it into a new cache."""
    gguf = GGUFFile(model)
    config = ModelConfig.from_gguf(gguf)
    engine = CPUEngine(gguf, config)
    ids = np.random.default_rng(0).integers(100, config.vocab_size, tokens).tolist()
    return engine, ids, best_of(rounds, timed(lambda: engine.prefill(engine.new_cache(len(ids)), ids), 1), sides)


def chunked_prompt(engine: CPUEngine, tokens: int) -> Callable[[], None]:
    """A call that prefills a prompt of `tokens` ids into a new cache in 512-token passes, as the
    server feeds a lone prompt."""
    ids = [(7 * i) % engine.config.vocab_size for i in range(tokens)]

    def run() -> None:
        cache = engine.new_cache(tokens + 1)
        for start in range(0, tokens, 512):
            engine.prefill(cache, ids[start:start + 512])
    return run


def load_revision(revision: str, relative: str, directory: Path) -> ModuleType:
    """The module at `relative` (a path in the repository) as it is at git `revision`, loaded
    from `directory` as a module of its own, beside this checkout's."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{relative}"],
                            check=True, capture_output=True, text=True).stdout
    name = Path(relative).stem + "_then"
    path = directory / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
