"""The NumPy engine's cached keys and values in a `--kv-type`: float32, float16, or blocks in
llama.cpp's q8_0 / q4_0 layout (q8_0's bytes are `gguf`'s quantizer's; `kv_encode_kernel` writes
them, and q4_0's, compiled).

Every type is one array per layer, `[kv_head, position, row]`, where a row is one position's
head: `head_dim` floats, or `head_dim / 32` blocks of bytes. So the cache grows, copies a prefix,
saves and loads every type with the same slices on the position axis.

Quantized types store each head's keys and values turned by a 32-point Hadamard transform (an
orthonormal change of basis within each block): a model's few outlier channels otherwise set the
scale of their whole block and round the other 31 values away. Attention turns the query the same
way (q . k is unchanged) and turns its output back, so reading a cache costs no extra pass over
it (figures: docs/PERFORMANCE.md, measurements behind code choices). q4_0 also picks each block's
scale for the least squared error rather than from its largest value alone.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from lmserve.engine.kv_types import KVType

try:  # the blocks, compiled (where Numba is installed: not on macOS, where MLX serves)
    from lmserve.engine_cpu.kv_encode_kernel import q4_0_blocks, q8_0_blocks
except ImportError:
    q4_0_blocks = q8_0_blocks = None

BLOCK = 32  # values per quantized block, and the Hadamard transform's size


def _hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix of size `n` (a power of two): its own inverse."""
    h = np.ones((1, 1), np.float32)
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


_TURN = _hadamard(BLOCK)
Q4_FACTORS = np.linspace(0.7, 1.15, 19, dtype=np.float32)  # q4_0 scales tried, as fractions of max / -8


class KVCodec:
    """Stores and reads back one `KVType`'s rows."""

    def __init__(self, kv_type: KVType) -> None:
        self.type = kv_type
        self.dtype = {"f32": np.float32, "f16": np.float16}.get(kv_type.name, np.uint8)
        self.turned = kv_type.quantized  # stored values are in the Hadamard basis

    def row(self, head_dim: int) -> int:
        """Array elements one position of one head takes."""
        return head_dim // BLOCK * self.type.block_bytes if self.type.quantized else head_dim

    def empty(self, heads: int, positions: int, head_dim: int) -> np.ndarray:
        return np.zeros((heads, positions, self.row(head_dim)), dtype=self.dtype)

    def turn(self, x: np.ndarray) -> np.ndarray:
        """float32 `[..., head_dim]` in the basis this type stores (a new array, or `x` itself)."""
        if not self.turned:
            return x
        return (np.ascontiguousarray(x, dtype=np.float32).reshape(-1, BLOCK) @ _TURN).reshape(x.shape)

    unturn = turn  # the transform is its own inverse

    def encode(self, x: np.ndarray) -> np.ndarray:
        """float32 keys or values `[..., head_dim]` as stored rows."""
        if not self.turned:
            return x.astype(self.dtype, copy=False)
        turned = self.turn(x)
        if q8_0_blocks is None:
            return quantize(turned, GGMLQuantizationType.Q8_0) if self.type.name == "q8_0" else _q4_0(turned)
        out = np.empty((*x.shape[:-1], self.row(x.shape[-1])), np.uint8)
        blocks = turned.reshape(-1, BLOCK), out.reshape(-1, self.type.block_bytes)
        if self.type.name == "q8_0":
            q8_0_blocks(*blocks)
        else:
            q4_0_blocks(*blocks, Q4_FACTORS)
        return out

    def decode(self, stored: np.ndarray) -> np.ndarray:
        """Stored rows `[heads, positions, row]` as float32 `[heads, positions, head_dim]`, in the
        stored basis (what attention reads, its query turned by `turn`)."""
        if self.type.name == "f32":
            return stored
        if not self.type.quantized:
            return stored.astype(np.float32)
        heads, positions, row = stored.shape
        blocks = stored.reshape(heads, positions, row // self.type.block_bytes, self.type.block_bytes)
        scale = np.ascontiguousarray(blocks[..., :2]).view(np.float16).astype(np.float32)
        if self.type.name == "q8_0":
            values = blocks[..., 2:].view(np.int8).astype(np.float32)
        else:  # q4_0: byte j holds value j in its low nibble and value j + 16 in its high one
            packed = blocks[..., 2:]
            values = np.concatenate([packed & np.uint8(15), packed >> np.uint8(4)], axis=-1).astype(np.float32)
            values -= 8
        values *= scale
        return values.reshape(heads, positions, -1)

    def values(self, stored: np.ndarray) -> np.ndarray:
        """Stored rows as the float32 keys or values they hold (converting a saved cache's type)."""
        return self.unturn(self.decode(stored))


def _q4_0(x: np.ndarray) -> np.ndarray:
    """llama.cpp's q4_0 blocks of `x` `[..., head_dim]` (a float16 scale d, then 32 values q in
    nibbles, value = d * (q - 8)), each block's d the one of `Q4_FACTORS` x max / -8 with the
    least squared error."""
    blocks = x.reshape(-1, BLOCK)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[:, None], -1)
    scales = (peak / -8 * Q4_FACTORS).astype(np.float16).astype(np.float32)  # [blocks, tries]
    inverse = np.divide(1, scales, out=np.zeros_like(scales), where=scales != 0)
    q = np.clip(np.trunc(blocks[:, None, :] * inverse[..., None] + np.float32(8.5)), 0, 15)
    error = np.square((q - 8) * scales[..., None] - blocks[:, None, :]).sum(-1)
    best = error.argmin(-1)
    rows = np.arange(len(blocks))
    q, d = q[rows, best].astype(np.uint8), scales[rows, best]
    packed = q[:, :BLOCK // 2] | (q[:, BLOCK // 2:] << np.uint8(4))
    out = np.concatenate([d.astype(np.float16)[:, None].view(np.uint8), packed], axis=-1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // BLOCK * 18)
