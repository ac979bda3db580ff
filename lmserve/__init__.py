"""lmserve: one GGUF model behind the OpenAI and Anthropic APIs."""

import os

# Before NumPy loads its OpenBLAS: its threads spin 2^28 cycles (~0.1 s) after every product by
# default, holding the cores the NumPy engine's OpenMP kernels run on next. 2^16 (~20 us) costs
# nothing measurable: a short prompt after a long cached prefix gets much faster, and prompt and
# decode speed stay the same (figures: docs/PERFORMANCE.md, measurements behind code choices).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")

__version__ = "0.1.0"
