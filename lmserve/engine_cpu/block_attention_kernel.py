"""A decode step's attention read straight from a q8_0, q4_0 or f16 KV cache's rows.

Reading the blocks back into float32 first (`KVCodec.decode`) writes four bytes for every one
the q8_0 cache holds, and a step then reads them again for the BLAS products: at 16,000 cached
positions that made the synthetic MoE's q8_0 step several times a float32 cache's, and its decode
fell below llama-server's (figures: docs/PERFORMANCE.md, NumPy engine: decode over a quantized
cache's blocks). These kernels unpack each position's blocks into a small buffer that stays in L1
and use it at once: the scores against every query row of its KV head, or its values into each
row's output.

Work is split into chunks of positions per KV head, on Numba's OpenMP threads (the count the
thread tuner picked for the pass). A row's scores do not depend on which chunk holds them; the
values' sums are taken per chunk and added up in chunk order, so a row's output does not depend on
the thread count either. The sums run in another order than BLAS's: a quantized cache is not
bit-stable across pass shapes anyway (its rounding tips with a float's last bits).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from lmserve.engine_cpu.kernel_ir import F32, I16, I64, LANES, VF, VQ, Builder

BLOCK = 32  # values a block holds
Q8_0, Q4_0, F16 = 0, 1, 2
KINDS = {"q8_0": Q8_0, "q4_0": Q4_0, "f16": F16}  # the `--kv-type`s whose rows these kernels read
CHUNK = 256  # positions a task reads: 8.5 KiB of q8_0 keys of 64 values, many tasks per thread
_FAST = {"reassoc", "contract", "nsz"}


def _block_reader(kind: int):  # noqa: ANN202  (a Numba intrinsic)
    """An intrinsic `read(stored, at, out, first)`: the bytes at `stored[at:]` as float32 values
    into `out[first:]`, as `KVCodec.decode` gives them: a q8_0 block's 32 (`d * q`), a q4_0 block's
    32 (`(q - 8) * d`; byte j: value j low, value j + 16 high), or 16 float16 values. Written as
    LLVM vector IR: Numba's loop vectorizer leaves these loops scalar."""
    @intrinsic
    def read(typingctx, stored, at, out, first):  # noqa: ANN001, ANN202, ARG001
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202, ARG001
            k, b = Builder(context, builder, signature, args), builder
            source, target = k.at(k.data(0), args[1]), k.at(k.data(2), args[3])

            def load(offset: int, vector: ir.Type) -> ir.Value:
                return k.load_vector(source, ir.Constant(I64, offset), vector)

            if kind == F16:
                halves = b.bitcast(load(0, ir.VectorType(I16, LANES)), ir.VectorType(ir.HalfType(), LANES))
                k.store_vector(b.fpext(halves, VF), target, ir.Constant(I64, 0))
                return context.get_dummy_value()
            d = k.splat(b.fpext(b.bitcast(load(0, I16), ir.HalfType()), F32))
            if kind == Q4_0:
                packed = load(2, VQ)
                eight = ir.Constant(VF, [8.0] * LANES)
                halves = [b.fsub(b.uitofp(part, VF), eight) for part in
                          (b.and_(packed, ir.Constant(VQ, [15] * LANES)), b.lshr(packed, ir.Constant(VQ, [4] * LANES)))]
            else:
                halves = [b.sitofp(load(2 + p, VQ), VF) for p in (0, LANES)]
            for p, half in enumerate(halves):
                k.store_vector(b.fmul(half, d), target, ir.Constant(I64, p * LANES))
            return context.get_dummy_value()
        return types.void(stored, at, out, first), codegen
    return read


_read_q8, _read_q4, _read_f16 = _block_reader(Q8_0), _block_reader(Q4_0), _block_reader(F16)


def _vector_loop(update):  # noqa: ANN001, ANN202
    """The codegen of an intrinsic over float32 vectors `a`, `b` (1-D, of whole blocks) and, where
    given, a float32 `w`: `update(k, acc, at, w)` for the LANES values from `at` on (`w` splat),
    `acc` a vector accumulator whose sum the intrinsic returns."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202, ARG001
        k = Builder(context, builder, signature, args)
        acc = cgutils.alloca_once_value(builder, ir.Constant(VF, [0.0] * LANES))
        w = k.splat(args[2]) if len(args) > 2 else None
        length = cgutils.unpack_tuple(builder, k.arrays[0].shape, 1)[0]
        with cgutils.for_range(builder, builder.udiv(length, ir.Constant(I64, LANES))) as loop:
            update(k, acc, builder.mul(loop.index, ir.Constant(I64, LANES)), w)
        return k.horizontal_sum(builder.load(acc))
    return codegen


@intrinsic
def _dot(typingctx, a, b):  # noqa: ANN001, ANN202, ARG001
    """a . b, in LANES-wide fused multiply-adds (Numba leaves the loop scalar)."""
    def update(k, acc, at, _w):  # noqa: ANN001, ANN202
        products = k.b.call(k.fma_v, [k.load_vector(k.data(0), at, VF), k.load_vector(k.data(1), at, VF),
                                      k.b.load(acc)])
        k.b.store(products, acc)
    return types.float32(a, b), _vector_loop(update)


@intrinsic
def _add_times(typingctx, a, b, w):  # noqa: ANN001, ANN202, ARG001
    """a += w * b, in LANES-wide fused multiply-adds (Numba leaves the loop scalar)."""
    def update(k, _acc, at, w):  # noqa: ANN001, ANN202
        k.store_vector(k.b.call(k.fma_v, [w, k.load_vector(k.data(1), at, VF), k.load_vector(k.data(0), at, VF)]),
                       k.data(0), at)
    return types.float32(a, b, w), _vector_loop(update)


@njit(inline="always")
def _unpack(stored, out, kind):  # noqa: ANN001, ANN202
    """One position's row (`stored`: its bytes) as float32 values into `out`."""
    if kind == F16:
        for b in range(len(out) // LANES):
            _read_f16(stored, b * 2 * LANES, out, b * LANES)
        return
    for b in range(len(out) // BLOCK):
        if kind == Q4_0:
            _read_q4(stored, b * 18, out, b * BLOCK)
        else:
            _read_q8(stored, b * 34, out, b * BLOCK)


@njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def block_scores(queries, keys, scores, kind):  # noqa: ANN001, ANN201
    """`scores[h, r, c]` = queries `[kv_heads, rows, head_dim]` row r . the key at position c of
    `keys` `[kv_heads, seen, bytes]` (rows of the `KINDS` type `kind`)."""
    kv_heads, rows, head_dim = queries.shape
    seen = keys.shape[1]
    chunks = (seen + CHUNK - 1) // CHUNK
    for task in prange(kv_heads * chunks):
        h, lo = task // chunks, task % chunks * CHUNK
        key = np.empty(head_dim, np.float32)
        for c in range(lo, min(seen, lo + CHUNK)):
            _unpack(keys[h, c], key, kind)
            for r in range(rows):
                scores[h, r, c] = _dot(queries[h, r], key)


@njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def block_mix(weights, values, out, kind):  # noqa: ANN001, ANN201
    """`out[h, r]` = sum over positions c of `weights[h, r, c]` x the value at c of `values`
    `[kv_heads, seen, bytes]` (rows of the `KINDS` type `kind`); `out` `[kv_heads, rows,
    head_dim]`. Each chunk's sum is kept apart and the chunks are added in order."""
    kv_heads, rows, seen = weights.shape
    head_dim = out.shape[2]
    chunks = (seen + CHUNK - 1) // CHUNK
    parts = np.zeros((kv_heads, chunks, rows, head_dim), np.float32)
    for task in prange(kv_heads * chunks):
        h, part = task // chunks, task % chunks
        value = np.empty(head_dim, np.float32)
        acc = parts[h, part]
        for c in range(part * CHUNK, min(seen, part * CHUNK + CHUNK)):
            _unpack(values[h, c], value, kind)
            for r in range(rows):
                _add_times(acc[r], value, weights[h, r, c])
    for h in prange(kv_heads):
        for r in range(rows):
            row = out[h, r]
            row[:] = parts[h, 0, r]
            for part in range(1, chunks):
                row += parts[h, part, r]
