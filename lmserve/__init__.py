"""lmserve: one GGUF model behind the OpenAI and Anthropic APIs."""

import os

# Before NumPy loads its OpenBLAS: its threads spin 2^28 cycles (~0.1 s) after every product by
# default, holding the cores the NumPy engine's OpenMP kernels run on next. 2^16 (~20 us) costs
# nothing measurable; measured on SmolLM2, 2 cores: an 8-token prompt after 1,100 cached tokens
# took 260 ms by default, 41 ms so (float32 weights: 77 ms), prompt and decode speed unchanged.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")

__version__ = "0.1.0"
