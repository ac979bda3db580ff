"""NumPy implementation of the Engine protocol: runs anywhere, activations and caches in float32."""

from lmserve.engine.protocol import CacheFullError
from lmserve.engine_cpu.cache import CPUCache
from lmserve.engine_cpu.engine import CPUEngine

__all__ = ["CPUCache", "CPUEngine", "CacheFullError"]
