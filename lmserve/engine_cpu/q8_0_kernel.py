"""q8_0 blocks of a pass's new keys and values, compiled: the bytes `gguf`'s quantizer writes.

`gguf.quants.quantize` is NumPy over a handful of whole-array passes plus its own reshaping, about
40 us a call: a decode step writes two of them a layer, so SmolLM2's q8_0 step spent ~2.4 ms of its
~12 there (figures: docs/PERFORMANCE.md, NumPy engine: decode over a quantized cache's blocks).
This is the same arithmetic in one compiled pass a block.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

BLOCK = 32  # values a block holds


@intrinsic
def _half_bits(typingctx, value):  # noqa: ANN001, ANN202, ARG001
    """The bits of float32 `value` rounded to float16 (to nearest, ties to even: NumPy's astype)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202, ARG001
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@njit(cache=True, nogil=True)
def q8_0_blocks(values, out):  # noqa: ANN001, ANN201
    """`values` `[n, 32]` float32 as q8_0 blocks into `out` `[n, 34]` uint8: d = max |x| / 127 as
    float16 bits, then each x / d rounded half away from zero, as int8 (gguf's `Q8_0`, itself
    ggml's reference: its rounding is floor(a) + floor(2 (a - floor(a))) on |x| / d)."""
    for i in range(values.shape[0]):
        row, block = values[i], out[i]
        peak = np.float32(0)
        for x in row:
            peak = max(peak, abs(x))
        d = peak / np.float32(127)
        inverse = np.float32(1) / d if d != 0 else np.float32(0)
        bits = _half_bits(d)
        block[0], block[1] = np.uint8(bits & np.uint16(255)), np.uint8(bits >> np.uint16(8))
        for j in range(BLOCK):
            scaled = row[j] * inverse
            a = abs(scaled)
            whole = np.floor(a)
            rounded = whole + np.floor(np.float32(2) * (a - whole))
            block[2 + j] = np.uint8(np.int32(-rounded if scaled < 0 else rounded) & 255)  # int8's bits
