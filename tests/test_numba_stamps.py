"""A kernel loaded from Numba's cache runs the current code of the kernels it calls in other modules
(`lmserve.engine_cpu.numba_stamps`). Before, after an edit (or a `git pull`) that changed only
`softmax_kernel.py`, `moe_kernel.route`'s cached code still ran the old `_exp`: other weights than
the same source compiled fresh."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lmserve

pytestmark = pytest.mark.skipif(sys.platform == "darwin", reason="numba is not installed on macOS (MLX serves)")

CHILD = """
import numpy as np
from lmserve.engine_cpu import moe_kernel

logits = np.linspace(-3.0, 1.0, 8, dtype=np.float32).reshape(1, 8)
chosen, weights = np.empty((1, 3), np.int64), np.empty((1, 3), np.float32)
moe_kernel.route(logits, False, chosen, weights)
print(weights.tobytes().hex(), sum(moe_kernel.route.stats.cache_hits.values()))
"""


def routed(source: Path, cache: Path) -> tuple[str, int]:
    """The route's weights (hex) in a fresh interpreter running the package under `source`, and
    the route's cache hits."""
    env = {**os.environ, "PYTHONPATH": str(source), "NUMBA_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600,
                          check=True, cwd=source)
    weights, hits = done.stdout.split()
    return weights, int(hits)


def test_a_cached_kernel_runs_the_new_code_of_a_kernel_it_calls(tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(Path(lmserve.__file__).parent, source / "lmserve", ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"
    before = routed(source, cache)
    assert routed(source, cache) == (before[0], 1)  # unchanged sources: loaded from the cache

    softmax = source / "lmserve" / "engine_cpu" / "softmax_kernel.py"
    text = softmax.read_text()
    assert text.count("x = max(x, _LOWEST)\n") == 1
    softmax.write_text(text.replace("x = max(x, _LOWEST)\n", "x = max(x, _LOWEST) * np.float32(0.5)\n"))
    after = routed(source, cache)
    fresh = routed(source, tmp_path / "fresh cache")
    assert (after[1], fresh[1]) == (0, 0)  # compiled again, not loaded
    assert after[0] == fresh[0] != before[0]
