"""MLX implementation of the Engine protocol: Metal on Apple Silicon, MLX's CPU backend elsewhere."""

from lmserve.engine_mlx.engine import MLXEngine
from lmserve.engine_mlx.kv import MLXKVCache

__all__ = ["MLXEngine", "MLXKVCache"]
