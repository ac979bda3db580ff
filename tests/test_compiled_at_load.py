"""Everything the NumPy engine's passes call is compiled when the engine loads (or loaded from
Numba's cache then), not at a user's first request: a fresh interpreter loads a model, then runs a
prompt of two passes, decode steps of two streams and of one, and a verify pass, and no compiled
function of the engine gains a signature meanwhile. Compiled lazily, a fresh install's first
concurrent streams of the synthetic MoE made 61-64 tok/s against 306-311 (docs/PERFORMANCE.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmserve.model.default_model import default_model_path
from tests.families import Fixture

pytestmark = pytest.mark.skipif(sys.platform == "darwin", reason="numba is not installed on macOS (MLX serves)")

CHILD = """
import importlib, pkgutil, sys
import numpy as np
from numba.core.registry import CPUDispatcher
import lmserve.engine_cpu as package
from lmserve.engine_cpu import CPUEngine
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile

def signatures():
    found = {}
    for module in pkgutil.iter_modules(package.__path__):
        loaded = importlib.import_module(f"lmserve.engine_cpu.{module.name}")
        for name, value in vars(loaded).items():
            if isinstance(value, CPUDispatcher) and value.__module__ == loaded.__name__:
                found[f"{module.name}.{name}"] = set(value.signatures)
    return found

gguf = GGUFFile(sys.argv[1])
engine = CPUEngine(gguf, ModelConfig.from_gguf(gguf), kv_type=sys.argv[2], tune_threads=False)
loaded = signatures()
ids = [int(t) for t in np.random.default_rng(0).integers(3, 200, 600)]
cache = engine.new_cache(1024)
engine.prefill(cache, ids[:512])
engine.prefill(cache, ids[512:])
caches = [engine.new_cache(256) for _ in range(2)]
for c in caches:
    engine.prefill(c, ids[:20])
engine.decode(caches, [5, 6])
engine.decode(caches[:1], [7])
engine.verify(caches, [[8, 9, 10], [11]])
for name, now in sorted(signatures().items()):
    for signature in now - loaded.get(name, set()):
        print(name, signature)
"""


@pytest.mark.parametrize(("model", "kv_type"), [
    (default_model_path, "f32"), (lambda: Fixture("qwen3moe", "Q4_K_M").path, "q8_0"),
    (lambda: Fixture("gemma4", "Q4_K_M").path, "f16")], ids=["SmolLM2", "qwen3moe q8_0 cache", "gemma4 f16 cache"])
def test_a_loaded_engine_compiles_nothing_at_its_first_passes(model: object, kv_type: str, cpu_dots: str) -> None:
    env = {**os.environ, "LMSERVE_CPU_DOTS": cpu_dots}
    result = subprocess.run([sys.executable, "-c", CHILD, str(model()), kv_type], env=env,
                            capture_output=True, text=True, timeout=600, check=True)
    assert result.stdout == "", f"compiled at a first pass, not at load:\n{result.stdout}"
