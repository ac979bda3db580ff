"""NumPy implementation of the Engine protocol: runs anywhere, activations and caches in float32."""

import os

# libgomp (Numba's OpenMP threads) reads this when it loads, under the first import of a kernel
# module: after a parallel region its threads spin this many times (about 0.3 ms here) before
# they sleep. Its default, 300,000 (3.5 ms), held a core while BLAS's two threads ran a prompt's
# attention products next, and half of them took twice as long. A decode step's regions follow
# one another within that time: the MoE's and SmolLM2's steps were no slower, SmolLM2's four-stream
# one faster (docs/PERFORMANCE.md). A value the user set is kept.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")

import lmserve.engine_cpu.numba_linking  # noqa: E402, F401  (before anything compiles)
import lmserve.engine_cpu.numba_stamps  # noqa: E402, F401  (before any kernel is defined)
from lmserve.engine.protocol import CacheFullError  # noqa: E402  (after the setting above)
from lmserve.engine_cpu.cache import CPUCache  # noqa: E402
from lmserve.engine_cpu.engine import CPUEngine  # noqa: E402

__all__ = ["CPUCache", "CPUEngine", "CacheFullError"]
