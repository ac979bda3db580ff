"""A quantized KV cache on MLX (`--kv-type q8_0 / q4_0`): each position's keys and values kept as
MLX's affine quantization (8 or 4 bits, groups of 32 values, a scale and a bias per group in the
compute dtype), packed into one uint32 row per position and head. As on the NumPy engine, each
group is first turned by a 32-point Hadamard transform (`mx.hadamard_transform`), so that a
model's outlier channels do not set their whole group's scale; reading turns it back.

One packed array per layer, `[batch, kv_head, position, words]`, has the shape conventions of a
float one, so mlx-lm's cache classes grow, trim, merge, filter, roll and extract it unchanged (the
classes here only quantize what a step appends and hand attention the float values back). The
model's attention then runs as on a float cache, every family alike (gpt-oss's sinks too, which
mlx-lm's quantized attention refuses); only the cache at rest is quantized, the float copy lives
for one layer of one step.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

GROUP = 32  # values per scale and bias: llama.cpp's q8_0 / q4_0 block size


@dataclass(frozen=True)
class Packing:
    """How a type's keys and values are packed: `bits` per value, scales in `dtype`."""

    bits: int
    dtype: mx.Dtype

    @property
    def bytes_per_element(self) -> float:
        return self.bits / 8 + 2 * self.dtype.size / GROUP

    def pack(self, x: mx.array) -> mx.array:
        """float `[..., head_dim]` -> uint32 `[..., words]`: the values, then each group's scale and bias."""
        values, scales, biases = mx.quantize(_turn(x.astype(self.dtype)), group_size=GROUP, bits=self.bits)
        pairs = mx.stack([scales, biases], axis=-1).reshape(*scales.shape[:-1], -1)
        return mx.concatenate([values, pairs.view(mx.uint32)], axis=-1)

    def unpack(self, packed: mx.array) -> mx.array:
        """uint32 `[..., words]` -> the float `[..., head_dim]` it holds, in `dtype`."""
        words_per_group = GROUP * self.bits // 32 + self.dtype.size // 2  # values, then scale and bias
        head_dim = packed.shape[-1] // words_per_group * GROUP
        split = head_dim * self.bits // 32
        pairs = packed[..., split:].view(self.dtype).reshape(*packed.shape[:-1], head_dim // GROUP, 2)
        return _turn(mx.dequantize(packed[..., :split], pairs[..., 0], pairs[..., 1], group_size=GROUP,
                                   bits=self.bits))


def _turn(x: mx.array) -> mx.array:
    """Each group of `GROUP` values turned by the orthonormal Hadamard transform (its own inverse)."""
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    return mx.hadamard_transform(groups, scale=GROUP ** -0.5).reshape(x.shape)


class Quantized:
    """Mixed into an mlx-lm cache class before it: what a step appends is packed, what attention
    reads is unpacked; everything else (growing, trimming, merging, extracting) is the class's own
    work on the packed rows."""

    packing: Packing

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k, v = self.store(self.packing.pack(keys), self.packing.pack(values))
        return self.packing.unpack(k), self.packing.unpack(v)

    def store(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append rows already packed (a copied prefix, a loaded file); the packed rows attention would see."""
        return super().update_and_fetch(keys, values)  # type: ignore[misc]


class QuantizedKVCache(Quantized, KVCache):
    def __init__(self, packing: Packing) -> None:
        super().__init__()
        self.packing = packing


class QuantizedBatchKVCache(Quantized, BatchKVCache):
    """A batch of quantized rows (made by turning `BatchKVCache.merge`'s result into one)."""

    def extract(self, idx: int) -> KVCache:
        row = super().extract(idx)
        layer = QuantizedKVCache(self.packing)
        layer.keys, layer.values, layer.offset = row.keys, row.values, row.offset
        return layer


def store(layer: KVCache, keys: mx.array, values: mx.array) -> None:
    """Append stored rows to a layer as they are (packed ones stay packed)."""
    if isinstance(layer, Quantized):
        layer.store(keys, values)
    else:
        layer.update_and_fetch(keys, values)
