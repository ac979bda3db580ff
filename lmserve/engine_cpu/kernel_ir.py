"""LLVM IR building blocks of the compiled kernels (`kernels`, `int8_kernels`): vector types, and a
builder that reads matrix rows, blocks and their scales in each form (`qmatrix.SCALE_FORMS`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.np.numpy_support import as_dtype

from lmserve.engine_cpu.qmatrix import (
    CRUMB_BYTES,
    CRUMBS,
    ENCODINGS,
    SIXBIT_BYTES,
    SIXBIT_GROUP,
    SIXBITS,
    SUPERBLOCK,
    TABLES,
    THREEBIT_BYTES,
    THREEBITS,
)

LANES = 16  # float32 values per vector: one AVX-512 register, two AVX2 ones, four NEON ones
F32, I8, I32, I64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
I16 = ir.IntType(16)
VF, VQ = ir.VectorType(F32, LANES), ir.VectorType(I8, LANES)
VH, VI32 = ir.VectorType(I16, LANES), ir.VectorType(I32, LANES)
BLOCK_SIZES = (32, 16)  # values per scale: quant_blocks.SUPPORTED's sizes
HALF_GROUP = 8  # float16 scales widened together (one AVX2 / two NEON conversions)
NIBBLE_GROUP = 32  # nibble-packed values: 16 bytes hold values 0-15 in the low halves, 16-31 in the high
# Matrix rows a tile computes: 2 make a 4-row decode step fastest on the float kernels, 1 is clearly
# slower, 4 a little; the int8 kernels run one matrix row at a time for few x rows instead
# (`int8_kernels.COLUMN_ROWS`; figures: docs/PERFORMANCE.md, measurements behind code choices).
OUTS = 2
BYTE_SHUFFLE = llvm.get_host_cpu_features().get("ssse3", False)  # `pshufb`: a table lookup per byte


class Builder:
    """The few IR patterns the kernels need, on one `llvmlite` builder."""

    def __init__(self, context, builder: ir.IRBuilder, signature, args) -> None:  # noqa: ANN001
        self.b = builder
        self.arrays = [context.make_array(t)(context, builder, a) if isinstance(t, types.Array) else None
                       for t, a in zip(signature.args, args, strict=True)]
        self.dtypes = [getattr(t, "dtype", None) for t in signature.args]
        self.fma_v = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VF, [VF] * 3),
                                                    "llvm.fma.v16f32")
        self.fma_s = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32, [F32] * 3),
                                                    "llvm.fma.f32")

    def by_block_size(self, emit: Callable[[int], None], values: int, scales: int) -> None:
        """`emit(size)` for each block size, run by the one that argument `values`' columns over
        argument `scales`' columns give: the loops are built for a constant size (a loop over a
        block's vectors with a run-time count made 4-row products slower; figures:
        docs/PERFORMANCE.md, measurements behind code choices)."""
        per, elements = ENCODINGS[as_dtype(self.dtypes[values])]  # `per` values in `elements` elements
        size = self.b.udiv(self.b.mul(self.columns(values), ir.Constant(I64, per)),
                           self.b.mul(self.columns(scales), ir.Constant(I64, elements)))
        with self.b.if_else(self.b.icmp_unsigned("==", size, ir.Constant(I64, BLOCK_SIZES[0]))) as (first, other):
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
        return self.b.gep(ptr, [offset if isinstance(offset, ir.Value) else ir.Constant(I64, offset)])

    def load_vector(self, ptr: ir.Value, offset: ir.Value, vector: ir.VectorType) -> ir.Value:
        return self.b.load(self.b.bitcast(self.at(ptr, offset), vector.as_pointer()), align=1)

    def store_vector(self, value: ir.Value, ptr: ir.Value, offset: ir.Value) -> None:
        self.b.store(value, self.b.bitcast(self.at(ptr, offset), VF.as_pointer()), align=4)

    def block_values(self, q: int, qrow: ir.Value, first: ir.Value, size: int) -> list[ir.Value]:
        """The `size` values of argument `q`'s row `qrow` from value `first` on (a block's
        start), as float32 vectors of LANES values, decoded as the argument's dtype says."""
        b, dtype = self.b, self.dtypes[q]
        form = as_dtype(dtype)
        if form in (SIXBITS, CRUMBS, THREEBITS):
            return self._two_bit_values(qrow, first, size, form)
        table = TABLES.get(form)
        if dtype == types.uint8 or table:  # 16 bytes hold 32 values: the low nibbles, then the high ones
            group = b.and_(first, ir.Constant(I64, -NIBBLE_GROUP))
            packed = self.load_vector(b.bitcast(qrow, I8.as_pointer()), b.lshr(group, ir.Constant(I64, 1)), VQ)
            low, high = b.and_(packed, ir.Constant(VQ, [0x0F] * LANES)), b.lshr(packed, ir.Constant(VQ, [4] * LANES))
            low, high = ((self._looked_up(v, table) for v in (low, high)) if table
                         else (b.uitofp(v, VF) for v in (low, high)))
            if size == NIBBLE_GROUP:
                return [low, high]
            second = b.icmp_unsigned("!=", b.sub(first, group), ir.Constant(I64, 0))  # a block of 16
            return [b.select(second, high, low)]
        vectors = []
        for p in range(0, size, LANES):
            at = b.add(first, ir.Constant(I64, p))
            if dtype == types.int8:
                vectors.append(b.sitofp(self.load_vector(qrow, at, VQ), VF))
            elif dtype == types.int16:  # float16 bits
                halves = b.bitcast(self.load_vector(qrow, at, VH), ir.VectorType(ir.HalfType(), LANES))
                vectors.append(b.fpext(halves, VF))
            else:  # uint16: bfloat16 bits, a float32's upper half
                wide = b.zext(self.load_vector(qrow, at, VH), VI32)
                vectors.append(b.bitcast(b.shl(wide, ir.Constant(VI32, [16] * LANES)), VF))
        return vectors

    def _looked_up(self, indices: ir.Value, table: tuple[int, ...]) -> ir.Value:
        """`table[indices]` as float32 (indices 0-15 a lane): one byte shuffle (`pshufb`) where the
        CPU has SSSE3 (every x86-64 one this runs on), else selects on each index bit, which made
        a one-row product 1.7x slower (figures: docs/PERFORMANCE.md, IQ4_NL, IQ4_XS and MXFP4 as
        nibbles)."""
        b = self.b
        if BYTE_SHUFFLE:
            shuffle = cgutils.get_or_insert_function(b.module, ir.FunctionType(VQ, [VQ, VQ]), "llvm.x86.ssse3.pshuf.b.128")
            return b.sitofp(b.call(shuffle, [ir.Constant(VQ, [level & 0xFF for level in table]), indices]), VF)
        values = [ir.Constant(VF, [float(level)] * LANES) for level in table]
        for bit in range(4):
            set_ = b.icmp_unsigned("!=", b.and_(indices, ir.Constant(VQ, [1 << bit] * LANES)), ir.Constant(VQ, [0] * LANES))
            values = [b.select(set_, values[i + 1], values[i]) for i in range(0, len(values), 2)]
        return values[0]

    def _two_bit_values(self, qrow: ir.Value, first: ir.Value, size: int, form: np.dtype) -> list[ir.Value]:
        """`block_values` of a SIXBITS, CRUMBS or THREEBITS row: block c (of 32) of a group has its
        2-bit values (SIXBITS: the high bits) in 16 bytes of the group's 32 at (c % 2) * 16, shifted
        by 2 * (c // 2) for the nibbles' low halves' values and 4 more for the high ones'; SIXBITS
        keeps the nibbles in the 16 bytes at c * 16 before them, THREEBITS the high bits in the 2
        bytes at 32 + 2 * c after them (the low halves') and 40 + 2 * c (the high halves')."""
        b = self.b
        data = b.bitcast(qrow, I8.as_pointer())
        group, within = (b.udiv(first, ir.Constant(I64, SIXBIT_GROUP)), b.urem(first, ir.Constant(I64, SIXBIT_GROUP)))
        chunk = b.udiv(within, ir.Constant(I64, NIBBLE_GROUP))
        sixbits, threebits = form == SIXBITS, form == THREEBITS
        base = b.mul(group, ir.Constant(I64, SIXBIT_BYTES if sixbits else THREEBIT_BYTES if threebits else CRUMB_BYTES))
        tops_at = b.add(base, ir.Constant(I64, SIXBIT_BYTES - CRUMB_BYTES)) if sixbits else base
        tops = self.load_vector(data, b.add(tops_at, b.mul(b.and_(chunk, ir.Constant(I64, 1)), ir.Constant(I64, 16))), VQ)
        shift = b.trunc(b.shl(b.lshr(chunk, ir.Constant(I64, 1)), ir.Constant(I64, 1)), I8)
        three, four = ir.Constant(VQ, [3] * LANES), ir.Constant(VQ, [4] * LANES)
        packed = self.load_vector(data, b.add(base, b.mul(chunk, ir.Constant(I64, 16))), VQ) if sixbits else None
        masks_at = b.add(base, b.add(b.mul(chunk, ir.Constant(I64, 2)), ir.Constant(I64, CRUMB_BYTES))) if threebits else None

        def half(nibble_shift: ir.Value, mask_offset: ir.Value) -> ir.Value:
            """The values of the low halves' lanes (shift 0, offset 0) or the high ones' (4, 8)."""
            tops_of = b.and_(b.lshr(tops, self.splat(b.add(shift, nibble_shift))), three)
            if sixbits:
                nibbles = b.and_(b.lshr(packed, self.splat(nibble_shift)), ir.Constant(VQ, [0x0F] * LANES))
                return b.uitofp(b.or_(nibbles, b.shl(tops_of, four)), VF)
            if threebits:
                mask = b.bitcast(self.load_vector(data, b.add(masks_at, mask_offset), I16), ir.VectorType(ir.IntType(1), LANES))
                return b.uitofp(b.select(mask, b.or_(tops_of, four), tops_of), VF)
            return b.uitofp(tops_of, VF)

        if size == NIBBLE_GROUP:
            return [half(ir.Constant(I8, 0), ir.Constant(I64, 0)), half(ir.Constant(I8, 4), ir.Constant(I64, 8))]
        # A block of 16: only its own half is decoded.
        second = b.icmp_unsigned("!=", b.urem(within, ir.Constant(I64, NIBBLE_GROUP)), ir.Constant(I64, 0))
        return [half(b.select(second, ir.Constant(I8, 4), ir.Constant(I8, 0)),
                     b.select(second, ir.Constant(I64, 8), ir.Constant(I64, 0)))]

    def splat(self, value: ir.Value, width: int = LANES) -> ir.Value:
        vector = ir.VectorType(value.type, width)
        one = self.b.insert_element(ir.Constant(vector, None), value, ir.Constant(I32, 0))
        return self.b.shuffle_vector(one, ir.Constant(vector, None), ir.Constant(ir.VectorType(I32, width), [0] * width))

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
        tables = [cgutils.alloca_once(b, F32, size=2 * per) for _ in rows]
        groups = b.udiv(blocks, ir.Constant(I64, per))
        with cgutils.for_range(b, groups) as group:
            first = b.mul(group.index, ir.Constant(I64, per))
            factors = b.shl(group.index, ir.Constant(I64, 1))  # FACTORED: the group's two in supers
            for table, (*pair, supers) in zip(tables, sources, strict=True):
                for i, source in enumerate(pair):  # the scales, then the offsets
                    values = self.expand(source, first, per, form, self.at(supers, b.add(factors, ir.Constant(I64, i))))
                    b.store(values, b.bitcast(self.at(table, i * per), values.type.as_pointer()), align=4)
            with cgutils.for_range(b, ir.Constant(I64, per)) as loop:
                body(b.add(first, loop.index), [(b.load(self.at(table, loop.index)),
                                                 b.load(self.at(table, b.add(loop.index, ir.Constant(I64, per)))))
                                                for table in tables])
        if form == types.int16:  # the blocks past the last whole group
            with cgutils.for_range(b, b.sub(blocks, b.mul(groups, ir.Constant(I64, per)))) as loop:
                index = b.add(b.mul(groups, ir.Constant(I64, per)), loop.index)
                body(index, [tuple(b.fpext(b.bitcast(b.load(self.at(source, index)), ir.HalfType()), F32)
                                   for source in pair) for *pair, _ in sources])

    def fma(self, vector: ir.VectorType) -> ir.Function:
        """`llvm.fma` for float32 vectors of `vector`'s width."""
        return cgutils.get_or_insert_function(self.b.module, ir.FunctionType(vector, [vector] * 3),
                                              f"llvm.fma.v{vector.count}f32")

    def expand(self, source: ir.Value, first: ir.Value, per: int, form: types.Type, factor: ir.Value) -> ir.Value:
        """`per` scales (or offsets) from block `first` on as float32: float32 loaded, float16
        bits widened, or int8 multiples of the float32 at `factor`."""
        b = self.b
        if form == types.float32:
            return self.load_vector(source, first, ir.VectorType(F32, per))
        if form == types.int16:
            halves = self.load_vector(source, first, ir.VectorType(I16, per))
            return b.fpext(b.bitcast(halves, ir.VectorType(ir.HalfType(), per)), ir.VectorType(F32, per))
        subs = b.sitofp(self.load_vector(source, first, ir.VectorType(I8, per)), ir.VectorType(F32, per))
        return b.fmul(self.splat(b.load(factor), per), subs)

    def horizontal_sums(self, vectors: list[ir.Value]) -> list[ir.Value]:
        """Each float vector's lanes summed (a power of two of vectors, of one width): pairwise,
        halving the lanes (16 -> 8 -> 4 -> 2 -> 1), each vector's in the same order whatever else
        is summed with it. Two vectors of cells `width` lanes wide become one of twice the cells
        half as wide, so one instruction adds halves of several cells: a tile's 8 cells take 8
        pair steps where one at a time took 32, which short rows (a MoE's down matrix) felt
        (figures: docs/PERFORMANCE.md, measurements behind code choices)."""
        b, width = self.b, vectors[0].type.count

        def halves(pair: list[ir.Value], cells: int, part: int) -> ir.Value:
            """The lanes of each cell's `part` half (0 low, 1 high), the first vector's cells first."""
            total = pair[0].type.count
            order = [v * total + cell * width + part * (width // 2) + i
                     for v in range(len(pair)) for cell in range(cells) for i in range(width // 2)]
            return b.shuffle_vector(pair[0], pair[-1], ir.Constant(ir.VectorType(I32, len(order)), order))

        cells = 1  # cells a vector holds, `width` lanes each
        while width > 1:
            pairs = [vectors[i:i + 2] for i in range(0, len(vectors), 2)]
            vectors = [b.fadd(halves(pair, cells, 0), halves(pair, cells, 1)) for pair in pairs]
            cells, width = cells * len(pairs[0]), width // 2
        return [b.extract_element(v, ir.Constant(I32, cell)) for v in vectors for cell in range(cells)]

    def horizontal_max(self, v: ir.Value) -> ir.Value:
        """The largest of a float vector's lanes (NaN lanes lose every comparison), halving."""
        b = self.b
        while v.type.count > 1:
            half = v.type.count // 2
            low, high = (b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, half), list(range(at, at + half))))
                         for at in (0, half))
            v = b.select(b.fcmp_ordered(">", high, low), high, low)
        return b.extract_element(v, ir.Constant(I32, 0))

    def horizontal_sum(self, v: ir.Value) -> ir.Value:
        """One vector's `horizontal_sums`."""
        (total,) = self.horizontal_sums([v])
        return total
