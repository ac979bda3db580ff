"""A compiled kernel gives the same bits whether this process compiled it or loaded it from
Numba's cache (`lmserve.engine_cpu.numba_linking`): a fresh install's first decode steps and every
later run's agree. Before, `row_attention_kernel`'s decode attention rounded otherwise at 13 of
these 40 cache lengths on its first, compiling run, and so did a model's logits (1e-7 apart)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "darwin", reason="numba is not installed on macOS (MLX serves)")

CHILD = """
import hashlib
import numpy as np
from lmserve.engine_cpu import row_attention_kernel as kernel

heads, kv_heads, head_dim = 4, 2, 16
digest = hashlib.sha256()
for start in range(40, 80):  # one decode row after `start` cached positions
    rng = np.random.default_rng(start)
    qk = rng.standard_normal((1, heads + kv_heads, head_dim), dtype=np.float32)
    v = rng.standard_normal((1, kv_heads, head_dim), dtype=np.float32)
    cos, sin = rng.standard_normal((2, 1, 1, head_dim), dtype=np.float32)
    keys, values = rng.standard_normal((2, kv_heads, 128, head_dim), dtype=np.float32)
    out = np.empty((1, heads, head_dim), np.float32)
    kernel.attend_rows(qk, v, cos, sin, keys, values, start, np.float32(0.25), 0, np.empty(0, np.float32), out)
    digest.update(out.tobytes())
print(digest.hexdigest(), sum(kernel.attend_rows.stats.cache_hits.values()))
"""


def attention_bits(cache: Path) -> tuple[str, int]:
    """The decode attention's outputs (a digest) in a fresh interpreter, and its cache hits."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600,
                          check=True)
    digest, hits = done.stdout.split()
    return digest, int(hits)


def test_a_kernel_loaded_from_the_cache_gives_the_bits_it_gave_when_compiled(tmp_path: Path) -> None:
    compiled, loaded = attention_bits(tmp_path), attention_bits(tmp_path)
    assert (compiled[1], loaded[1] > 0) == (0, True)  # the first run compiled it, the second loaded it
    assert loaded[0] == compiled[0]
