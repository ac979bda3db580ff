"""Compiled kernels for quantized matrices: values with a float32 scale and offset per block.

Decode reads every weight once per step, so it runs at the speed weights stream through the
cores: float32 weights cost 4 bytes a value, these 0.41-2.25. The values array's dtype says how it
holds them (`qmatrix.ENCODINGS`: int8 one a byte, uint8 two 4-bit ones a byte, and so on); each
kernel is compiled per dtype. NumPy has no matrix product for int8 times float32, and Numba's loop
vectorizer leaves these loops scalar, so the inner loops are written as LLVM vector IR through
Numba intrinsics: a decode step's products then beat float32 weights' for one row, and by more
for four. Numba's `prange` runs them on OpenMP threads, whose
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
from collections.abc import Iterable

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.ufunc.parallel import _launch_threads  # loads the threading layer

from lmserve.engine_cpu import amx_kernels, int8_kernels
from lmserve.engine_cpu.expert_split import PARTS, even_work
from lmserve.engine_cpu.kernel_ir import F32, I64, LANES, OUTS, VF, Builder

ROW_GROUPS = (4, 2, 1)  # rows computed together: each block's values are converted once for all


def _dots(rows: int, outs: int):  # noqa: ANN202  (a Numba intrinsic)
    """`out[r0 + r, o0 + j] = sum_b scale[o, b] * (q[o, b] . x[r0 + r, b]) + offset[o, b] *
    xsum[r0 + r, b]` (o = o0 + j) for r < `rows`, j < `outs`: a tile of the result. Each block of
    x is loaded once for the tile's matrix rows and each block of q once for its x rows."""
    @intrinsic
    def dots(typingctx, x, q, scale, offset, supers, xsum, out, o0, r0):  # noqa: ANN001, ANN202, ARG001
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            k = Builder(context, builder, signature, args)
            b = builder
            last = b.sub(cgutils.unpack_tuple(b, k.arrays[1].shape, 2)[0], ir.Constant(I64, 1))
            # A tile past the matrix's last row computes that row again (the same value, twice).
            o_index = [b.select(b.icmp_signed("<", o, last), o, last)
                       for o in (b.add(args[7], ir.Constant(I64, j)) for j in range(outs))]
            r_index = [b.add(args[8], ir.Constant(I64, r)) for r in range(rows)]
            qrows = [k.row(1, o) for o in o_index]
            xrows, xsums = ([k.row(arg, r) for r in r_index] for arg in (0, 5))
            zero = ir.Constant(VF, [0.0] * LANES)
            acc = [[cgutils.alloca_once_value(b, zero) for _ in range(rows)] for _ in range(outs)]
            acc_offset = [[cgutils.alloca_once_value(b, ir.Constant(F32, 0.0)) for _ in range(rows)]
                          for _ in range(outs)]

            def blocks_of(size: int) -> None:
                def block(index: ir.Value, factors: list[tuple[ir.Value, ir.Value]]) -> None:
                    first = b.mul(index, ir.Constant(I64, size))
                    parts = [b.add(first, ir.Constant(I64, p)) for p in range(0, size, LANES)]
                    xv = [[k.load_vector(xrow, p, VF) for p in parts] for xrow in xrows]
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
            cells = [(j, r) for j in range(outs) for r in range(rows)]
            for (j, r), total in zip(cells, k.horizontal_sums([b.load(acc[j][r]) for j, r in cells]), strict=True):
                b.store(b.fadd(total, b.load(acc_offset[j][r])), k.at(k.row(6, r_index[r]), o_index[j]))
            return context.get_dummy_value()
        return types.void(x, q, scale, offset, supers, xsum, out, o0, r0), codegen
    return dots


@intrinsic
def _dequantize_row(typingctx, q, scale, offset, supers, out, o):  # noqa: ANN001, ANN202, ARG001
    """`out[o] = scale[o, b] * q[o] + offset[o, b]`, block by block: one float32 row."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        k = Builder(context, builder, signature, args)
        b = builder
        o_ = args[5]
        qrow, orow = k.row(0, o_), k.row(4, o_)

        def blocks_of(size: int) -> None:
            def block(index: ir.Value, factors: list[tuple[ir.Value, ir.Value]]) -> None:
                s, m = (k.splat(f) for f in factors[0])
                first = b.mul(index, ir.Constant(I64, size))
                for p, values in zip(range(0, size, LANES), k.block_values(0, qrow, first, size), strict=True):
                    k.store_vector(b.call(k.fma_v, [values, s, m]), orow, b.add(first, ir.Constant(I64, p)))

            k.for_blocks(1, [o_], size, block)

        k.by_block_size(blocks_of, 0, 1)
        return context.get_dummy_value()
    return types.void(q, scale, offset, supers, out, o), codegen


# Tiles: 4, 2 or 1 rows of x against OUTS matrix rows.
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
    bounds = even_work(firsts, tiles, PARTS)  # the threads' tiles by work: groups' rows differ
    for p in prange(PARTS):
        for t in range(bounds[p], bounds[p + 1]):
            g, o = t // tiles, (t % tiles) * OUTS
            e = experts[g]
            _tiles(x, q[e], scale[e], offset[e], supers[e], xsum, out, o, firsts[g], firsts[g + 1])


@njit(cache=True, nogil=True)
def _dequantize(q, scale, offset, supers, out):  # noqa: ANN001, ANN202
    for o in range(q.shape[0]):
        _dequantize_row(q, scale, offset, supers, out, o)


def times(x: np.ndarray, q: np.ndarray, scale: np.ndarray, offset: np.ndarray, supers: np.ndarray) -> np.ndarray:
    """`x [n, in]` (float32) times the matrix `[out, in]` transposed: `[n, out]`."""
    if amx_kernels.takes(q, scale, len(x)):
        return amx_kernels.times(x, q, scale, offset, supers)
    if int8_kernels.takes(q.dtype):
        return int8_kernels.times(x, q, scale, offset, supers)
    n, columns = x.shape
    block = columns // scale.shape[1]
    xsum = np.add.reduce(x.reshape(n, -1, block), axis=-1)
    out = np.empty((n, len(q)), dtype=np.float32)
    _times(x, q, scale, offset, supers, xsum, out)
    return out


def grouped_times(x: np.ndarray, q: np.ndarray, scale: np.ndarray, offset: np.ndarray, supers: np.ndarray,
                  experts: np.ndarray, firsts: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """Grouped rows `firsts[g]:firsts[g + 1]` times matrix `experts[g]` of the stack `[matrices,
    out, in]` transposed: `[grouped rows, out]`, each row's values the bits `times` gives it.
    Grouped row r is row `rows[r]` of `x [n, in]` (None: row r; the AMX tiles read it there, the
    other kernels a gathered copy)."""
    # A decode step's few rows skip the largest group's count (a call a layer a step).
    if firsts[-1] > int8_kernels.COLUMN_ROWS and amx_kernels.takes(q, scale, int(np.max(np.diff(firsts)))):
        return amx_kernels.grouped_times(x, q, scale, offset, supers, experts, firsts, rows)
    x = x if rows is None else x[rows]
    if int8_kernels.takes(q.dtype):
        return int8_kernels.grouped_times(x, q, scale, offset, supers, experts, firsts)
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


def prepare(forms: Iterable[tuple[np.dtype, np.dtype, int]], stacked: Iterable[tuple[np.dtype, np.dtype]] = ()) -> str:
    """Compile the kernels for the (values dtype, scales dtype, block size) forms of the matrices
    the engine passes (the AMX tiles' product too, for those that run there), and the grouped one
    for expert stacks of `stacked` (or load them from Numba's cache, `cache=True`, written beside
    this module) without running them: compiled lazily, the first request after an install waited
    for them. What happened, for the banner."""
    started = time.perf_counter()
    forms = set(forms)
    matrix, cube = types.Array(types.float32, 2, "C"), types.Array(types.float32, 3, "C")
    for values, scales in sorted({(values, scales) for values, scales, _ in forms}, key=str):
        q, s = (types.Array(numba.from_dtype(dtype), 2, "C") for dtype in (values, scales))
        _times.compile((matrix, q, s, s, matrix, matrix, matrix))
        _dequantize.compile((q, s, s, matrix, matrix))
        if int8_kernels.takes(values):
            int8_kernels.prepare(q, s)
    ids = types.Array(types.int64, 1, "C")
    for values, scales in sorted(set(stacked), key=str):
        q, s = (types.Array(numba.from_dtype(dtype), 3, "C") for dtype in (values, scales))
        _grouped_times.compile((matrix, q, s, s, cube, matrix, matrix, ids, ids))
        if int8_kernels.takes(values):
            int8_kernels.prepare(q, s, ids)
    amx_kernels.prepare(forms)  # the block sizes tell the tiles' recipes apart
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
