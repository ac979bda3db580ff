"""A quantized KV cache's new rows as it stores them, compiled: the 32-point Hadamard turn
(`kv_codec`'s basis), q8_0 blocks with the bytes `gguf`'s quantizer writes, q4_0 blocks with the
bytes of `kv_codec`'s NumPy search for the best scale, and float16 bits.

`gguf.quants.quantize` is NumPy over a handful of whole-array passes plus its own reshaping, about
40 us a call: a decode step writes two of them a layer, so SmolLM2's q8_0 step spent ~2.4 ms of its
~12 there (figures: docs/PERFORMANCE.md, NumPy engine: decode over a quantized cache's blocks).
These are the same arithmetic in one compiled pass a block, which a decode step's attention
(`block_attention_kernel.attend_rows`) calls for each new row without leaving compiled code.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

BLOCK = 32  # values a block holds, and the Hadamard turn's size
_SCALE = np.float32(1 / np.sqrt(BLOCK))  # the turn's normalization: it is its own inverse


@intrinsic
def half_bits(typingctx, value):  # noqa: ANN001, ANN202, ARG001
    """The bits of float32 `value` rounded to float16 (to nearest, ties to even: NumPy's astype)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202, ARG001
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@intrinsic
def half_value(typingctx, bits):  # noqa: ANN001, ANN202, ARG001
    """The float16 with `bits`, as float32."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202, ARG001
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@njit(cache=True, nogil=True)
def turn_blocks(rows):  # noqa: ANN001, ANN201
    """In place: each row of `rows` `[n, 32]` float32 times the orthonormal Sylvester-Hadamard
    matrix (`kv_codec._hadamard`), as a fast Walsh-Hadamard transform: five butterfly passes, 160
    additions a block where the matrix product takes 1,024 multiply-adds. A decode step's turn;
    a prompt's hundreds of rows keep BLAS's product (`KVCodec.turn`), whose roundings the
    fidelity floors were measured with."""
    for i in range(rows.shape[0]):
        row = rows[i]
        span = 1
        while span < BLOCK:
            for lo in range(0, BLOCK, 2 * span):
                for j in range(lo, lo + span):
                    a, b = row[j], row[j + span]
                    row[j], row[j + span] = a + b, a - b
            span *= 2
        for j in range(BLOCK):
            row[j] *= _SCALE


@njit(inline="always", nogil=True)
def _put_scale(d, block):  # noqa: ANN001, ANN202
    """A block's float16 scale `d` (float32, rounded) into its first two bytes, little-endian."""
    bits = half_bits(d)
    block[0], block[1] = np.uint8(bits & np.uint16(255)), np.uint8(bits >> np.uint16(8))


@njit(inline="always", nogil=True)
def q8_0_block(row, block):  # noqa: ANN001, ANN201
    """32 float32 values `row` as one q8_0 block into `block` (34 bytes): d = max |x| / 127 as
    float16 bits, then each x / d rounded half away from zero, as int8 (gguf's `Q8_0`, itself
    ggml's reference: its rounding is floor(a) + floor(2 (a - floor(a))) on |x| / d)."""
    peak = np.float32(0)
    for x in row:
        peak = max(peak, abs(x))
    d = peak / np.float32(127)
    inverse = np.float32(1) / d if d != 0 else np.float32(0)
    _put_scale(d, block)
    for j in range(BLOCK):
        scaled = row[j] * inverse
        a = abs(scaled)
        whole = np.floor(a)
        rounded = whole + np.floor(np.float32(2) * (a - whole))
        block[2 + j] = np.uint8(np.int32(-rounded if scaled < 0 else rounded) & 255)  # int8's bits


@njit(inline="always", nogil=True)
def q4_0_block(row, block, factors):  # noqa: ANN001, ANN201
    """32 float32 values `row` as one q4_0 block into `block` (18 bytes: float16 d, then value j's
    nibble q low in byte j and value j + 16's high, value = d * (q - 8)), d the one of `factors`
    (`kv_codec.Q4_FACTORS`) x the largest magnitude's signed value / -8 with the least squared
    error: `kv_codec._q4_0`'s float32 arithmetic in its order (the error summed as NumPy sums 32
    values: eight running sums, added pairwise; the first of equal errors), so its bytes."""
    peak = row[0]
    for x in row:
        if abs(x) > abs(peak):
            peak = x
    best_error, best_scale = np.float32(np.inf), np.float32(0)
    sums = np.empty(8, np.float32)
    for t in range(len(factors)):
        scale = half_value(half_bits(peak / np.float32(-8) * factors[t]))
        inverse = np.float32(1) / scale if scale != 0 else np.float32(0)
        sums[:] = 0
        for j in range(BLOCK):
            q = min(max(np.trunc(row[j] * inverse + np.float32(8.5)), np.float32(0)), np.float32(15))
            e = (q - np.float32(8)) * scale - row[j]
            sums[j % 8] += e * e
        error = ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]))
        if error < best_error or t == 0:
            best_error, best_scale = error, scale
    _put_scale(best_scale, block)
    inverse = np.float32(1) / best_scale if best_scale != 0 else np.float32(0)
    for j in range(BLOCK // 2):
        low = min(max(np.trunc(row[j] * inverse + np.float32(8.5)), np.float32(0)), np.float32(15))
        high = min(max(np.trunc(row[j + 16] * inverse + np.float32(8.5)), np.float32(0)), np.float32(15))
        block[2 + j] = np.uint8(low) | (np.uint8(high) << np.uint8(4))


@njit(cache=True, nogil=True)
def q8_0_blocks(values, out):  # noqa: ANN001, ANN201
    """`values` `[n, 32]` float32 as q8_0 blocks into `out` `[n, 34]` uint8 (`q8_0_block`)."""
    for i in range(values.shape[0]):
        q8_0_block(values[i], out[i])


@njit(cache=True, nogil=True)
def q4_0_blocks(values, out, factors):  # noqa: ANN001, ANN201
    """`values` `[n, 32]` float32 as q4_0 blocks into `out` `[n, 18]` uint8 (`q4_0_block`)."""
    for i in range(values.shape[0]):
        q4_0_block(values[i], out[i], factors)
