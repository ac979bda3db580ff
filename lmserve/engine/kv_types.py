"""`--kv-type`: what the KV cache stores keys and values as (llama-server's `-ctk` / `-ctv` names).

A long agent session's KV cache, not its weights, decides how much of it fits in a laptop's
memory: q8_0 keeps about half of float16's bytes at almost no cost in fidelity, q4_0 about a
quarter. Each engine stores the type its own way (the NumPy engine as llama.cpp's blocks, MLX as
its affine quantization); this module holds what both share: the names, what an element costs
(the RAM guard prices slots with it) and which head sizes a block type can take.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lmserve.model.gguf_file import ModelLoadError

AUTO = "auto"  # the engine's own: float32 on NumPy, the compute dtype on MLX


@dataclass(frozen=True)
class KVType:
    """One way of storing cached keys and values."""

    name: str
    block: int  # values sharing one scale (1: plain floats)
    block_bytes: int  # bytes one block takes, its scale included
    bits: int  # bits per value

    @property
    def bytes_per_element(self) -> float:
        return self.block_bytes / self.block

    @property
    def quantized(self) -> bool:
        return self.block > 1


KV_TYPES = {t.name: t for t in (
    KVType("f32", 1, 4, 32),
    KVType("f16", 1, 2, 16),
    KVType("q8_0", 32, 34, 8),  # llama.cpp's: 32 int8 values and a float16 scale
    KVType("q4_0", 32, 18, 4),  # 32 4-bit values (offset by 8) and a float16 scale
)}
KV_TYPE_NAMES = (AUTO, *KV_TYPES)


def check_head_sizes(kv_type: KVType, head_sizes: Iterable[int]) -> None:
    """ModelLoadError when a layer's head size is not a whole number of the type's blocks."""
    odd = sorted({size for size in head_sizes if size % kv_type.block})
    if odd:
        raise ModelLoadError(f"--kv-type {kv_type.name} stores blocks of {kv_type.block} values, and this model's "
                         f"attention heads have {', '.join(map(str, odd))}: choose f16 or f32")
