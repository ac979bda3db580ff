"""Attention's masked softmax as one compiled pass per row, over a range of rows per call.

NumPy's softmax over a pass's scores (`[kv_heads, n * group, seen]`) makes six passes (scale,
causal mask, max, subtract, exp, sum and divide), each over the whole array and on one thread
(figures: docs/PERFORMANCE.md, NumPy engine: prompt passes). Each row reads only the keys its
query sees, so masked scores are never exponentiated. Numba's loops vectorize with reassociated
max and sum, but leave a call to `expf` scalar: `_exp` is Cephes' single-precision exponential
(within 2 ulp), written so that they vectorize too. Rows are divided by their sum, as NumPy does,
not multiplied by its reciprocal: a quantized KV cache's rounding tips with a float's last bits,
and the fidelity tests' counts moved with it. It is not a parallel (OpenMP) loop: on the kernels'
OpenMP threads, the BLAS product after it waited for them to stop spinning (figures: ibid.).
`ops` runs a prompt pass's rows in parts on plain threads, which block instead.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from lmserve.engine_cpu.kernel_ir import LANES, VF, Builder

# Reassociation (the vectorized sum; the largest value is `_scaled_peak`'s vector IR) and
# contraction (FMA); not no-NaN: a NaN score (a model gone wrong) still reaches the output.
_FAST = {"reassoc", "contract", "nsz"}
_LOG2E = np.float32(1.44269504088896341)
_LN2_HIGH, _LN2_LOW = np.float32(0.693359375), np.float32(-2.12194440e-4)  # ln 2 in two parts
_LOWEST = np.float32(-87.0)  # exp of less is below float32's normal range: flushed to about 1.6e-38
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)


@intrinsic
def _pow2(typingctx, k):  # noqa: ANN001, ANN202, ARG001
    """2 ** k as float32 for an int32 k in the normal range: its exponent bits."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202, ARG001
        i32 = ir.IntType(32)
        bits = builder.shl(builder.add(args[0], ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())
    return types.float32(types.int32), codegen


@njit(inline="always", fastmath=_FAST)
def _exp(x):  # noqa: ANN001, ANN202
    """e ** x in float32 for x <= 0: 2 ** k times a polynomial of the remainder."""
    x = max(x, _LOWEST)
    k = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - k * _LN2_HIGH - k * _LN2_LOW
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5  # a loop over a tuple: not vectorized
    return (p * (r * r) + r + np.float32(1.0)) * _pow2(np.int32(k))


@intrinsic
def _scaled_peak(typingctx, row, scale):  # noqa: ANN001, ANN202, ARG001
    """`row` times `scale` in place over its whole vectors of LANES values, and the largest of
    those (-inf for none; a NaN is never the largest), in LLVM vector IR: Numba leaves a loop's
    `max` reduction scalar, 1.4 cycles a value, where the exponentials' pass took 0.5 (figures:
    docs/PERFORMANCE.md, measurements behind code choices)."""
    if not (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C" and row.dtype == types.float32):
        raise TypingError(f"_scaled_peak takes a contiguous float32 row, not {row}")

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202, ARG001
        k, b = Builder(context, builder, signature, args), builder
        factor = k.splat(args[1])
        peak = cgutils.alloca_once_value(b, ir.Constant(VF, [float("-inf")] * LANES))
        length = cgutils.unpack_tuple(b, k.arrays[0].shape, 1)[0]
        with cgutils.for_range(b, b.udiv(length, ir.Constant(length.type, LANES))) as loop:
            at = b.mul(loop.index, ir.Constant(length.type, LANES))
            scaled = b.fmul(k.load_vector(k.data(0), at, VF), factor)
            k.store_vector(scaled, k.data(0), at)
            largest = b.load(peak)
            b.store(b.select(b.fcmp_ordered(">", scaled, largest), scaled, largest), peak)
        return k.horizontal_max(b.load(peak))
    return types.float32(row, scale), codegen


@njit(fastmath=_FAST, inline="always", nogil=True)
def softmax_row(row, scale, sink, has_sink):  # noqa: ANN001, ANN201
    """In place: the softmax of `row` times `scale`, the logit `sink` joining its denominator
    (and nothing else) when `has_sink`."""
    total = exponentials(row, scale, sink, has_sink)
    for c in range(len(row)):
        row[c] /= total


@njit(fastmath=_FAST, inline="always", nogil=True)
def exponentials(row, scale, sink, has_sink):  # noqa: ANN001, ANN201
    """In place: `row` times `scale` less its largest, exponentiated (the softmax before its
    division); returns their sum, with the sink's term where `has_sink`."""
    peak = _scaled_peak(row, scale)
    for c in range(len(row) // LANES * LANES, len(row)):
        scaled = row[c] * scale
        row[c] = scaled
        peak = max(peak, scaled)
    if has_sink:
        peak = max(peak, sink)
    total = _exp(sink - peak) if has_sink else np.float32(0.0)
    for c in range(len(row)):
        e = _exp(row[c] - peak)
        row[c] = e
        total += e
    return total


@njit(fastmath=_FAST, error_model="numpy", cache=True, nogil=True)
def causal_softmax(scores, n, start, first, scale, window, sinks, lo, hi):  # noqa: ANN001, ANN201
    """In place: rows `lo:hi` (counted over both leading axes) of `scores` `[kv_heads, n * group,
    seen]` (query head `h * group + g`'s row `i * group + g`, query i at position `start + i`; column c
    the key at position `first + c`) times `scale`, then softmax over the keys its query sees (at
    or before it, and within `window` positions when nonzero); the keys it does not see get 0.
    `sinks` `[heads]` (empty: none): a logit per query head that joins each of its rows'
    denominator and nothing else."""
    kv_heads, rows, seen = scores.shape
    group = rows // n
    for t in range(lo, hi):
        h, r = t // rows, t % rows
        position = start + r // group
        stop = position - first + 1
        begin = max(0, position - window + 1 - first) if window else 0
        row = scores[h, r]
        sink = sinks[h * group + r % group] if len(sinks) else np.float32(-np.inf)
        softmax_row(row[begin:stop], scale, sink, len(sinks) > 0)  # indexed from 0: no negative-index checks
        row[:begin] = 0.0
        row[stop:] = 0.0
