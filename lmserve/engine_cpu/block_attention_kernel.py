"""A decode step's attention read straight from a q8_0, q4_0 or f16 KV cache's rows.

Reading the blocks back into float32 first (`KVCodec.decode`) writes four bytes for every one
the q8_0 cache holds, and a step then reads them again for the BLAS products: at 16,000 cached
positions that made the synthetic MoE's q8_0 step several times a float32 cache's, and its decode
fell below llama-server's (figures: docs/PERFORMANCE.md, NumPy engine: decode over a quantized
cache's blocks). These kernels unpack each position's blocks into a small buffer that stays in L1
and use it at once: the scores against every query row of its KV head, or its values into each
row's output.

`attend_rows` is the whole of a layer's attention for a decode step or verify pass over such a
cache, as one call (the rows' rope, their keys and values stored, scores, softmax and mix), as
`row_attention_kernel.attend_rows` is over a float32 cache.

Work is split into chunks of positions per KV head, on Numba's OpenMP threads (the count the
thread tuner picked for the pass) from PARALLEL_SCORES scores, on the calling thread below. A
row's scores do not depend on which chunk holds them; the values' sums are taken per chunk and
added up in chunk order, so a row's output does not depend on the thread count or on which thread
ran it either. The sums run in another order than BLAS's: a quantized cache is not
bit-stable across pass shapes anyway (its rounding tips with a float's last bits).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from lmserve.engine_cpu.kernel_ir import F32, I16, I64, LANES, VF, VQ, Builder
from lmserve.engine_cpu.kv_encode_kernel import half_bits, q4_0_blocks, q8_0_blocks, turn_blocks
from lmserve.engine_cpu.row_attention_kernel import PARALLEL_SCORES, _scores, rope_rows
from lmserve.engine_cpu.softmax_kernel import causal_softmax

BLOCK = 32  # values a block holds
Q8_0, Q4_0, F16 = 0, 1, 2
KINDS = {"q8_0": Q8_0, "q4_0": Q4_0, "f16": F16}  # the `--kv-type`s whose rows these kernels read
CHUNK = 256  # positions a task reads: 8.5 KiB of q8_0 keys of 64 values, many tasks per thread
TILE = 32  # keys unpacked into float32 at a time for their scores: 8 KiB of keys of 64 values, in L1
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
    `keys` `[kv_heads, seen, bytes]` (rows of the `KINDS` type `kind`), a chunk on each thread."""
    chunks = (keys.shape[1] + CHUNK - 1) // CHUNK
    for task in prange(keys.shape[0] * chunks):
        _score_chunk(queries, keys, scores, kind, task // chunks, task % chunks * CHUNK)


@njit(fastmath=_FAST, cache=True, nogil=True)
def block_scores_serial(queries, keys, scores, kind):  # noqa: ANN001, ANN201
    """`block_scores` on the calling thread (a short context's: a launch costs more than it splits)."""
    chunks = (keys.shape[1] + CHUNK - 1) // CHUNK
    for task in range(keys.shape[0] * chunks):
        _score_chunk(queries, keys, scores, kind, task // chunks, task % chunks * CHUNK)


@njit(inline="always", fastmath=_FAST, nogil=True)
def _score_chunk(queries, keys, scores, kind, h, lo):  # noqa: ANN001, ANN202
    """`block_scores` for KV head h's positions lo..lo+CHUNK-1: TILE positions at a time unpacked
    into an L1 tile, then `row_attention_kernel`'s products over float32 keys."""
    tile = np.empty((TILE, queries.shape[2]), np.float32)
    hi = min(keys.shape[1], lo + CHUNK)
    for at in range(lo, hi, TILE):
        count = min(TILE, hi - at)
        for j in range(count):
            _unpack(keys[h, at + j], tile[j], kind)
        _scores(queries[h], tile[:count], scores[h, :, at:at + count])


@njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def block_mix(weights, values, out, kind):  # noqa: ANN001, ANN201
    """`out[h, r]` = sum over positions c of `weights[h, r, c]` x the value at c of `values`
    `[kv_heads, seen, bytes]` (rows of the `KINDS` type `kind`); `out` `[kv_heads, rows,
    head_dim]`. Each chunk's sum is kept apart (a chunk on each thread) and the chunks are added
    in order."""
    parts = _chunk_sums(weights, out)
    for task in prange(parts.shape[0] * parts.shape[1]):
        _mix_chunk(weights, values, parts, kind, task // parts.shape[1], task % parts.shape[1])
    for h in prange(len(out)):
        _add_parts(parts[h], out[h])


@njit(fastmath=_FAST, cache=True, nogil=True)
def block_mix_serial(weights, values, out, kind):  # noqa: ANN001, ANN201
    """`block_mix` on the calling thread, with the same sums."""
    parts = _chunk_sums(weights, out)
    for task in range(parts.shape[0] * parts.shape[1]):
        _mix_chunk(weights, values, parts, kind, task // parts.shape[1], task % parts.shape[1])
    for h in range(len(out)):
        _add_parts(parts[h], out[h])


@njit(inline="always", nogil=True)
def _chunk_sums(weights, out):  # noqa: ANN001, ANN202
    """Zeroed sums `[kv_heads, chunks, rows, head_dim]` of `block_mix`'s chunks."""
    kv_heads, rows, seen = weights.shape
    return np.zeros((kv_heads, (seen + CHUNK - 1) // CHUNK, rows, out.shape[2]), np.float32)


@njit(inline="always", fastmath=_FAST, nogil=True)
def _mix_chunk(weights, values, parts, kind, h, part):  # noqa: ANN001, ANN202
    """`block_mix`'s sums over KV head h's chunk `part` into `parts[h, part]`."""
    value = np.empty(parts.shape[3], np.float32)
    acc = parts[h, part]
    for c in range(part * CHUNK, min(weights.shape[2], part * CHUNK + CHUNK)):
        _unpack(values[h, c], value, kind)
        for r in range(weights.shape[1]):
            _add_times(acc[r], value, weights[h, r, c])


@njit(inline="always", fastmath=_FAST, nogil=True)
def _add_parts(parts, out):  # noqa: ANN001, ANN202
    """`out` `[rows, head_dim]` = the chunks' sums `parts` `[chunks, rows, head_dim]`, in order."""
    for r in range(out.shape[0]):
        row = out[r]
        row[:] = parts[0, r]
        for part in range(1, parts.shape[0]):
            row += parts[part, r]


@njit(fastmath=_FAST, error_model="numpy", cache=True, nogil=True)
def attend_rows(qk, v, cos, sin, keys, values, start, scale, window, sinks, kind, factors, out):  # noqa: ANN001, ANN201
    """`row_attention_kernel.attend_rows` over a cache of `kind` rows (`keys`, `values` uint8
    `[kv_heads, positions, bytes]`) in one compiled call: the rows' rope, their keys and values
    turned (`kv_codec`'s basis, q8_0 and q4_0) and stored at `start + r` (`factors`: q4_0's
    scales tried, `kv_codec.Q4_FACTORS`), the queries turned the same way, scores, masked softmax
    and mix over the blocks, the output turned back into `out` `[n, heads, head_dim]`. In Python
    these were some 30 calls a layer around a few thousand multiply-adds: a short context's q8_0
    step took about twice a float32 cache's (figures: docs/PERFORMANCE.md, NumPy engine: a
    quantized cache's decode attention in one call)."""
    n, qk_heads, head_dim = qk.shape
    kv_heads = keys.shape[0]
    heads = qk_heads - kv_heads
    group = heads // kv_heads
    q = np.empty((kv_heads, n, group, head_dim), np.float32)
    new_keys, new_values = np.empty((kv_heads, n, head_dim), np.float32), np.empty((kv_heads, n, head_dim), np.float32)
    rope_rows(qk, v, cos, sin, new_keys, new_values, 0, q, True)
    if kind != F16:
        for rows in (q.reshape(-1, BLOCK), new_keys.reshape(-1, BLOCK), new_values.reshape(-1, BLOCK)):
            turn_blocks(rows)
    for h in range(kv_heads):
        for r in range(n):
            _store(new_keys[h, r], keys[h, start + r], kind, factors)
            _store(new_values[h, r], values[h, start + r], kind, factors)
    end = start + n
    first = max(0, start - window + 1) if window else 0  # only the positions some row sees
    queries = q.reshape(kv_heads, n * group, head_dim)
    scores = np.empty((kv_heads, n * group, end - first), np.float32)
    mixed = np.empty_like(queries)
    serial = (end - first) * heads < PARALLEL_SCORES  # a short context's: a thread launch costs more
    if serial:
        block_scores_serial(queries, keys[:, first:end], scores, kind)
    else:
        block_scores(queries, keys[:, first:end], scores, kind)
    causal_softmax(scores, n, start, first, scale, window, sinks, 0, kv_heads * n * group)
    if serial:
        block_mix_serial(scores, values[:, first:end], mixed, kind)
    else:
        block_mix(scores, values[:, first:end], mixed, kind)
    if kind != F16:
        turn_blocks(mixed.reshape(-1, BLOCK))
    for h in range(kv_heads):
        for r in range(n):
            out[r, h * group:(h + 1) * group] = mixed[h, r * group:(r + 1) * group]


@njit(inline="always", nogil=True)
def _store(row, stored, kind, factors):  # noqa: ANN001, ANN202
    """One position's float32 `row` as the bytes `stored` of a `kind` row: `kv_codec`'s encoding
    (float16 bits little-endian, or q8_0 / q4_0 blocks of the turned values). The blocks' writers
    are called, not inlined: compiled with this module's contraction and reassociation, q4_0's
    error sums would round otherwise than `kv_codec`'s and pick other scales."""
    if kind == F16:
        for i in range(len(row)):
            bits = half_bits(row[i])
            stored[2 * i], stored[2 * i + 1] = np.uint8(bits & np.uint16(255)), np.uint8(bits >> np.uint16(8))
    elif kind == Q8_0:
        q8_0_blocks(row.reshape(-1, BLOCK), stored.reshape(-1, 34))
    else:
        q4_0_blocks(row.reshape(-1, BLOCK), stored.reshape(-1, 18), factors)
