"""How the NumPy engine keeps each GGUF type's matrices in memory, and their values in that form.

Decode reads every weight once a step, so the bytes a value takes decide its speed; each type
keeps the file's own values in the fewest bytes the kernels can read (`qmatrix.ENCODINGS`):

- types of at most 4 bits with evenly spaced levels (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K): packed
  nibbles, 0.5 byte a value plus a float32 scale and offset per block (32; 16 for Q2_K/Q3_K).
  Centered levels are shifted up: Q4_0's `d*(q-8)` becomes `d*q - 8*d`, exact in float32 (a
  float16 times a 4-bit integer, and times 8), Q3_K's `s*(q-4)` likewise.
- every other type `quant_blocks` unpacks (5-, 6- and 8-bit, the IQ4 and MXFP4 tables): int8.
- F16 and BF16: their own 2-byte values (scale 1, offset 0 per 32).

Anything else (F32, other types, tensors whose rows are not whole blocks) is float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from lmserve.engine_cpu.qmatrix import BFLOAT, ENCODINGS, HALF, INT8, NIBBLES
from lmserve.engine_cpu.quant_blocks import SUPPORTED, unpack

_T = GGMLQuantizationType
# Types packed as nibbles -> the level their unpacked int8 values are centered on.
PACKED_ZERO = {_T.Q4_0: 8, _T.Q4_1: 0, _T.Q4_K: 0, _T.Q3_K: 4, _T.Q2_K: 0}
_FLOATS = {_T.F16: HALF, _T.BF16: BFLOAT}
FLOAT_BLOCK = 32  # F16/BF16: values per (unit) scale, the kernels' block
SCALE_BYTES = 8  # a float32 scale and offset per block

Parts = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Encoding:
    """A matrix's form in memory: its values' dtype and the values per scale."""

    dtype: np.dtype
    block: int

    @property
    def bytes_per_value(self) -> float:
        return self.dtype.itemsize / ENCODINGS[self.dtype] + SCALE_BYTES / self.block


def encoding_of(qtype: GGMLQuantizationType, columns: int) -> Encoding | None:
    """How a matrix of `qtype` with rows of `columns` values is kept (None: as float32)."""
    if qtype in PACKED_ZERO:
        return Encoding(NIBBLES, SUPPORTED[qtype])
    if qtype in SUPPORTED:
        return Encoding(INT8, SUPPORTED[qtype])
    if qtype in _FLOATS and columns % FLOAT_BLOCK == 0:
        return Encoding(_FLOATS[qtype], FLOAT_BLOCK)
    return None


def encode(rows: np.ndarray, qtype: GGMLQuantizationType, columns: int) -> Parts:
    """Raw GGUF rows (uint8 `[n, bytes a row]`) -> `q`, `scale`, `offset` as `encoding_of` keeps them."""
    if qtype in _FLOATS:
        q = np.ascontiguousarray(rows).view(_FLOATS[qtype]).reshape(len(rows), columns)
        blocks = (len(rows), columns // FLOAT_BLOCK)
        return q, np.ones(blocks, np.float32), np.zeros(blocks, np.float32)
    q, scale, offset = unpack(rows, qtype, columns)
    if qtype not in PACKED_ZERO:
        return q, scale, offset
    zero = PACKED_ZERO[qtype]
    levels = q.view(np.uint8) + np.uint8(zero)  # 0..15 (uint8 arithmetic wraps -8..-1 right)
    if zero:
        offset = offset - np.float32(zero) * scale
    pairs = levels.reshape(len(q), -1, 2, 16)  # each block of 32: values 0-15, then 16-31
    packed = pairs[:, :, 0] | (pairs[:, :, 1] << np.uint8(4))
    return packed.reshape(len(q), -1), scale, offset
