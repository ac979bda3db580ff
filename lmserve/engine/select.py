"""`--engine auto|mlx|cpu`: which engine serves, and building it.

MLX is imported only when it may serve, so a machine without it (or with a broken install)
still runs the NumPy engine. "auto" picks MLX only where MLX has a GPU: on Linux's CPU backend
MLX is correct but several times slower than the NumPy engine (DESIGN.md's measurements).
"""

from __future__ import annotations

from collections.abc import Callable

from lmserve.engine.kv_types import AUTO
from lmserve.engine.protocol import Engine
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile, ModelLoadError

ENGINE_KINDS = ("auto", "mlx", "cpu")


def mlx_gpu_available() -> bool:
    """True when MLX imports and has a Metal or CUDA device."""
    try:
        import mlx.core as mx
    except ImportError:
        return False
    cuda = getattr(mx, "cuda", None)
    return bool(mx.metal.is_available() or (cuda is not None and cuda.is_available()))


def select_engine(kind: str) -> str:
    """Resolve an `--engine` value to "mlx" or "cpu"."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine '{kind}': choose one of {', '.join(ENGINE_KINDS)}")
    if kind == "auto":
        return "mlx" if mlx_gpu_available() else "cpu"
    return kind


def load_engine(kind: str, gguf: GGUFFile, config: ModelConfig,
                progress: Callable[[int, int], None] | None = None, kv_type: str = AUTO,
                cpu_dots: str = AUTO) -> Engine:
    """Build the engine `kind` resolves to, loading the model's weights onto it, its KV cache
    stored as `kv_type`, the NumPy engine's products as `cpu_dots` says (ModelLoadError where
    that engine or model cannot)."""
    if select_engine(kind) == "cpu":
        from lmserve.engine_cpu import CPUEngine

        return CPUEngine(gguf, config, progress, kv_type=kv_type, dots=cpu_dots)
    try:
        from lmserve.engine_mlx import MLXEngine
    except ImportError as exc:
        raise ModelLoadError(f"the MLX engine needs the mlx and mlx-lm packages: {exc}") from None
    return MLXEngine(gguf, config, progress, kv_type=kv_type)
