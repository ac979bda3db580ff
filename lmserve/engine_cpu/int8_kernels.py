"""Quantized-matrix products with int8 activations: integer dot products, as llama.cpp computes them.

The float kernels (`kernels`) convert every weight to float32 before a multiply-add, and that
conversion, not memory, bounds them (figures: docs/PERFORMANCE.md, NumPy engine: int8
activations). These quantize each row of x to int8 per weight block first (`dx * xq`, |xq| <= 127),
then multiply the weights' integers with it in int32: AVX-512 VNNI's `vpdpbusd` does 64 byte
products an instruction. A block's term is `scale * dx * (q . xq) + offset * dx * sum(xq)`, the
sums of the quantized values as llama.cpp's q8 blocks keep them, so a centered type's `d*(q-8)`
gives the same terms either way. Nibbles, six-, three- and two-bit values with FACTORED scales
(Q4_K; Q5_K, Q6_K; Q3_K; Q2_K) round x per superblock of 256 values instead, as llama.cpp's Q8_K
does: the int8 sub-block scales then multiply the int32 products in integers (`vpdpwssd`), and one
float multiply-add a superblock replaces one a block (`by_superblock`). Rows are independent, and their
blocks are summed in one order whatever rows share the call, so a row's result does not depend on
what it is batched with.

Values are read 128 at a time with 512-bit vectors, then 32 at a time with 128-bit ones past the
last whole 128. `vpdpbusd` multiplies unsigned bytes with signed ones: nibbles (0..15), six-bit
values (0..63, a nibble and its 2 high bits put together), three-bit ones (0..7, 2 bits and a
mask bit) and two-bit ones (0..3) are the unsigned side against xq; int8 weights, and the IQ4 and
MXFP4 levels their nibbles index (looked up with `vpshufb`), are the signed side against xq + 128,
less 128 times their own sum (one more `vpdpbusd`, against ones).
For every packed form, x is stored in the order the nibbles' low and high halves split a
128-value group (`_quantize`).

Where the CPU has AVX2 but not AVX-512 VNNI (AMD's Zen 1-3, Intel's client cores), the same IR
runs on AVX2's instructions (`_Step.dot`): `vpmaddubsw` sums byte products in pairs into int16
and `vpmaddwd` the pairs into int32, as llama.cpp's AVX2 kernels do, a 512-bit vector as two
256-bit registers; the sums are the same integers (the K-quants' float sums fold to one
register's lanes there, `scale_superblock_avx2`, so they round otherwise than VNNI's). Signed
weights there take x's sign instead of x + 128 (`_Step.signed_dot`), whose pairs would overflow
int16. Without either (`available`), the float kernels run.
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.numpy_support import as_dtype

from lmserve.engine_cpu import qmatrix
from lmserve.engine_cpu.expert_split import PARTS, even_work
from lmserve.engine_cpu.kernel_ir import F32, I8, I16, I32, I64, OUTS, Builder
from lmserve.engine_cpu.qmatrix import CRUMBS, FACTORED, INT8, NIBBLES, SIXBITS, SUPERBLOCK, TABLES, THREEBITS
from lmserve.model.gguf_file import ModelLoadError

WIDE, NARROW = 128, 32  # values a step: 512-bit vectors, then 128-bit ones past the last whole WIDE
AVX2_LANES = 8  # float32 lanes of an AVX2 register
# x values from which `_quantize` runs on the kernels' threads: below, a decode step's rows, the
# launch cost more than it gained (figures: docs/PERFORMANCE.md, measurements behind code choices).
PARALLEL_VALUES = 1 << 15
RUN = 16  # x values quantized and stored together: nibbles' x moves in runs of 16 (`_quantize`)
# The most rows of int8 values a product runs here (`wide_rows`); on AVX2, whose signed products
# take two more instructions, none: BLAS won at 64-128 rows (figures: docs/PERFORMANCE.md).
INT8_WIDE_ROWS = 128
# Up to this many x rows (a decode step's, a verify pass's, a decode step's expert groups), a
# product runs a matrix row at a time: from memory, tiles of OUTS rows ran 1.3-1.4x slower on
# expert groups of one or two rows and 5-15% slower on SmolLM2's matrices at 2-16 rows; at 64-256
# rows (prompt chunks) the tiles are 0-6% faster (figures: docs/PERFORMANCE.md, measurements
# behind code choices). Either way a row gets the same bits.
COLUMN_ROWS = 16
_FEATURES = ("avx512vnni", "avx512bw", "avx512vl")
_AVX2_FEATURES = ("avx2", "fma")


llvm.initialize_native_asmparser()  # Numba's JIT then reads `_Step.scaled_dot`'s inline assembly


def _has(names: tuple[str, ...]) -> bool:
    features = llvm.get_host_cpu_features()  # LLVM compiles for the host, as Numba does
    return all(features.get(name, False) for name in names)


VNNI = _has(_FEATURES)  # the byte products' instructions: AVX-512 VNNI's, else AVX2's (`_Step.dot`)


@functools.cache
def available() -> bool:
    """Whether this CPU has the instructions: AVX-512 VNNI's, or AVX2's slower equivalents."""
    return VNNI or _has(_AVX2_FEATURES)


ENV = "LMSERVE_CPU_DOTS"  # `float32`: the float kernels by default (the test suite sets it: --cpu-dots)
ENABLED = available() and os.environ.get(ENV, "auto") != "float32"


def choose(dots: str) -> None:
    """`int8` or `float32` activations for every product of this process from now on (`auto`:
    leave the default); ModelLoadError for int8 on a CPU without the instructions."""
    global ENABLED  # noqa: PLW0603  (one choice per process, as the CPU's features are)
    if dots == "int8" and not available():
        raise ModelLoadError(f"--cpu-dots int8 needs AVX-512 VNNI or AVX2 ({', '.join(_AVX2_FEATURES)}), which this CPU lacks")
    if dots != "auto":
        ENABLED = dots == "int8"


def takes(values: np.dtype) -> bool:
    """Whether a matrix whose values have this dtype runs here (the integer forms, on a VNNI or AVX2 CPU)."""
    return ENABLED and (values == INT8 or values in UNSIGNED or values in TABLES)


UNSIGNED = (NIBBLES, SIXBITS, CRUMBS, THREEBITS)  # the forms whose values are the unsigned side of `vpdpbusd`
# How `_quantize` stores x for a matrix's values (`x_layout`): in their order, as xq + 128 (the
# unsigned side, against signed weights), or as xq in the nibbles' lane order; NATURAL_SIGNED, xq
# in the values' order, is the AMX tiles' (`amx_kernels`).
NATURAL, NIBBLE_SIGNED, NIBBLE_OFFSET, NATURAL_SIGNED = 0, 1, 2, 3


def x_layout(values: np.dtype) -> int:
    """NATURAL for int8 values, NIBBLE_SIGNED for the unsigned packed ones (UNSIGNED),
    NIBBLE_OFFSET for the tables' levels (signed, in the nibbles' order)."""
    return NATURAL if values == INT8 else NIBBLE_SIGNED if values in UNSIGNED else NIBBLE_OFFSET


def wide_rows(values: np.dtype, columns: int) -> int:
    """The most rows a product runs here rather than dequantized for BLAS, where that is more than
    a decode step's (0: not here): rows of whole WIDE steps, any number for the packed forms and up
    to INT8_WIDE_ROWS for int8 values. Dequantizing costs BLAS a float32 copy of the matrix a call;
    int8 values (twice the bytes, one more `vpdpbusd`) lose that lead past about 128 rows, and rows
    that end in NARROW steps do not gain (figures: docs/PERFORMANCE.md, measurements behind code
    choices)."""
    if not takes(values) or columns % WIDE:
        return 0
    if values == INT8:
        return INT8_WIDE_ROWS if VNNI else 0
    return sys.maxsize


def _vector(element: ir.Type, count: int) -> ir.VectorType:
    return ir.VectorType(element, count)


def _chunks(b: ir.IRBuilder, vector: ir.Value, count: int) -> list[ir.Value]:
    """`vector` as `count` equal vectors of consecutive lanes (512 bits as AVX2's two 256)."""
    width = vector.type.count // count
    return [b.shuffle_vector(vector, vector, ir.Constant(_vector(I32, width), list(range(c * width, (c + 1) * width))))
            for c in range(count)]


class _Step:
    """One step's IR: `width` values of a matrix row of dtype `values` against int8 x rows, block
    size `size`. Every form but INT8 is in the nibbles' lane order; NIBBLES, SIXBITS, THREEBITS and
    CRUMBS are unsigned (x the signed side), INT8 and the tables' levels signed (x + 128 the
    unsigned side)."""

    def __init__(self, k: Builder, width: int, size: int, values: np.dtype) -> None:
        self.k, self.b, self.width, self.size = k, k.b, width, size
        self.sixbits, self.table = values == SIXBITS, TABLES.get(values)
        self.threebits = values == THREEBITS
        self.crumbs = values == CRUMBS or self.threebits  # CRUMBS' 2-bit values: all of them, or THREEBITS' low bits
        self.unsigned = values in UNSIGNED
        self.nibble_order = values != INT8
        self.bytes = width // 2  # bytes a vector: a 512-bit one for WIDE, 128-bit for NARROW
        self.lanes = self.bytes // 4  # int32 lanes a vector
        self.blocks = width // size
        self.zero = ir.Constant(_vector(I32, self.lanes), [0] * self.lanes)
        # Each of the two vectors' int32 lanes -> the block (of this step) its 4 products are in.
        if self.nibble_order:  # lane l: 16-byte chunk l // 4 of the low halves (values 0-15 of 32) or high (16-31)
            self.maps = [[(32 * (lane // 4) + half) // size for lane in range(self.lanes)] for half in (0, 16)]
        else:
            self.maps = [[(part * self.bytes + 4 * lane) // size for lane in range(self.lanes)] for part in (0, 1)]
        self.product_maps = self.maps[:1] if self.maps[0] == self.maps[1] else self.maps  # `products`' vectors'

    def _intrinsic(self, name: str, result: ir.Type, *arguments: ir.Type) -> ir.Function:
        return cgutils.get_or_insert_function(self.b.module, ir.FunctionType(result, arguments), name)

    def _joined(self, chunks: list[ir.Value]) -> ir.Value:
        """`_chunks`' inverse: the vectors' lanes one after another (a power of two of them)."""
        while len(chunks) > 1:
            width = chunks[0].type.count * 2
            chunks = [self.b.shuffle_vector(a, c, ir.Constant(_vector(I32, width), list(range(width))))
                      for a, c in zip(chunks[::2], chunks[1::2], strict=True)]
        return chunks[0]

    def _by_register(self, name: str, result: ir.Type, bits: int, *vectors: ir.Value) -> ir.Value:
        """AVX2 instruction `name` (taking vectors of `bits` and giving `result`'s lanes' type) on
        each register-wide chunk of `vectors`, joined: a 512-bit vector is two 256-bit registers."""
        count = max(1, vectors[0].type.count * vectors[0].type.element.width // bits)
        chunked = [_chunks(self.b, v, count) for v in vectors]
        lanes = _vector(result, bits // result.width)
        function = self._intrinsic(name, lanes, *(c[0].type for c in chunked))
        return self._joined([self.b.call(function, list(parts)) for parts in zip(*chunked, strict=True)])

    def _avx2(self, wide: str, narrow: str) -> tuple[str, int]:
        return (wide, 256) if self.width == WIDE else (narrow, 128)

    def dot(self, total: ir.Value, unsigned: ir.Value, signed: ir.Value) -> ir.Value:
        """`total` + each int32 lane's four byte products of `unsigned` and `signed` (`vpdpbusd`;
        on AVX2, `pair_sums` widened)."""
        if VNNI:
            return self.b.call(self._intrinsic(f"llvm.x86.avx512.vpdpbusd.{self.bytes * 8}", total.type, total.type,
                                               unsigned.type, signed.type), [total, unsigned, signed])
        return self.b.add(total, self.widened(self.pair_sums(unsigned, signed)))

    def pair_sums(self, unsigned: ir.Value, signed: ir.Value) -> ir.Value:
        """AVX2's `vpmaddubsw`: each int16 lane the sum of two byte products, saturating, so each
        pair's sum must fit, as it does with the unsigned side at most 63 or the signed one at
        most 127 against at most 128."""
        name, bits = self._avx2("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.ssse3.pmadd.ub.sw.128")
        return self._by_register(name, I16, bits, unsigned, signed)

    def widened(self, pairs: ir.Value, factors: ir.Value | None = None) -> ir.Value:
        """AVX2's `vpmaddwd`: each int32 lane the sum of its two int16 lanes of `pairs`, each times
        that lane of `factors` (an int32 vector's halves; None: ones)."""
        halves = pairs.type
        factors = ir.Constant(halves, [1] * halves.count) if factors is None else self.b.bitcast(factors, halves)
        name, bits = self._avx2("llvm.x86.avx2.pmadd.wd", "llvm.x86.sse2.pmadd.wd")
        return self._by_register(name, I32, bits, pairs, factors)

    def shuffle(self, table: ir.Value, indices: ir.Value) -> ir.Value:
        """Each byte of `indices` (0..15) looked up in its 16-byte lane of `table` (`vpshufb`)."""
        if VNNI or self.width == NARROW:
            name = "llvm.x86.avx512.pshuf.b.512" if self.width == WIDE else "llvm.x86.ssse3.pshuf.b.128"
            return self.b.call(self._intrinsic(name, table.type, table.type, indices.type), [table, indices])
        return self._by_register("llvm.x86.avx2.pshuf.b", I8, 256, table, indices)

    def signed_dot(self, total: ir.Value, weights: ir.Value, x: ir.Value) -> ir.Value:
        """`total` + each int32 lane's four products of signed `weights` and x stored as xq + 128
        (`_quantize`), less 128 times the weights' sums (`weight_sums`, taken off by the caller)
        on VNNI. AVX2's pairs of x + 128 (up to 255) against weights up to 127 would saturate
        int16, so there x is xq again and the sign moves to it, as llama.cpp's AVX2 kernels do:
        |w| times sign(w) * xq, nothing to take off."""
        if VNNI:
            return self.dot(total, x, weights)
        xq = self.b.xor(x, ir.Constant(x.type, [-128] * x.type.count))
        negative = self.b.icmp_signed("<", weights, ir.Constant(weights.type, [0] * weights.type.count))
        magnitudes = self.b.select(negative, self.b.sub(ir.Constant(weights.type, [0] * weights.type.count), weights),
                                   weights)
        name, bits = self._avx2("llvm.x86.avx2.psign.b", "llvm.x86.ssse3.psign.b.128")
        return self.dot(total, magnitudes, self._by_register(name, I8, bits, xq, weights))

    def scaled_dot(self, total: ir.Value, products: ir.Value, scales: ir.Value) -> ir.Value:
        """`total` + each lane's two int16 halves of `products` times those of `scales` (`vpdpwssd`),
        as one instruction: LLVM's intrinsic becomes `vpmaddwd` and `vpaddd` where the total is not
        zero (a shorter latency, but one more instruction where the loops are bound by them)."""
        return self.b.asm(ir.FunctionType(total.type, [total.type] * 3), "vpdpwssd $3, $2, $0", "=v,0,v,v",
                          [total, products, scales], side_effect=False)

    def weights(self, qrow: ir.Value, first: ir.Value) -> list[ir.Value]:
        """The row's two byte vectors from value `first` on: two int8 halves, or the nibbles' low
        and high lanes: nibbles (or their table's levels, by `vpshufb`), nibbles with their 2 high
        bits (SIXBITS), 2-bit values with their high bit (THREEBITS) or alone (CRUMBS; these three
        in whole WIDE groups)."""
        b, vector = self.b, _vector(I8, self.bytes)
        if not self.nibble_order:
            return [self.k.load_vector(qrow, b.add(first, ir.Constant(I64, p * self.bytes)), vector) for p in (0, 1)]
        data = b.bitcast(qrow, I8.as_pointer())
        if self.sixbits or self.crumbs:
            group_bytes = (qmatrix.SIXBIT_BYTES if self.sixbits else qmatrix.THREEBIT_BYTES if self.threebits
                           else qmatrix.CRUMB_BYTES)
            at = b.mul(b.udiv(first, ir.Constant(I64, qmatrix.SIXBIT_GROUP)), ir.Constant(I64, group_bytes))
            if self.threebits:
                return self._with_high_bits(self._two_bits(data, at, 0), data, at)
            if self.crumbs:
                return self._two_bits(data, at, 0)
        else:
            at = b.lshr(first, ir.Constant(I64, 1))
        packed = self.k.load_vector(data, at, vector)
        nibbles = [b.and_(packed, ir.Constant(vector, [0x0F] * self.bytes)),
                   b.lshr(packed, ir.Constant(vector, [4] * self.bytes))]
        if self.sixbits:
            tops = self._two_bits(data, b.add(at, ir.Constant(I64, self.bytes)), 4)
            return [b.or_(n, t) for n, t in zip(nibbles, tops, strict=True)]
        if self.table is None:
            return nibbles
        levels = ir.Constant(vector, [level & 0xFF for level in self.table] * (self.bytes // 16))
        return [self.shuffle(levels, n) for n in nibbles]

    def _two_bits(self, data: ir.Value, at: ir.Value, shift: int) -> list[ir.Value]:
        """The two 64-byte vectors of 2-bit values that the 32 bytes at byte `at` hold (SIXBITS'
        high bits, CRUMBS' values), shifted left by `shift`: fields 0 and 1 of each byte make the
        low vector's halves, 2 and 3 the high one's."""
        b, half = self.b, _vector(I8, self.bytes // 2)
        tops = self.k.load_vector(data, at, half)

        def field(index: int) -> ir.Value:
            move = shift - 2 * index
            moved = (b.shl(tops, ir.Constant(half, [move] * (self.bytes // 2))) if move > 0
                     else b.lshr(tops, ir.Constant(half, [-move] * (self.bytes // 2))) if move < 0 else tops)
            return b.and_(moved, ir.Constant(half, [3 << shift] * (self.bytes // 2)))

        both = ir.Constant(_vector(I32, self.bytes), list(range(self.bytes)))
        return [b.shuffle_vector(field(0), field(1), both), b.shuffle_vector(field(2), field(3), both)]

    def _with_high_bits(self, crumbs: list[ir.Value], data: ir.Value, at: ir.Value) -> list[ir.Value]:
        """THREEBITS' values: the group at byte `at`'s 2-bit values `crumbs` with 4 added where
        their 64-bit mask has the lane's bit (one `kmovq` and a masked byte add a vector)."""
        b, vector = self.b, _vector(I8, self.bytes)
        four = ir.Constant(vector, [4] * self.bytes)
        values = []
        for half, low in enumerate(crumbs):
            word = self.k.load_vector(data, b.add(at, ir.Constant(I64, qmatrix.CRUMB_BYTES + 8 * half)), I64)
            values.append(b.select(b.bitcast(word, _vector(ir.IntType(1), self.bytes)), b.or_(low, four), low))
        return values

    def lane_scales(self, srow: ir.Value, block: ir.Value) -> list[ir.Value]:
        """A superblock form's int8 sub-block scales from `block` on, one int32 vector for each
        of `products`' vectors: each lane's scale as the low int16 (the high one 0), for `vpdpwssd`;
        on AVX2 as both int16 halves, one for each of the lane's `pair_sums` (`scaled_products`)."""
        b, lanes = self.b, _vector(I32, self.lanes)
        subs = b.zext(b.sext(self.k.load_vector(srow, block, _vector(I8, self.blocks)), _vector(I16, self.blocks)),
                      _vector(I32, self.blocks))
        if not VNNI:
            subs = b.or_(subs, b.shl(subs, ir.Constant(subs.type, [16] * self.blocks)))
        return [b.shuffle_vector(subs, subs, ir.Constant(lanes, lane_map)) for lane_map in self.product_maps]

    def weight_sums(self, weights: list[ir.Value]) -> list[ir.Value] | None:
        """Signed weights on VNNI: 128 times their sums per lane, to take off the products with
        x + 128 (`signed_dot`)."""
        if self.unsigned or not VNNI:
            return None
        ones = ir.Constant(_vector(I8, self.bytes), [1] * self.bytes)
        seven = ir.Constant(_vector(I32, self.lanes), [7] * self.lanes)
        return [self.b.shl(self.dot(self.zero, ones, w), seven) for w in weights]

    def activations(self, xrow: ir.Value, first: ir.Value) -> list[ir.Value]:
        """An x row's two byte vectors from value `first` on, laid out as `weights` pairs them."""
        vector = _vector(I8, self.bytes)
        return [self.k.load_vector(xrow, self.b.add(first, ir.Constant(I64, p * self.bytes)), vector) for p in (0, 1)]

    def products(self, weights: list[ir.Value], sums: list[ir.Value] | None,
                 xs: list[ir.Value]) -> list[tuple[ir.Value, list[int]]]:
        """`q . xq` per int32 lane, as (vector, its lanes' blocks); the two vectors are added
        when their lanes hold the same blocks (nibbles of blocks of 32)."""
        b = self.b
        if not VNNI and self.unsigned:
            return [(self.widened(pair_sums), lane_map)
                    for pair_sums, lane_map in zip(self.pair_sums_of(weights, xs), self.product_maps, strict=True)]
        dot = self.dot if self.unsigned else self.signed_dot
        pairs = list(zip(weights, xs, strict=True))
        if len(self.product_maps) == 1:
            product = dot(dot(self.zero, *pairs[0]), *pairs[1])
            if sums is not None:
                product = b.sub(product, b.add(sums[0], sums[1]))
            return [(product, self.maps[0])]
        products = [dot(self.zero, *pair) for pair in pairs]
        if sums is not None:
            products = [b.sub(product, total) for product, total in zip(products, sums, strict=True)]
        return list(zip(products, self.maps, strict=True))

    def pair_sums_of(self, weights: list[ir.Value], xs: list[ir.Value]) -> list[ir.Value]:
        """AVX2, the unsigned forms: `pair_sums` of the two vectors, added in int16 when their
        lanes hold the same blocks (a pair of at most 63 * 127 twice, then two such: within
        32,767), so one `vpmaddwd` widens both."""
        sums = [self.pair_sums(w, x) for w, x in zip(weights, xs, strict=True)]
        return [self.b.add(*sums)] if len(self.product_maps) == 1 else sums

    def scaled_products(self, total: ir.Value, weights: list[ir.Value], xs: list[ir.Value],
                        scales: list[ir.Value]) -> ir.Value:
        """`total` + the superblock forms' products, each lane's times its sub-block scale
        (`lane_scales`): `vpdpwssd` on the int32 products; on AVX2, `vpmaddwd` on the int16 pair
        sums themselves, the scale in both halves, which saves widening them first."""
        if VNNI:
            for (product, _), lane_scales in zip(self.products(weights, None, xs), scales, strict=True):
                total = self.scaled_dot(total, product, lane_scales)
            return total
        for sums, lane_scales in zip(self.pair_sums_of(weights, xs), scales, strict=True):
            total = self.b.add(total, self.widened(sums, lane_scales))
        return total


def _dots(rows: int, outs: int, unpacked: bool):  # noqa: ANN202  (a Numba intrinsic)
    """`out[r0 + r, o0 + j] = sum_b scale[o, b] * dx[r0 + r, b] * (q[o, b] . xq[r0 + r, b]) +
    offset[o, b] * xsum[r0 + r, b]` (o = o0 + j) for r < `rows`, j < `outs`: a tile of the result
    (dx a superblock's, not a block's, where `by_superblock`). Where `unpacked`, the whole WIDE
    steps' weights (and a superblock form's lane scales) come from `_unpack`'s rows in argument
    `unpacked`, not from q; the arithmetic is the same either way."""
    @intrinsic
    def dots(typingctx, xq, q, scale, offset, supers, dx, xsum, out, o0, r0, unpacked_rows):  # noqa: ANN001, ANN202, ARG001
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            k = Builder(context, builder, signature, args)
            b = builder
            last = b.sub(cgutils.unpack_tuple(b, k.arrays[1].shape, 2)[0], ir.Constant(I64, 1))
            o_index = [b.select(b.icmp_signed("<", o, last), o, last)  # past the last row: it again
                       for o in (b.add(args[8], ir.Constant(I64, j)) for j in range(outs))]
            r_index = [b.add(args[9], ir.Constant(I64, r)) for r in range(rows)]
            qrows = [k.row(1, o) for o in o_index]
            sources = [[k.row(arg, o) for arg in (2, 3, 4)] for o in o_index]
            xrows, dxrows, sumrows = ([k.row(arg, r) for r in r_index] for arg in (0, 5, 6))
            form = as_dtype(k.dtypes[1])
            values = k.columns(0)
            wide = b.udiv(values, ir.Constant(I64, WIDE))
            narrow = b.udiv(b.sub(values, b.mul(wide, ir.Constant(I64, WIDE))), ir.Constant(I64, NARROW))
            totals = [[cgutils.alloca_once_value(b, ir.Constant(F32, 0.0)) for _ in range(rows)] for _ in range(outs)]
            decoded = [k.row(10, ir.Constant(I64, j)) for j in range(outs)] if unpacked else None

            def weights_of(step: _Step, j: int, first: ir.Value) -> list[ir.Value]:
                """Matrix row j's two byte vectors from value `first` on (`_Step.weights`)."""
                if decoded is None or step.width != WIDE or not step.nibble_order:
                    return step.weights(qrows[j], first)
                return [k.load_vector(decoded[j], b.add(first, ir.Constant(I64, p * step.bytes)), _vector(I8, step.bytes))
                        for p in (0, 1)]

            def accumulators(width: int) -> list[list[ir.Value]]:
                """A zeroed float32 vector of `width` lanes on the stack for each cell of the tile."""
                zero = ir.Constant(_vector(F32, width), [0.0] * width)
                return [[cgutils.alloca_once_value(b, zero) for _ in range(rows)] for _ in range(outs)]

            def add_up(*sets: list[list[ir.Value]]) -> None:
                """Each cell's accumulators (one of each set), summed into its total."""
                cells = [(j, r) for j in range(outs) for r in range(rows)]
                parts = [k.horizontal_sums([b.load(source[j][r]) for j, r in cells]) for source in sets]
                for (j, r), *terms in zip(cells, *parts, strict=True):
                    part = terms[0]
                    for term in terms[1:]:
                        part = b.fadd(part, term)
                    b.store(b.fadd(b.load(totals[j][r]), part), totals[j][r])

            def blocks_of(size: int) -> None:
                for width, steps, start in ((WIDE, wide, ir.Constant(I64, 0)),
                                            (NARROW, narrow, b.mul(wide, ir.Constant(I64, WIDE)))):
                    step = _Step(k, width, size, form)
                    lanes = _vector(F32, step.lanes)
                    blocks = _vector(F32, step.blocks)
                    acc, acc_offset = accumulators(step.lanes), accumulators(step.blocks)
                    with cgutils.for_range(b, steps) as loop:
                        first = b.add(start, b.mul(loop.index, ir.Constant(I64, width)))
                        block = b.udiv(first, ir.Constant(I64, size))
                        dxs = [k.load_vector(row, block, blocks) for row in dxrows]
                        sums = [k.load_vector(row, block, blocks) for row in sumrows]
                        xs = [step.activations(row, first) for row in xrows]
                        for j, (srow, mrow, super_row) in enumerate(sources):
                            factors = b.shl(b.udiv(first, ir.Constant(I64, SUPERBLOCK)), ir.Constant(I64, 1))
                            s, m = (k.expand(source, block, step.blocks, k.dtypes[2],
                                             k.at(super_row, b.add(factors, ir.Constant(I64, i))))
                                    for i, source in enumerate((srow, mrow)))
                            weights = weights_of(step, j, first)
                            weight_sums = step.weight_sums(weights)
                            for r in range(rows):
                                scaled = b.fmul(s, dxs[r])
                                for product, lane_map in step.products(weights, weight_sums, xs[r]):
                                    per_lane = b.shuffle_vector(scaled, scaled, ir.Constant(_vector(I32, step.lanes), lane_map))
                                    b.store(b.call(k.fma(lanes), [b.sitofp(product, lanes), per_lane, b.load(acc[j][r])]),
                                            acc[j][r])
                                b.store(b.call(k.fma(blocks), [m, sums[r], b.load(acc_offset[j][r])]), acc_offset[j][r])
                    add_up(acc, acc_offset)

            def scale_superblock_avx2(integer: ir.Value, scale: ir.Value, offsets: ir.Value, sums: ir.Value,
                                      total: ir.Value) -> None:
                """AVX2: a superblock's int32 sums `integer` folded to one register's AVX2_LANES
                (all its lanes share `scale`), converted and multiplied into `total`, the offsets'
                terms (`offsets` times x's block `sums`) folded into the same register: a 4 x 1
                tile's accumulators then stay in registers (Q4_K's products of 64-512 rows 1.1-1.3x faster;
                figures: docs/PERFORMANCE.md). The float sums differ from VNNI's in rounding only."""
                def registers(vector: ir.Value) -> list[ir.Value]:
                    return _chunks(b, vector, vector.type.count // AVX2_LANES)

                register = _vector(F32, AVX2_LANES)
                parts = registers(integer)
                folded = parts[0]
                for part in parts[1:]:
                    folded = b.add(folded, part)
                value = b.call(k.fma(register), [b.sitofp(folded, register), k.splat(scale, AVX2_LANES), b.load(total)])
                for offset, block_sum in zip(registers(offsets), registers(sums), strict=True):
                    value = b.call(k.fma(register), [offset, block_sum, value])
                b.store(value, total)

            def superblocks_of(size: int) -> None:
                """`by_superblock` matrices (Q4_K, Q3_K, Q2_K, Q5_K, Q6_K): x has one dx a
                superblock, so the sub-block scales multiply its int32 products in integers
                (`vpdpwssd`: a lane's product of 8 nibbles, 8 values of Q5_K's 0..31 or 4 of
                Q6_K's 0..63 with |xq| <= 127 fits an int16), and its float factor and dx scale
                the sum once, as llama.cpp's Q8_K products do."""
                step = _Step(k, WIDE, size, form)
                per = SUPERBLOCK // size
                lanes, lanes_i, blocks = _vector(F32, step.lanes), _vector(I32, step.lanes), _vector(F32, per)
                # Blocks of 16 (Q6_K, Q3_K, Q2_K) give a superblock as many offsets as a vector has
                # lanes: their products join the same accumulator, and a tile's 8 fewer registers
                # made products of 64-256 rows 4-20% faster. Q4_K's and Q5_K's 8 keep their own, which
                # widening them to 16 lanes made 3-7% slower at a decode step's 1-4 rows (figures:
                # docs/PERFORMANCE.md, measurements behind code choices).
                merged = per == step.lanes or not VNNI
                acc = accumulators(step.lanes if VNNI else AVX2_LANES)
                acc_offset = acc if merged else accumulators(per)
                with cgutils.for_range(b, b.udiv(values, ir.Constant(I64, SUPERBLOCK))) as loop:
                    first_block = b.mul(loop.index, ir.Constant(I64, per))
                    integer = [[ir.Constant(lanes_i, [0] * step.lanes)] * rows for _ in range(outs)]
                    for half in range(SUPERBLOCK // WIDE):
                        first = b.add(b.mul(loop.index, ir.Constant(I64, SUPERBLOCK)), ir.Constant(I64, half * WIDE))
                        block = b.add(first_block, ir.Constant(I64, half * step.blocks))
                        xs = [step.activations(row, first) for row in xrows]
                        for j, (srow, _, _) in enumerate(sources):
                            if decoded is None:
                                scales = step.lane_scales(srow, block)
                            else:  # as `_unpack` stored them past the weights
                                scales = [k.load_vector(decoded[j], b.add(b.add(values, first), ir.Constant(I64, m * step.bytes)),
                                                        lanes_i) for m in range(len(step.product_maps))]
                            weights = weights_of(step, j, first)
                            for r in range(rows):
                                integer[j][r] = step.scaled_products(integer[j][r], weights, xs[r], scales)
                    dxs = [b.load(k.at(row, loop.index)) for row in dxrows]
                    sums = [k.load_vector(row, first_block, blocks) for row in sumrows]
                    factors = b.shl(loop.index, ir.Constant(I64, 1))
                    for j, (_, mrow, super_row) in enumerate(sources):
                        factor = b.load(k.at(super_row, factors))
                        m = k.expand(mrow, first_block, per, k.dtypes[2], k.at(super_row, b.add(factors, ir.Constant(I64, 1))))
                        for r in range(rows):
                            if not VNNI:
                                scale_superblock_avx2(integer[j][r], b.fmul(factor, dxs[r]), m, sums[r], acc[j][r])
                                continue
                            scaled = k.splat(b.fmul(factor, dxs[r]), step.lanes)
                            b.store(b.call(k.fma(lanes), [b.sitofp(integer[j][r], lanes), scaled, b.load(acc[j][r])]),
                                    acc[j][r])
                            b.store(b.call(k.fma(blocks), [m, sums[r], b.load(acc_offset[j][r])]), acc_offset[j][r])
                if merged:
                    add_up(acc)
                else:
                    add_up(acc, acc_offset)

            per_superblock = by_superblock(*(as_dtype(k.dtypes[i]) for i in (1, 2)))
            k.by_block_size(superblocks_of if per_superblock else blocks_of, 1, 2)
            for j in range(outs):
                for r in range(rows):
                    b.store(b.load(totals[j][r]), k.at(k.row(7, r_index[r]), o_index[j]))
            return context.get_dummy_value()
        return types.void(xq, q, scale, offset, supers, dx, xsum, out, o0, r0, unpacked_rows), codegen
    return dots


def _unpack(outs: int):  # noqa: ANN202  (a Numba intrinsic)
    """Matrix rows `o0:o0 + outs` (past the last: it again), their whole WIDE steps as
    `_Step.weights` decodes them, a byte a value, into the rows of `unpacked` (2 bytes a value),
    and for a superblock form each step's `_Step.lane_scales` after them: a tile then decodes its
    matrix rows once, not once for each x rows it takes (prompt-sized products of the packed
    forms ran 3-26% faster; figures: docs/PERFORMANCE.md). int8 values are read as they are."""
    @intrinsic
    def unpack(typingctx, q, scale, unpacked, o0):  # noqa: ANN001, ANN202, ARG001
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            k = Builder(context, builder, signature, args)
            b = builder
            last = b.sub(cgutils.unpack_tuple(b, k.arrays[0].shape, 2)[0], ir.Constant(I64, 1))
            form = as_dtype(k.dtypes[0])
            values = b.udiv(k.columns(2), ir.Constant(I64, 2))
            superblocks = by_superblock(form, as_dtype(k.dtypes[1]))
            if form == INT8:  # read as they are: nothing to decode
                return context.get_dummy_value()

            def emit(size: int) -> None:
                step = _Step(k, WIDE, size, form)

                def store(vector: ir.Value, target: ir.Value, at: ir.Value) -> None:
                    b.store(vector, b.bitcast(k.at(target, at), vector.type.as_pointer()), align=1)

                for j in range(outs):
                    o = b.add(args[3], ir.Constant(I64, j))
                    o = b.select(b.icmp_signed("<", o, last), o, last)
                    target = k.row(2, ir.Constant(I64, j))
                    with cgutils.for_range(b, b.udiv(values, ir.Constant(I64, WIDE))) as loop:
                        first = b.mul(loop.index, ir.Constant(I64, WIDE))
                        for p, vector in enumerate(step.weights(k.row(0, o), first)):
                            store(vector, target, b.add(first, ir.Constant(I64, p * step.bytes)))
                        if superblocks:
                            block = b.udiv(first, ir.Constant(I64, size))
                            for m, vector in enumerate(step.lane_scales(k.row(1, o), block)):
                                store(vector, target, b.add(b.add(values, first), ir.Constant(I64, m * step.bytes)))
            k.by_block_size(emit, 0, 1)
            return context.get_dummy_value()
        return types.void(q, scale, unpacked, o0), codegen
    return unpack


def _by_rows(four, two, one):  # noqa: ANN001, ANN202  (Numba intrinsics in, a Numba function out)
    """The product of matrix rows from `o` on with x rows `r:stop` by tiles of a row count: four x
    rows at a time, then two, then one."""
    @njit(inline="always", nogil=True)
    def run(xq, q, scale, offset, supers, dx, xsum, out, o, r, stop, unpacked):  # noqa: ANN001, ANN202
        while r + 4 <= stop:
            four(xq, q, scale, offset, supers, dx, xsum, out, o, r, unpacked)
            r += 4
        if r + 2 <= stop:
            two(xq, q, scale, offset, supers, dx, xsum, out, o, r, unpacked)
            r += 2
        if r < stop:
            one(xq, q, scale, offset, supers, dx, xsum, out, o, r, unpacked)
    return run


def _row_by_row(one):  # noqa: ANN001, ANN202  (a Numba intrinsic in, a Numba function out)
    """`_by_rows` with tiles of one x row."""
    @njit(inline="always", nogil=True)
    def run(xq, q, scale, offset, supers, dx, xsum, out, o, r, stop, unpacked):  # noqa: ANN001, ANN202
        for row in range(r, stop):
            one(xq, q, scale, offset, supers, dx, xsum, out, o, row, unpacked)
    return run


# A prompt chunk's tiles: on VNNI, OUTS matrix rows by 4, 2 or 1 x rows. AVX2 has half as many
# registers, each half as wide, and there a tile of 4 matrix rows by one x row was the fastest
# measured (products of 64 and 512 x rows 1.1-1.7x faster than VNNI's tiles; 8 by 1, 2 by 1 and
# 4 by 2 slower; figures: docs/PERFORMANCE.md, measurements behind code choices).
TILE_OUTS = OUTS if VNNI else 4
# Matrix rows `o:o + TILE_OUTS`, from `_unpack_tile`'s rows; matrix row `o`, from the matrix
# itself (`unpacked` unread). Either way a row gets the same bits.
_tiles = (_by_rows(*(_dots(rows, TILE_OUTS, unpacked=True) for rows in (4, 2, 1))) if VNNI
          else _row_by_row(_dots(1, TILE_OUTS, unpacked=True)))
_column = _by_rows(*(_dots(rows, 1, unpacked=False) for rows in (4, 2, 1)))
_unpack_tile = _unpack(TILE_OUTS)


# How far ahead of the matrix row it is on a thread asks the caches for the row it will reach, in
# a decode step's products (`_columns`, `_grouped_columns`): their weights come from memory once a
# step, one row after another, a row's products take less time than its bytes take to arrive, and
# the hardware's prefetchers start over at each 4 KiB page and each expert. In bytes, so that wide
# rows are not asked for further ahead than L1 holds (figures: docs/PERFORMANCE.md, measurements
# behind code choices).
PREFETCH_BYTES = 4096
PREFETCH = 3  # `llvm.prefetch`'s locality: into every level, L1 included


@intrinsic
def _prefetch_row(typingctx, matrix, index):  # noqa: ANN001, ANN202, ARG001
    """Ask the caches for row `index` of the 2-D C-contiguous `matrix`, a cache line at a time
    (a hint: a row past the end faults nothing)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        k = Builder(context, builder, signature, args)
        b = builder
        size = b.mul(k.columns(0), ir.Constant(I64, as_dtype(k.dtypes[0]).itemsize))
        start = b.bitcast(k.row(0, args[1]), I8.as_pointer())
        function = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]),
                                                  "llvm.prefetch.p0i8")  # read, PREFETCH, data cache
        with cgutils.for_range_slice(b, ir.Constant(I64, 0), size, ir.Constant(I64, 64)) as (offset, _):
            b.call(function, [b.gep(start, [offset]), ir.Constant(I32, 0), ir.Constant(I32, PREFETCH), ir.Constant(I32, 1)])
        return context.get_dummy_value()
    return types.void(matrix, index), codegen


@njit(inline="always", nogil=True)
def _prefetch(q, scale, offset, supers, o):  # noqa: ANN001, ANN202
    """Matrix row `o`'s values and scales into the caches (`_prefetch_row`)."""
    _prefetch_row(q, o)
    _prefetch_row(scale, o)
    _prefetch_row(offset, o)
    _prefetch_row(supers, o)


@njit(inline="always", nogil=True)
def _rows_ahead(q):  # noqa: ANN001, ANN202
    """The matrix rows PREFETCH_BYTES of `q`'s values span (at least one)."""
    return max(1, PREFETCH_BYTES // (q.shape[-1] * q.itemsize))


@njit(parallel=True, cache=True, nogil=True)
def _times(x, q, scale, offset, supers, layout, superblocks):  # noqa: ANN001, ANN202
    """x rounded to int8 (one call: a launch's own cost is a few microseconds, and a decode step
    makes 100-400 of them), then its product with the matrix: a matrix row at a time for a few
    rows of x (COLUMN_ROWS), in tiles of TILE_OUTS matrix rows for more."""
    size = x.shape[1] // scale.shape[1]
    xq, dx, xsum = _quantize(x, size, SUPERBLOCK if superblocks else size, layout)
    out = np.empty((x.shape[0], q.shape[0]), np.float32)
    if x.shape[0] <= COLUMN_ROWS:
        _columns(xq, q, scale, offset, supers, dx, xsum, out, _rows_ahead(q))
        return out
    tiles = -(-q.shape[0] // TILE_OUTS)
    for p in prange(PARTS):
        unpacked = np.empty((TILE_OUTS, 2 * x.shape[1]), np.int8)
        for tile in range(tiles * p // PARTS, tiles * (p + 1) // PARTS):
            _unpack_tile(q, scale, unpacked, tile * TILE_OUTS)
            _tiles(xq, q, scale, offset, supers, dx, xsum, out, tile * TILE_OUTS, 0, x.shape[0], unpacked)
    return out


@njit(parallel=True, cache=True, nogil=True)
def _grouped_times(x, q, scale, offset, supers, layout, superblocks, experts, firsts):  # noqa: ANN001, ANN202
    size = x.shape[1] // scale.shape[2]
    xq, dx, xsum = _quantize(x, size, SUPERBLOCK if superblocks else size, layout)
    out = np.empty((x.shape[0], q.shape[1]), np.float32)
    rows = q.shape[1]
    if np.max(firsts[1:] - firsts[:-1]) <= COLUMN_ROWS:
        _grouped_columns(xq, q, scale, offset, supers, dx, xsum, experts, firsts, out, _rows_ahead(q))
        return out
    tiles = -(-rows // TILE_OUTS)
    bounds = even_work(firsts, tiles, PARTS)  # the threads' tiles by work: groups' rows differ
    for p in prange(PARTS):
        unpacked = np.empty((TILE_OUTS, 2 * x.shape[1]), np.int8)
        for t in range(bounds[p], bounds[p + 1]):
            g, o = t // tiles, (t % tiles) * TILE_OUTS
            e = experts[g]
            _unpack_tile(q[e], scale[e], unpacked, o)
            _tiles(xq, q[e], scale[e], offset[e], supers[e], dx, xsum, out, o, firsts[g], firsts[g + 1], unpacked)
    return out


@njit(parallel=True, cache=True, nogil=True)
def _columns(xq, q, scale, offset, supers, dx, xsum, out, ahead):  # noqa: ANN001, ANN202
    """`_times`' product for a few rows of x (quantized): a matrix row at a time on the threads,
    each asking the caches for the row `ahead` rows on (0: for none, a benchmark's baseline)."""
    for o in prange(q.shape[0]):
        if ahead > 0 and o + ahead < q.shape[0]:
            _prefetch(q, scale, offset, supers, o + ahead)
        _column(xq, q, scale, offset, supers, dx, xsum, out, o, 0, xq.shape[0], xq)


@njit(parallel=True, cache=True, nogil=True)
def _grouped_columns(xq, q, scale, offset, supers, dx, xsum, experts, firsts, out, ahead):  # noqa: ANN001, ANN202
    """`_grouped_times`' product for groups of a few rows: the threads' matrix rows split by work,
    each thread asking the caches for the row `ahead` on, in the next group's expert past this
    one's last row (0: for none)."""
    rows = q.shape[1]
    bounds = even_work(firsts, rows, PARTS)
    for p in prange(PARTS):
        for t in range(bounds[p], bounds[p + 1]):
            g, o = t // rows, t % rows
            e = experts[g]
            if ahead > 0 and t + ahead < bounds[PARTS]:
                f, a = experts[(t + ahead) // rows], (t + ahead) % rows
                _prefetch(q[f], scale[f], offset[f], supers[f], a)
            _column(xq, q[e], scale[e], offset[e], supers[e], dx, xsum, out, o, firsts[g], firsts[g + 1], xq)


@njit(parallel=True, cache=True, nogil=True)
def _quantize(x, size, group, layout):  # noqa: ANN001, ANN202
    """Each `group` values of each row of x as `dx * xq`, |xq| <= 127 (NaN dx where the group is
    not finite): `group` is the weights' block `size`, or a superblock (`by_superblock`); and
    `dx * sum(xq)` of each block of `size`. Signed weights' x (int8, the tables' levels) is
    stored as xq + 128 (the unsigned side); packed weights' (every form but int8, `x_layout`) in
    each whole WIDE group as the nibbles' low halves' values, then the high halves'; the AMX
    tiles' (NATURAL_SIGNED) as xq in the values' order.
    Rows on the kernels' threads where there are many (a prompt chunk's)."""
    n, columns = x.shape
    xq = np.empty((n, columns), np.int8)
    dx, xsum = np.empty((n, columns // group), np.float32), np.empty((n, columns // size), np.float32)
    if n * columns < PARALLEL_VALUES:  # a decode step's: a thread launch costs more
        for r in range(n):
            _quantize_row(x, xq, dx, xsum, r, size, group, layout)
    else:
        for r in prange(n):
            _quantize_row(x, xq, dx, xsum, r, size, group, layout)
    return xq, dx, xsum


@njit(inline="always", nogil=True)
def _quantize_row(x, xq, dx, xsum, r, size, group, layout):  # noqa: ANN001, ANN202
    """`_quantize` of row r, in loops that vectorize: the largest |value| of a group is found as
    the largest of their bits (whose integer order is that of non-negative floats; past the finite
    ones' lie inf and NaN), and values are stored in runs of RUN, the unit nibbles move in."""
    columns = x.shape[1]
    wide = columns // WIDE * WIDE
    row = x[r]
    bits = row.view(np.uint32)
    top = np.empty(1, np.uint32)
    top_float = top.view(np.float32)
    for g in range(columns // group):
        start = g * group
        largest = np.uint32(0)
        for i in range(start, start + group):
            largest = max(largest, bits[i] & np.uint32(0x7FFFFFFF))
        top[0] = largest
        peak = top_float[0]
        d = peak / np.float32(127.0)
        inverse = np.float32(127.0) / peak if peak > 0 else np.float32(0.0)
        for block in range(start // size, (start + group) // size):
            quantized = 0
            for first in range(block * size, (block + 1) * size, RUN):
                at = first
                if layout in (NIBBLE_SIGNED, NIBBLE_OFFSET) and first < wide:
                    # value c*32 + h*16 + t of a group -> h*64 + c*16 + t
                    within = first % WIDE
                    at += within % 32 // 16 * 64 + within // 32 * 16 - within
                source, target = row[first:first + RUN], xq[r, at:at + RUN]
                if layout in (NIBBLE_SIGNED, NATURAL_SIGNED):
                    for t in range(RUN):
                        v = np.int32(np.rint(source[t] * inverse))
                        quantized += v
                        target[t] = v
                else:
                    for t in range(RUN):
                        v = np.int32(np.rint(source[t] * inverse))
                        quantized += v
                        target[t] = v ^ -128  # the byte of v + 128
            xsum[r, block] = d * np.float32(quantized)
        dx[r, g] = d if largest < np.uint32(0x7F800000) else np.float32(np.nan)


def by_superblock(values: np.dtype, scales: np.dtype) -> bool:
    """Whether x is rounded a superblock at a time for a matrix of these dtypes (`_quantize`), and
    its product is `_dots`' `superblocks_of`: the unsigned packed forms (nibbles, six, three and two
    bits) with FACTORED scales. Signed values keep a dx a block: IQ4_XS's (up to 127) would overflow
    `vpdpwssd`'s int16 (figures: docs/PERFORMANCE.md, measurements behind code choices)."""
    return x_layout(values) == NIBBLE_SIGNED and scales == FACTORED


def times(x: np.ndarray, q: np.ndarray, scale: np.ndarray, offset: np.ndarray, supers: np.ndarray) -> np.ndarray:
    """`kernels.times` for the integer forms (`takes`)."""
    return _times(x, q, scale, offset, supers, x_layout(q.dtype), by_superblock(q.dtype, scale.dtype))


def grouped_times(x: np.ndarray, q: np.ndarray, scale: np.ndarray, offset: np.ndarray, supers: np.ndarray,
                  experts: np.ndarray, firsts: np.ndarray) -> np.ndarray:
    """`kernels.grouped_times` for the integer forms (`takes`)."""
    return _grouped_times(x, q, scale, offset, supers, x_layout(q.dtype), by_superblock(q.dtype, scale.dtype), experts,
                          firsts)


def prepare(q: types.Array, scales: types.Array, ids: types.Array | None = None) -> None:
    """Compile the product for values and scales of these Numba types (`kernels.prepare`): the
    plain one, or with `ids` the grouped one for expert stacks."""
    matrix, cube = types.Array(types.float32, 2, "C"), types.Array(types.float32, 3, "C")
    layout = types.int64  # `x_layout`'s, as `times` passes it
    if ids is None:
        _times.compile((matrix, q, scales, scales, matrix, layout, types.boolean))
    else:
        _grouped_times.compile((matrix, q, scales, scales, cube, layout, types.boolean, ids, ids))
