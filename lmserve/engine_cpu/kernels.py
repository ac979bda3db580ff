"""Compiled kernels for quantized matrices: values with a float32 scale and offset per block.

Decode reads every weight once per step, so it runs at the speed weights stream through the
cores: float32 weights cost 4 bytes a value, these 0.75-2.25. The values array's dtype says how it
holds them (`qmatrix.ENCODINGS`): int8 one a byte, uint8 two 4-bit ones a byte, int16 float16
bits, uint16 bfloat16 bits; each kernel is compiled per dtype. NumPy has no matrix product for int8
times float32, and Numba's loop vectorizer leaves these loops scalar, so the inner loops are
written as LLVM vector IR through Numba intrinsics: a decode step's products then beat float32
weights' for one row, and by more for four. Numba's `prange` runs them on OpenMP threads, whose
launches are cheap (its own work queue costs more than a small matrix: without OpenMP or TBB
`available()` is False and the engine keeps float32 weights). Figures: docs/PERFORMANCE.md,
measurements behind code choices.

Each output value is a dot product per block, scaled, `sum_b scale[b] * (q_b . x_b) + offset[b]
* sum(x_b)`, in float32 with fused multiply-adds, in the same order whatever rows share the call:
a row's result does not depend on what it is batched with. The scale and offset arrays' dtype says
their form (`qmatrix.SCALE_FORMS`): float32 values, float16 bits, or int8 multiples of a float32
factor per superblock of 256 values (`supers`: the scale's factor, then the offset's), products
exact in float32, so each form gives a block the same float32 scale and offset.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.ufunc.parallel import _launch_threads  # loads the threading layer

from lmserve.engine_cpu.qmatrix import SUPERBLOCK

LANES = 16  # float32 values per vector: one AVX-512 register, two AVX2 ones, four NEON ones
_F32, _I8, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
_I16 = ir.IntType(16)
_VF, _VQ = ir.VectorType(_F32, LANES), ir.VectorType(_I8, LANES)
_VH, _VI32 = ir.VectorType(_I16, LANES), ir.VectorType(_I32, LANES)
BLOCK_SIZES = (32, 16)  # values per scale: quant_blocks.SUPPORTED's sizes
HALF_GROUP = 8  # float16 scales widened together (one AVX2 / two NEON conversions)
NIBBLE_GROUP = 32  # nibble-packed values: 16 bytes hold values 0-15 in the low halves, 16-31 in the high
ROW_GROUPS = (4, 2, 1)  # rows computed together: each block's values are converted once for all


class _Builder:
    """The few IR patterns the kernels need, on one `llvmlite` builder."""

    def __init__(self, context, builder: ir.IRBuilder, signature, args) -> None:  # noqa: ANN001
        self.b = builder
        self.arrays = [context.make_array(t)(context, builder, a) if isinstance(t, types.Array) else None
                       for t, a in zip(signature.args, args, strict=True)]
        self.dtypes = [getattr(t, "dtype", None) for t in signature.args]
        self.fma_v = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3),
                                                    "llvm.fma.v16f32")
        self.fma_s = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3),
                                                    "llvm.fma.f32")

    def by_block_size(self, emit: Callable[[int], None], values: int, scales: int) -> None:
        """`emit(size)` for each block size, run by the one that argument `values`' columns over
        argument `scales`' columns give: the loops are built for a constant size (a loop over a
        block's vectors with a run-time count made 4-row products slower; figures:
        docs/PERFORMANCE.md, measurements behind code choices)."""
        size = self.b.udiv(self.columns(values), self.columns(scales))
        if self.dtypes[values] == types.uint8:  # two values a byte
            size = self.b.shl(size, ir.Constant(_I64, 1))
        with self.b.if_else(self.b.icmp_unsigned("==", size, ir.Constant(_I64, BLOCK_SIZES[0]))) as (first, other):
            with first:
                emit(BLOCK_SIZES[0])
            with other:
                emit(BLOCK_SIZES[1])

    def data(self, i: int) -> ir.Value:
        return self.arrays[i].data

    def columns(self, i: int) -> ir.Value:
        return cgutils.unpack_tuple(self.b, self.arrays[i].shape, 2)[1]

    def row(self, i: int, index: ir.Value) -> ir.Value:
        """Pointer to row `index` of 2-D C-contiguous argument `i`."""
        return self.b.gep(self.data(i), [self.b.mul(index, self.columns(i))])

    def at(self, ptr: ir.Value, offset: ir.Value | int) -> ir.Value:
        return self.b.gep(ptr, [offset if isinstance(offset, ir.Value) else ir.Constant(_I64, offset)])

    def load_vector(self, ptr: ir.Value, offset: ir.Value, vector: ir.VectorType) -> ir.Value:
        return self.b.load(self.b.bitcast(self.at(ptr, offset), vector.as_pointer()), align=1)

    def store_vector(self, value: ir.Value, ptr: ir.Value, offset: ir.Value) -> None:
        self.b.store(value, self.b.bitcast(self.at(ptr, offset), _VF.as_pointer()), align=4)

    def block_values(self, q: int, qrow: ir.Value, first: ir.Value, size: int) -> list[ir.Value]:
        """The `size` values of argument `q`'s row `qrow` from value `first` on (a block's
        start), as float32 vectors of LANES values, decoded as the argument's dtype says."""
        b, dtype = self.b, self.dtypes[q]
        if dtype == types.uint8:  # 16 bytes hold 32 values: the low nibbles, then the high ones
            group = b.and_(first, ir.Constant(_I64, -NIBBLE_GROUP))
            packed = self.load_vector(qrow, b.lshr(group, ir.Constant(_I64, 1)), _VQ)
            low = b.uitofp(b.and_(packed, ir.Constant(_VQ, [0x0F] * LANES)), _VF)
            high = b.uitofp(b.lshr(packed, ir.Constant(_VQ, [4] * LANES)), _VF)
            if size == NIBBLE_GROUP:
                return [low, high]
            second = b.icmp_unsigned("!=", b.sub(first, group), ir.Constant(_I64, 0))  # a block of 16
            return [b.select(second, high, low)]
        vectors = []
        for p in range(0, size, LANES):
            at = b.add(first, ir.Constant(_I64, p))
            if dtype == types.int8:
                vectors.append(b.sitofp(self.load_vector(qrow, at, _VQ), _VF))
            elif dtype == types.int16:  # float16 bits
                halves = b.bitcast(self.load_vector(qrow, at, _VH), ir.VectorType(ir.HalfType(), LANES))
                vectors.append(b.fpext(halves, _VF))
            else:  # uint16: bfloat16 bits, a float32's upper half
                wide = b.zext(self.load_vector(qrow, at, _VH), _VI32)
                vectors.append(b.bitcast(b.shl(wide, ir.Constant(_VI32, [16] * LANES)), _VF))
        return vectors

    def splat(self, value: ir.Value, width: int = LANES) -> ir.Value:
        vector = ir.VectorType(value.type, width)
        one = self.b.insert_element(ir.Constant(vector, None), value, ir.Constant(_I32, 0))
        return self.b.shuffle_vector(one, ir.Constant(vector, None), ir.Constant(ir.VectorType(_I32, width), [0] * width))

    def for_blocks(self, scales: int, rows: list[ir.Value], size: int,
                   body: Callable[[ir.Value, list[tuple[ir.Value, ir.Value]]], None]) -> None:
        """`body(index, factors)` for every block `index` of matrix rows `rows` (blocks of
        `size` values), `factors[j]` row j's float32 scale and offset of that block, read from
        argument `scales` and the two after it (offsets, supers) in their form. Compact forms are
        expanded a group of blocks at a time into floats on the stack, with vector conversions:
        converted one block at a time, they cost a one-row product 10-40% (figures:
        docs/PERFORMANCE.md, measurements behind code choices)."""
        b, form = self.b, self.dtypes[scales]
        blocks = self.columns(scales)
        sources = [(self.row(scales, r), self.row(scales + 1, r), self.row(scales + 2, r)) for r in rows]
        if form == types.float32:
            with cgutils.for_range(b, blocks) as loop:
                body(loop.index, [(b.load(self.at(s, loop.index)), b.load(self.at(m, loop.index)))
                                  for s, m, _ in sources])
            return
        per = SUPERBLOCK // size if form == types.int8 else HALF_GROUP  # FACTORED: whole superblocks
        tables = [cgutils.alloca_once(b, _F32, size=2 * per) for _ in rows]
        groups = b.udiv(blocks, ir.Constant(_I64, per))
        with cgutils.for_range(b, groups) as group:
            first = b.mul(group.index, ir.Constant(_I64, per))
            factors = b.shl(group.index, ir.Constant(_I64, 1))  # FACTORED: the group's two in supers
            for table, (*pair, supers) in zip(tables, sources, strict=True):
                for i, source in enumerate(pair):  # the scales, then the offsets
                    values = self._expand(source, first, per, form, self.at(supers, b.add(factors, ir.Constant(_I64, i))))
                    b.store(values, b.bitcast(self.at(table, i * per), values.type.as_pointer()), align=4)
            with cgutils.for_range(b, ir.Constant(_I64, per)) as loop:
                body(b.add(first, loop.index), [(b.load(self.at(table, loop.index)),
                                                 b.load(self.at(table, b.add(loop.index, ir.Constant(_I64, per)))))
                                                for table in tables])
        if form == types.int16:  # the blocks past the last whole group
            with cgutils.for_range(b, b.sub(blocks, b.mul(groups, ir.Constant(_I64, per)))) as loop:
                index = b.add(b.mul(groups, ir.Constant(_I64, per)), loop.index)
                body(index, [tuple(b.fpext(b.bitcast(b.load(self.at(source, index)), ir.HalfType()), _F32)
                                   for source in pair) for *pair, _ in sources])

    def _expand(self, source: ir.Value, first: ir.Value, per: int, form: types.Type, factor: ir.Value) -> ir.Value:
        """`per` scales (or offsets) from block `first` on as float32: float16 bits widened, or
        int8 multiples of the float32 at `factor`."""
        b = self.b
        if form == types.int16:
            halves = self.load_vector(source, first, ir.VectorType(_I16, per))
            return b.fpext(b.bitcast(halves, ir.VectorType(ir.HalfType(), per)), ir.VectorType(_F32, per))
        subs = b.sitofp(self.load_vector(source, first, ir.VectorType(_I8, per)), ir.VectorType(_F32, per))
        return b.fmul(self.splat(b.load(factor), per), subs)

    def horizontal_sum(self, v: ir.Value) -> ir.Value:
        """Pairwise: 16 -> 8 -> 4 -> 2 -> 1 lanes."""
        width = LANES
        while width > 1:
            half = width // 2
            lo = self.b.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half))))
            hi = self.b.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half, width))))
            v, width = self.b.fadd(lo, hi), half
        return self.b.extract_element(v, ir.Constant(_I32, 0))


def _dots(rows: int, outs: int):  # noqa: ANN202  (a Numba intrinsic)
    """`out[r0 + r, o0 + j] = sum_b scale[o, b] * (q[o, b] . x[r0 + r, b]) + offset[o, b] *
    xsum[r0 + r, b]` (o = o0 + j) for r < `rows`, j < `outs`: a tile of the result. Each block of
    x is loaded once for the tile's matrix rows and each block of q once for its x rows."""
    @intrinsic
    def dots(typingctx, x, q, scale, offset, supers, xsum, out, o0, r0):  # noqa: ANN001, ANN202, ARG001
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            k = _Builder(context, builder, signature, args)
            b = builder
            last = b.sub(cgutils.unpack_tuple(b, k.arrays[1].shape, 2)[0], ir.Constant(_I64, 1))
            # A tile past the matrix's last row computes that row again (the same value, twice).
            o_index = [b.select(b.icmp_signed("<", o, last), o, last)
                       for o in (b.add(args[7], ir.Constant(_I64, j)) for j in range(outs))]
            r_index = [b.add(args[8], ir.Constant(_I64, r)) for r in range(rows)]
            qrows = [k.row(1, o) for o in o_index]
            xrows, xsums = ([k.row(arg, r) for r in r_index] for arg in (0, 5))
            zero = ir.Constant(_VF, [0.0] * LANES)
            acc = [[cgutils.alloca_once_value(b, zero) for _ in range(rows)] for _ in range(outs)]
            acc_offset = [[cgutils.alloca_once_value(b, ir.Constant(_F32, 0.0)) for _ in range(rows)]
                          for _ in range(outs)]

            def blocks_of(size: int) -> None:
                def block(index: ir.Value, factors: list[tuple[ir.Value, ir.Value]]) -> None:
                    first = b.mul(index, ir.Constant(_I64, size))
                    parts = [b.add(first, ir.Constant(_I64, p)) for p in range(0, size, LANES)]
                    xv = [[k.load_vector(xrow, p, _VF) for p in parts] for xrow in xrows]
                    xs = [b.load(k.at(xsum, index)) for xsum in xsums]
                    for j, (s, m) in enumerate(factors):
                        values = k.block_values(1, qrows[j], first, size)
                        s = k.splat(s)
                        for r in range(rows):
                            dot = b.fmul(values[0], xv[r][0])
                            for v, xp in zip(values[1:], xv[r][1:], strict=True):
                                dot = b.call(k.fma_v, [v, xp, dot])
                            b.store(b.call(k.fma_v, [s, dot, b.load(acc[j][r])]), acc[j][r])
                            b.store(b.call(k.fma_s, [m, xs[r], b.load(acc_offset[j][r])]), acc_offset[j][r])

                k.for_blocks(2, o_index, size, block)

            k.by_block_size(blocks_of, 1, 2)
            for j in range(outs):
                for r in range(rows):
                    total = b.fadd(k.horizontal_sum(b.load(acc[j][r])), b.load(acc_offset[j][r]))
                    b.store(total, k.at(k.row(6, r_index[r]), o_index[j]))
            return context.get_dummy_value()
        return types.void(x, q, scale, offset, supers, xsum, out, o0, r0), codegen
    return dots


@intrinsic
def _dequantize_row(typingctx, q, scale, offset, supers, out, o):  # noqa: ANN001, ANN202, ARG001
    """`out[o] = scale[o, b] * q[o] + offset[o, b]`, block by block: one float32 row."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        k = _Builder(context, builder, signature, args)
        b = builder
        o_ = args[5]
        qrow, orow = k.row(0, o_), k.row(4, o_)

        def blocks_of(size: int) -> None:
            def block(index: ir.Value, factors: list[tuple[ir.Value, ir.Value]]) -> None:
                s, m = (k.splat(f) for f in factors[0])
                first = b.mul(index, ir.Constant(_I64, size))
                for p, values in zip(range(0, size, LANES), k.block_values(0, qrow, first, size), strict=True):
                    k.store_vector(b.call(k.fma_v, [values, s, m]), orow, b.add(first, ir.Constant(_I64, p)))

            k.for_blocks(1, [o_], size, block)

        k.by_block_size(blocks_of, 0, 1)
        return context.get_dummy_value()
    return types.void(q, scale, offset, supers, out, o), codegen


# Tiles: 4, 2 or 1 rows of x against OUTS matrix rows.
# 2 matrix rows a tile make a 4-row decode step fastest, 1 is clearly slower, 4 a little
# (figures: docs/PERFORMANCE.md, measurements behind code choices).
OUTS = 2
_tile4, _tile2, _tile1 = (_dots(rows, OUTS) for rows in ROW_GROUPS)
_one = _dots(1, 1)


@njit(inline="always", nogil=True)
def _tiles(x, q, scale, offset, supers, xsum, out, o, r, stop):  # noqa: ANN001, ANN202
    """Matrix rows `o:o + OUTS` against x rows `r:stop`: four at a time, then two, then one."""
    while r + 4 <= stop:
        _tile4(x, q, scale, offset, supers, xsum, out, o, r)
        r += 4
    if r + 2 <= stop:
        _tile2(x, q, scale, offset, supers, xsum, out, o, r)
        r += 2
    if r < stop:
        _tile1(x, q, scale, offset, supers, xsum, out, o, r)


@njit(parallel=True, cache=True, nogil=True)
def _times(x, q, scale, offset, supers, xsum, out):  # noqa: ANN001, ANN202
    n = x.shape[0]
    if n == 1:  # one matrix row at a time: faster than tiles for one row (figures: docs/PERFORMANCE.md)
        for o in prange(q.shape[0]):
            _one(x, q, scale, offset, supers, xsum, out, o, 0)
        return
    for tile in prange(-(-q.shape[0] // OUTS)):
        _tiles(x, q, scale, offset, supers, xsum, out, tile * OUTS, 0, n)


@njit(parallel=True, cache=True, nogil=True)
def _grouped_times(x, q, scale, offset, supers, xsum, out, experts, firsts):  # noqa: ANN001, ANN202
    """`_times` for groups of rows, each against its own matrix of the stack `q [matrices, ...]`:
    one launch for every routed expert of a layer, its tiles spread over the threads."""
    rows = q.shape[1]
    if firsts[-1] == len(experts):  # one row a group: one matrix row at a time, as `_times` does
        for t in prange(len(experts) * rows):
            g, o = t // rows, t % rows
            e = experts[g]
            _one(x, q[e], scale[e], offset[e], supers[e], xsum, out, o, g)
        return
    tiles = -(-rows // OUTS)
    for t in prange(len(experts) * tiles):
        g, o = t // tiles, (t % tiles) * OUTS
        e = experts[g]
        _tiles(x, q[e], scale[e], offset[e], supers[e], xsum, out, o, firsts[g], firsts[g + 1])


@njit(cache=True, nogil=True)
def _dequantize(q, scale, offset, supers, out):  # noqa: ANN001, ANN202
    for o in range(q.shape[0]):
        _dequantize_row(q, scale, offset, supers, out, o)


def times(x: np.ndarray, q: np.ndarray, scale: np.ndarray, offset: np.ndarray, supers: np.ndarray) -> np.ndarray:
    """`x [n, in]` (float32) times the matrix `[out, in]` transposed: `[n, out]`."""
    n, columns = x.shape
    block = columns // scale.shape[1]
    xsum = np.add.reduce(x.reshape(n, -1, block), axis=-1)
    out = np.empty((n, len(q)), dtype=np.float32)
    _times(x, q, scale, offset, supers, xsum, out)
    return out


def grouped_times(x: np.ndarray, q: np.ndarray, scale: np.ndarray, offset: np.ndarray, supers: np.ndarray,
                  experts: np.ndarray, firsts: np.ndarray) -> np.ndarray:
    """Rows `firsts[g]:firsts[g + 1]` of `x [n, in]` times matrix `experts[g]` of the stack
    `[matrices, out, in]` transposed: `[n, out]`, each row's values the bits `times` gives it."""
    n, columns = x.shape
    block = columns // scale.shape[2]
    xsum = np.add.reduce(x.reshape(n, -1, block), axis=-1)
    out = np.empty((n, q.shape[1]), dtype=np.float32)
    _grouped_times(x, q, scale, offset, supers, xsum, out, experts, firsts)
    return out


def set_threads(n: int) -> None:
    """The threads the calling thread's next parallel kernels run with (at most Numba's count)."""
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


def most_threads() -> int:
    return numba.config.NUMBA_NUM_THREADS


def dequantize(q: np.ndarray, scale: np.ndarray, offset: np.ndarray, supers: np.ndarray, out: np.ndarray) -> None:
    """Fill `out [rows, in]` (float32, C-contiguous) with the matrix's values. On one thread: it
    feeds BLAS, whose threads would otherwise wait for OpenMP's to stop spinning."""
    _dequantize(q, scale, offset, supers, out)


def prepare(forms: Iterable[tuple[np.dtype, np.dtype]], stacked: Iterable[tuple[np.dtype, np.dtype]] = ()) -> str:
    """Compile the kernels for the (values dtype, scales dtype) pairs of the matrices the engine
    passes, and the grouped one for expert stacks of `stacked` (or load them from Numba's cache,
    `cache=True`, written beside this module) without running them: compiled lazily, the first
    request after an install waited for them. What happened, for the banner."""
    started = time.perf_counter()
    matrix, cube = types.Array(types.float32, 2, "C"), types.Array(types.float32, 3, "C")
    for values, scales in sorted(set(forms), key=str):
        q, s = (types.Array(numba.from_dtype(dtype), 2, "C") for dtype in (values, scales))
        _times.compile((matrix, q, s, s, matrix, matrix, matrix))
        _dequantize.compile((q, s, s, matrix, matrix))
    ids = types.Array(types.int64, 1, "C")
    for values, scales in sorted(set(stacked), key=str):
        q, s = (types.Array(numba.from_dtype(dtype), 3, "C") for dtype in (values, scales))
        _grouped_times.compile((matrix, q, s, s, cube, matrix, matrix, ids, ids))
    took = time.perf_counter() - started
    if sum(_times.stats.cache_hits.values()):
        return f"compiled kernels loaded from Numba's cache in {took:.1f} s"
    return f"kernels compiled in {took:.1f} s (first run; cached in {_times.stats.cache_path} for the next)"


@functools.cache
def available() -> bool:
    """Whether the kernels compile and run here, with a threading layer whose launches are cheap.

    Runs no parallel kernel: libgomp gives every thread that starts a parallel region a team of
    its own, and once there are more of its threads than cores it stops spinning between regions,
    so launches cost many times more (a decode step from the scheduler's thread got much slower
    when the main thread had probed with one; figures: docs/PERFORMANCE.md, measurements behind
    code choices). Only the thread that decodes runs them."""
    try:
        q = np.ones((2, 32), np.int8)
        scale, offset = np.ones((2, 1), np.float32), np.zeros((2, 1), np.float32)
        out = np.empty((2, 32), np.float32)
        dequantize(q, scale, offset, np.empty((2, 0), np.float32), out)
        _launch_threads()
    except Exception:  # noqa: BLE001  (no compiler for this CPU, no threading layer: use float32)
        return False
    return bool(np.all(out == 1.0)) and numba.threading_layer() in ("omp", "tbb")
