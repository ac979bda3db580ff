"""Rotary position embedding frequencies, for both engines (as mlx-lm's `initialize_rope` is for
its models): the base frequencies of each rotated pair, divided by the file's `rope_freqs` (Llama
3.x's scaling; Gemma 4's proportional rope, whose 1e30 entries leave pairs unrotated) or a linear
factor, LongRoPE's long factors (Phi-3.5 / Phi-4-mini), or blended by YaRN (gpt-oss, Qwen3 long
context). The NumPy engine rotates with `inv_freq` and `scale`; the MLX engine hands `periods` to
`mx.fast.rope` where mlx-lm's own rope classes would compute them otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lmserve.model.config import ModelConfig, YarnScaling
from lmserve.model.gguf_file import GGUFFile, ModelLoadError

ROPE_FREQS = "rope_freqs.weight"
LONGROPE_FACTORS = "rope_factors_long.weight"


@dataclass(frozen=True)
class Rope:
    """Rotary embedding of the first `2 * len(inv_freq)` dimensions of each head; cos and sin
    are multiplied by `scale` (YaRN's attention factor, 1 otherwise)."""

    inv_freq: np.ndarray  # [rotary_dims // 2], float64
    scale: float = 1.0

    @property
    def periods(self) -> np.ndarray:
        """Per pair, the position divisor of its angle (what `mx.fast.rope(freqs=...)` takes)."""
        return 1.0 / self.inv_freq


def rope_for(gguf: GGUFFile | None, config: ModelConfig, theta: float, linear_factor: float, dims: int,
             freqs: bool) -> Rope:
    """RoPE inverse frequencies for base `theta` over `dims` rotated dimensions; with `freqs` the
    file's `rope_freqs` divide them (Llama 3.x's scaling; Gemma 4's proportional rope, whose 1e30
    entries leave the other dimensions unrotated), Phi-3.5 / Phi-4-mini's `rope_factors_long`
    (LongRoPE) too, and gpt-oss blends them by YaRN."""
    inv_freq = theta ** -(np.arange(0, dims, 2, dtype=np.float64) / dims)
    if freqs:
        divisors = _tensor(gguf, ROPE_FREQS)
        if divisors.shape != inv_freq.shape:
            raise ModelLoadError(f"{ROPE_FREQS} has shape {divisors.shape}, expected ({dims // 2},)")
        inv_freq = inv_freq / divisors
    if linear_factor != 1.0:
        inv_freq = inv_freq / linear_factor
    if config.rope_yarn is not None:
        return _yarn(inv_freq, dims, theta, config.rope_yarn)
    if gguf is not None and LONGROPE_FACTORS in gguf.tensors:
        return _longrope(gguf, config, inv_freq)
    return Rope(inv_freq)


def _longrope(gguf: GGUFFile, config: ModelConfig, inv_freq: np.ndarray) -> Rope:
    """LongRoPE as mlx-lm's SuScaledRoPE applies it (the MLX engine's, so both engines agree):
    the long factors divide every frequency at any length, and cos/sin are scaled by
    sqrt(1 + ln(ctx / original) / ln(original)) when the trained context exceeds the original."""
    original = int(gguf.metadata.get(f"{config.architecture}.rope.scaling.original_context_length",
                                      config.context_length))
    factor = config.context_length / original
    scale = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return Rope(inv_freq / _tensor(gguf, LONGROPE_FACTORS), scale)


def _yarn(inv_freq: np.ndarray, dims: int, theta: float, yarn: YarnScaling) -> Rope:
    """YaRN as Hugging Face's `_compute_yarn_parameters`: each frequency is blended between
    interpolated (divided by the factor) and original by a linear ramp over the dimensions whose
    wavelength lies between beta_fast and beta_slow rotations of the original context, and cos
    and sin are scaled by mscale = 0.1 ln(factor) + 1."""
    def correction_dim(rotations: float) -> float:
        return dims * math.log(yarn.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:  # gpt-oss's own config leaves the range unrounded (ModelConfig says which)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # as Hugging Face: no division by zero
    interpolated = np.clip((np.arange(dims // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    blended = inv_freq / yarn.factor * interpolated + inv_freq * (1 - interpolated)
    mscale = 0.1 * math.log(yarn.factor) + 1.0 if yarn.factor > 1 else 1.0
    return Rope(blended, mscale)


def _tensor(gguf: GGUFFile | None, name: str) -> np.ndarray:
    if gguf is None or name not in gguf.tensors:
        raise ModelLoadError(f"the model's rope scaling needs the {name} tensor, which the file lacks")
    return gguf.dequantize(name).astype(np.float64)
