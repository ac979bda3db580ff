"""Prompt-sized int8 products on Intel AMX tiles, for Q4_K, Q5_K and Q6_K matrices.

A prompt chunk's products with the K-quants were where the NumPy engine spent most of a MoE
prompt; `vpdpbusd` (`int8_kernels`) does 64 byte products an instruction, one `tdpbusd` 16 x 16 x
64. The arithmetic is `int8_kernels`': x is rounded to int8 a superblock of 256 values at a time
(`_quantize`), the weights' integers times it are summed exactly, and the superblock's factor
and dx are applied in float32. The offsets' term (Q4_K's and Q5_K's) is a float32 product on the
AMX-BF16 tiles, each float32 as bfloat16 parts (`_offsets_terms`).

The sub-block scales differ every 16 or 32 values, and a C tile's sum cannot be scaled between
blocks. So each scale is split into digits that, times a value, still fit a byte (`Recipe`):
Q4_K's nibbles times a scale's low 4 bits and its high 2, Q5_K's 5-bit values times 3 bits and
3, Q6_K's centered values (-32..31) times three balanced base-7 digits of its signed scale. Each
digit makes a plane of the matrix's rows (`_unpack_planes`); a superblock's four chunks of 64
values then accumulate in one C per plane, and the planes' weighted sum is the scaled integer
product (`_plane_product`). One pass over 64 values costs a `tdpbusd` a plane, where a store of C
and a scaling of each of its rows every block cost more than the product itself (figures:
docs/PERFORMANCE.md, NumPy engine: AMX tiles).

A thread's step is 16 matrix rows (A, a tile a plane) by 16 or 32 x rows (B: x laid out once a
call, 4 bytes of each row a tile row, `_pack`). A product takes the tiles where its call (an
expert's group) has more than `int8_kernels.COLUMN_ROWS` rows: a decode step's and a verify
pass's rows keep the VNNI kernels' one-row bits, and a prompt chunk's row gets the tiles' bits,
whatever else the chunk holds. The two differ in float32's rounding only (a block's sum is one
integer here, 16 lane sums there).

Linux on a CPU with AMX-INT8 and AMX-BF16 only (every CPU with AMX has both): the kernel grants a
process the tiles' state on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), which `available` makes
before anything runs here.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.numpy_support import as_dtype

from lmserve.engine_cpu import int8_kernels
from lmserve.engine_cpu.expert_split import PARTS, even_work
from lmserve.engine_cpu.int8_kernels import COLUMN_ROWS, NATURAL_SIGNED, WIDE, _quantize, by_superblock
from lmserve.engine_cpu.kernel_ir import F32, I8, I32, I64, Builder
from lmserve.engine_cpu.qmatrix import NIBBLES, SIXBITS, SUPERBLOCK, values_in
from lmserve.model.gguf_file import ModelLoadError

ROWS = 16  # a tile's rows: matrix rows in A and C, x rows in B's columns
LANES = 16  # int32 or float32 values a C row holds, one 512-bit vector
CHUNK = 4 * LANES  # values an A tile's row holds: 64 bytes
_FEATURES = ("amx-tile", "amx-int8", "amx-bf16")  # bfloat16: the offsets' term
_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
ENV = "LMSERVE_CPU_TILES"  # `off`: the VNNI kernels for every product (a benchmark's baseline)
PTR = I8.as_pointer()
VF, VI = ir.VectorType(F32, LANES), ir.VectorType(I32, LANES)
VI64, VMASK = ir.VectorType(I64, LANES), ir.VectorType(ir.IntType(1), LANES)


@functools.cache
def available() -> bool:
    """Whether this CPU has AMX-INT8 and AMX-BF16 and this process may use its tiles (asked for once,
    here)."""
    if sys.platform != "linux" or not int8_kernels.available():
        return False
    features = llvm.get_host_cpu_features()
    if not all(features.get(name, False) for name in _FEATURES):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def call_void(builder: ir.IRBuilder, name: str, argument_types: list[ir.Type], arguments: list[ir.Value]) -> None:
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), argument_types), name)
    builder.call(function, arguments)


def byte_address(context, builder, signature, args, i: int, offset: ir.Value) -> ir.Value:  # noqa: ANN001
    """The byte `offset` bytes into argument i's array data."""
    array = context.make_array(signature.args[i])(context, builder, args[i])
    return builder.gep(builder.bitcast(array.data, PTR), [offset])


@intrinsic
def configure_tiles(typingctx, config):  # noqa: ANN001, ANN202, ARG001
    """`ldtilecfg` from the 64 bytes of `config` (`tile_config`): each thread, before its tiles."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        call_void(builder, "llvm.x86.ldtilecfg", [PTR], [byte_address(context, builder, signature, args, 0, ir.Constant(I64, 0))])
        return context.get_dummy_value()
    return types.void(config), codegen


@intrinsic
def release_tiles(typingctx):  # noqa: ANN001, ANN202, ARG001
    """`tilerelease`: the thread's tile state back to its initial (unsaved) form."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202, ARG001
        call_void(builder, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()
    return types.void(), codegen


def _transposed(b: ir.IRBuilder, rows: list[ir.Value]) -> list[ir.Value]:
    """16 vectors of 16 lanes transposed: off-diagonal blocks of 8, 4, 2 and 1 lanes swapped."""
    rows = list(rows)
    distance = LANES // 2
    while distance:
        low = ir.Constant(ir.VectorType(I32, LANES), [j if j & distance == 0 else LANES + j - distance for j in range(LANES)])
        high = ir.Constant(ir.VectorType(I32, LANES), [j + distance if j & distance == 0 else LANES + j for j in range(LANES)])
        for i in range(LANES):
            if i & distance == 0:
                a, c = rows[i], rows[i + distance]
                rows[i], rows[i + distance] = b.shuffle_vector(a, c, low), b.shuffle_vector(a, c, high)
        distance //= 2
    return rows


@dataclass(frozen=True)
class Recipe:
    """How a form's sub-block scales become planes of bytes (digits, `_fill_digits`) and how the
    planes' products add up again: `sum(weights[p] * C_p)` is the block-scaled integer product, exact."""

    weights: tuple[int, ...]  # each plane's weight: the scale is `sum(weights[p] * digit_p)`
    x_tiles: int  # x tiles a product takes at once: C tiles are planes times x tiles (at most 4)
    center: int  # subtracted from each value before the digit multiplies it (the centered Q6_K)
    signed: bool  # planes of signed bytes (`tdpbssd`), else unsigned (`tdpbusd`)
    offsets: bool  # whether the offsets' term (each block's offset times x's block sum) is added

    @property
    def planes(self) -> int:
        return len(self.weights)


# Q4_K: nibbles (0-15) times a 6-bit scale's low 4 bits (0-15) and high 2 (0-3) fit a byte;
# Q5_K: 0-31 times 3 bits and 3; Q6_K: (0-63) - 32 times balanced base-7 digits of its int8
# scale (-3..3) fit a signed byte, and centering takes the offsets' term away.
NIBBLE_RECIPE = Recipe((1, 16), 2, 0, False, True)
FIVE_BIT_RECIPE = Recipe((1, 8), 2, 0, False, True)
SIX_BIT_RECIPE = Recipe((1, 7, 49), 1, 32, True, False)


def _plane_product(recipe: Recipe):  # noqa: ANN202  (a Numba intrinsic)
    """16 matrix rows, given as `recipe.planes` planes of bytes (rows p*16:(p+1)*16 of `unpacked`,
    `_unpack_planes`), times x tiles `x_tile` on (`xb [tiles, chunks of 64, 16, 16]`) into `out`'s
    rows `first` on (those before `stop`), columns `o0:o0 + 16` (those it has). A superblock's
    blocks share C, so each C sums 256 values in four `tdpbusd` (or `tdpbssd`) of 64; the planes'
    weighted sum is the block-scaled integer product, times each row's factor and dx (`dxt [tiles,
    superblocks, 16]`), summed in `total [x tiles, 16, 16]` (from the offsets' term where the
    recipe has one, `_offsets_terms`, else from zeros) and transposed into x rows at the end. Tiles: C of (x tile t, plane p) at t * planes + p; A of plane p after them; B
    of x tile t after those. A superblock's C is stored (`products`, two buffers) and read back
    once the next superblock's products are issued."""
    planes, x_tiles = recipe.planes, recipe.x_tiles
    c_tiles = planes * x_tiles
    dot = "llvm.x86.tdpbssd" if recipe.signed else "llvm.x86.tdpbusd"

    @intrinsic
    def product(typingctx, unpacked, xb, x_tile, products, factors, dxt, total, out, first, o0, stop):  # noqa: ANN001, ANN202, ARG001
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            k, b = Builder(context, builder, signature, args), builder
            tile = functools.partial(ir.Constant, I8)
            fma = k.fma(VF)
            stride = k.columns(0)
            chunks = cgutils.unpack_tuple(b, k.arrays[1].shape, 4)[1]
            superblocks = cgutils.unpack_tuple(b, k.arrays[5].shape, 3)[1]
            x_tile = args[2]
            chunk_bytes = ROWS * LANES * 4
            per_superblock = SUPERBLOCK // CHUNK
            totals = [[k.at(k.data(6), ir.Constant(I64, (t * ROWS + r) * LANES)) for r in range(ROWS)] for t in range(x_tiles)]
            if not recipe.offsets:  # else `total` holds the offsets' term (`_offsets_terms`)
                for rows in totals:
                    for cell in rows:
                        k.store_vector(ir.Constant(VF, [0.0] * LANES), cell, ir.Constant(I64, 0))

            def buffer(superblock: ir.Value, c: int) -> ir.Value:
                """Byte offset in `products` of C tile c of `superblock`: superblocks alternate between two buffers."""
                which = b.and_(superblock, ir.Constant(I64, 1))
                return b.mul(b.add(b.mul(which, ir.Constant(I64, 4)), ir.Constant(I64, c)), ir.Constant(I64, chunk_bytes))

            with cgutils.for_range(b, b.add(superblocks, ir.Constant(I64, 1))) as loop:
                with b.if_then(b.icmp_unsigned("<", loop.index, superblocks)):
                    for c in range(c_tiles):
                        call_void(b, "llvm.x86.tilezero", [I8], [tile(c)])
                    for part in range(per_superblock):
                        chunk = b.add(b.mul(loop.index, ir.Constant(I64, per_superblock)), ir.Constant(I64, part))
                        for plane in range(planes):
                            at = b.add(b.mul(chunk, ir.Constant(I64, CHUNK)), b.mul(stride, ir.Constant(I64, plane * ROWS)))
                            call_void(b, "llvm.x86.tileloadd64", [I8, PTR, I64],
                                  [tile(c_tiles + plane), byte_address(context, b, signature, args, 0, at), stride])
                        for t in range(x_tiles):
                            at = b.mul(b.add(b.mul(b.add(x_tile, ir.Constant(I64, t)), chunks), chunk), ir.Constant(I64, chunk_bytes))
                            call_void(b, "llvm.x86.tileloadd64", [I8, PTR, I64],
                                  [tile(c_tiles + planes + t), byte_address(context, b, signature, args, 1, at), ir.Constant(I64, 4 * LANES)])
                        for t in range(x_tiles):
                            for plane in range(planes):
                                call_void(b, dot, [I8] * 3, [tile(t * planes + plane), tile(c_tiles + plane), tile(c_tiles + planes + t)])
                    for c in range(c_tiles):
                        call_void(b, "llvm.x86.tilestored64", [I8, PTR, I64],
                              [tile(c), byte_address(context, b, signature, args, 3, buffer(loop.index, c)), ir.Constant(I64, LANES * 4)])
                with b.if_then(b.icmp_unsigned(">", loop.index, ir.Constant(I64, 0))):
                    superblock = b.sub(loop.index, ir.Constant(I64, 1))
                    for t in range(x_tiles):
                        tile_index = b.add(x_tile, ir.Constant(I64, t))
                        dxs = k.load_vector(k.data(5), b.mul(b.add(b.mul(tile_index, superblocks), superblock), ir.Constant(I64, LANES)), VF)
                        stored = [b.bitcast(byte_address(context, b, signature, args, 3, buffer(superblock, t * planes + plane)), I32.as_pointer())
                                  for plane in range(planes)]
                        for r in range(ROWS):
                            row, at = ir.Constant(I64, r), ir.Constant(I64, r * LANES)
                            exact = k.load_vector(stored[0], at, VI)
                            for plane, weight in enumerate(recipe.weights[1:], start=1):
                                exact = b.add(exact, b.mul(k.load_vector(stored[plane], at, VI), ir.Constant(VI, [weight] * LANES)))
                            scaled = b.fmul(dxs, k.splat(b.load(k.at(k.row(4, row), superblock))))
                            value = b.call(fma, [b.sitofp(exact, VF), scaled, k.load_vector(totals[t][r], ir.Constant(I64, 0), VF)])
                            k.store_vector(value, totals[t][r], ir.Constant(I64, 0))
            store = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), [VF, VF.as_pointer(), I32, VMASK]),
                                                   "llvm.masked.store.v16f32.p0")
            columns = b.sub(k.columns(7), args[9])
            mask = b.icmp_signed("<", ir.Constant(VI64, list(range(LANES))), k.splat(columns, LANES))
            for t, rows in enumerate(totals):
                values = [k.load_vector(cell, ir.Constant(I64, 0), VF) for cell in rows]
                first = b.add(args[8], ir.Constant(I64, t * ROWS))
                for m, value in enumerate(_transposed(b, values)):
                    with b.if_then(b.icmp_signed("<", b.add(first, ir.Constant(I64, m)), args[10])):
                        target = k.at(k.row(7, b.add(first, ir.Constant(I64, m))), args[9])
                        b.call(store, [value, b.bitcast(target, VF.as_pointer()), ir.Constant(I32, 4), mask])
            return context.get_dummy_value()
        signature = types.void(unpacked, xb, x_tile, products, factors, dxt, total, out, first, o0, stop)
        return signature, codegen
    return product


# The offsets' term in bfloat16 products. x's block sums are float32s, each three bfloat16 parts
# (`_parts`); an offset (a 6-bit integer times a float16) has at most 17 significant bits, which
# two parts hold exactly. Their products whose parts' sizes add to at most 2^-16 of the whole (0
# the largest part), the small ones first: what is left out is below float32's rounding.
OFFSET_PARTS, SUM_PARTS = 2, 3
PART_PRODUCTS = ((1, 1), (0, 2), (1, 0), (0, 1), (0, 0))  # (offset's part, sum's part)


@intrinsic
def _offsets_terms(typingctx, parts, xsb, first, tiles, terms):  # noqa: ANN001, ANN202, ARG001
    """The offsets' term of x tiles `first` to `first + tiles` for 16 matrix rows, into `terms
    [>= tiles, 16, 16]` (the sums `_plane_product` starts from): row r's 16 x rows `sum over
    blocks of offsets[r, block] * xsum[x row, block]`, both float32s as bfloat16 parts (`_parts`:
    `parts [OFFSET_PARTS, 16, 32 steps]` and `xsb [x tiles, SUM_PARTS, steps, 16, 32]`, 32
    blocks a step) in PART_PRODUCTS' `tdpbf16ps` a step. 5 products of an x tile where 512
    vector FMAs took a fifth of Q4_K's products; all of a unit's x tiles in one call, two C tiles
    in turn, since a product waits for the last into its C (figures: docs/PERFORMANCE.md, NumPy
    engine: AMX tiles). Tiles: C 0 and 1, A's parts from 2, B's after them."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        k, b = Builder(context, builder, signature, args), builder
        tile = functools.partial(ir.Constant, I8)
        load = ("llvm.x86.tileloadd64", [I8, PTR, I64])
        row_bytes, tile_bytes = ir.Constant(I64, 4 * LANES), ir.Constant(I64, ROWS * LANES * 4)
        width = cgutils.unpack_tuple(b, k.arrays[0].shape, 3)[2]
        steps = b.udiv(width, ir.Constant(I64, 32))
        sums = 2 + OFFSET_PARTS  # B's first tile
        with cgutils.for_range(b, b.udiv(b.add(args[3], ir.Constant(I64, 1)), ir.Constant(I64, 2))) as pair:
            for c in range(2):
                i = b.add(b.mul(pair.index, ir.Constant(I64, 2)), ir.Constant(I64, c))
                with b.if_then(b.icmp_signed("<", i, args[3])):
                    call_void(b, "llvm.x86.tilezero", [I8], [tile(c)])
                    with cgutils.for_range(b, steps) as step:
                        for part in range(OFFSET_PARTS):
                            at = b.add(b.mul(ir.Constant(I64, part), b.mul(width, ir.Constant(I64, 2 * ROWS))),
                                       b.mul(step.index, row_bytes))
                            call_void(b, *load, [tile(2 + part), byte_address(context, b, signature, args, 0, at),
                                                 b.mul(width, ir.Constant(I64, 2))])
                        x_tile = b.add(args[2], i)
                        for part in range(SUM_PARTS):
                            index = b.add(b.mul(b.add(b.mul(x_tile, ir.Constant(I64, SUM_PARTS)), ir.Constant(I64, part)), steps),
                                          step.index)
                            call_void(b, *load, [tile(sums + part), byte_address(context, b, signature, args, 1,
                                                                              b.mul(index, tile_bytes)), row_bytes])
                        for left, right in PART_PRODUCTS:
                            call_void(b, "llvm.x86.tdpbf16ps", [I8] * 3, [tile(c), tile(2 + left), tile(sums + right)])
                    call_void(b, "llvm.x86.tilestored64", [I8, PTR, I64],
                              [tile(c), byte_address(context, b, signature, args, 4, b.mul(i, tile_bytes)), row_bytes])
        return context.get_dummy_value()
    return types.void(parts, xsb, first, tiles, terms), codegen


def _unpack_planes(recipe: Recipe):  # noqa: ANN202  (a Numba intrinsic)
    """Matrix rows `o0:o0 + 16` (past the last: it again) as the recipe's planes in the rows of
    `unpacked` (plane p in rows p*16:(p+1)*16), a byte a value in the values' order: each value,
    less the recipe's center, times its block's digit for that plane (`digits [planes, 16,
    blocks]`). `int8_kernels._Step.weights` decodes a WIDE group in the nibbles' lane order
    (values c*32 + h*16 + t at h*64 + c*16 + t), reordered here."""
    half = WIDE // 2
    orders = [[h * half + c * 16 + t for c in range(part * 2, part * 2 + 2) for h in range(2) for t in range(16)]
              for part in range(2)]

    @intrinsic
    def unpack(typingctx, q, digits, unpacked, o0):  # noqa: ANN001, ANN202, ARG001
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            k, b = Builder(context, builder, signature, args), builder
            last = b.sub(cgutils.unpack_tuple(b, k.arrays[0].shape, 2)[0], ir.Constant(I64, 1))
            step = int8_kernels._Step(k, WIDE, 32, as_dtype(k.dtypes[0]))  # noqa: SLF001  (its decoding, shared)
            bytes_ = ir.VectorType(I8, half)
            values = k.columns(2)
            blocks = cgutils.unpack_tuple(b, k.arrays[1].shape, 3)[2]
            size = b.udiv(values, blocks)
            center = ir.Constant(bytes_, [recipe.center] * half)
            for j in range(ROWS):
                o = b.add(args[3], ir.Constant(I64, j))
                o = b.select(b.icmp_signed("<", o, last), o, last)
                with cgutils.for_range(b, b.udiv(values, ir.Constant(I64, WIDE))) as loop:
                    first = b.mul(loop.index, ir.Constant(I64, WIDE))
                    low, high = step.weights(k.row(0, o), first)
                    for part, order in enumerate(orders):
                        vector = b.sub(b.shuffle_vector(low, high, ir.Constant(ir.VectorType(I32, half), order)), center)
                        at = b.add(first, ir.Constant(I64, part * half))
                        for plane in range(recipe.planes):
                            row = k.at(k.data(1), b.mul(ir.Constant(I64, plane * ROWS + j), blocks))
                            lanes = _lane_digits(k, row, at, size, half)
                            target = k.row(2, ir.Constant(I64, plane * ROWS + j))
                            b.store(_times_digits(b, vector, lanes, recipe.signed), b.bitcast(k.at(target, at), bytes_.as_pointer()),
                                    align=1)
            return context.get_dummy_value()
        return types.void(q, digits, unpacked, o0), codegen
    return unpack


def _times_digits(b: ir.IRBuilder, values: ir.Value, digits: ir.Value, signed: bool) -> ir.Value:
    """Each byte of `values` times its byte of `digits`. Unsigned, as 16-bit words: a word's two
    values lie in one block, whose digit the word's low byte holds, and each product (at most
    Q4_K's 15 x 15 or Q5_K's 31 x 7) fits its byte without a carry into the other: one `vpmullw`
    where LLVM's byte product takes about eight instructions (Q4_K's grouped product of a MoE
    pass, 2,048 rows over 32 experts: 9.2 -> 8.3 ms). Signed (Q6_K's centered values), a
    negative low byte's product would carry into the high one: the byte product."""
    if signed:
        return b.mul(values, digits)
    words = ir.VectorType(ir.IntType(16), values.type.count // 2)
    digit = b.and_(b.bitcast(digits, words), ir.Constant(words, [0xFF] * words.count))
    return b.bitcast(b.mul(b.bitcast(values, words), digit), values.type)


def _lane_digits(k: Builder, row: ir.Value, at: ir.Value, size: ir.Value, lanes: int) -> ir.Value:
    """A byte vector of `lanes` values from value `at` on: each lane its block's digit (`row`,
    a digit a block; blocks of `size`, 16 or 32)."""
    b = k.b
    first = b.udiv(at, size)
    quarter = [k.splat(b.load(k.at(row, b.add(first, b.udiv(ir.Constant(I64, i * 16), size)))), lanes)
               for i in range(lanes // 16)]
    pairs = [b.shuffle_vector(quarter[i], quarter[i + 1], ir.Constant(ir.VectorType(I32, lanes),
                                                                       [lane // 16 % 2 * lanes + lane for lane in range(lanes)]))
             for i in (0, 2)]
    return b.shuffle_vector(pairs[0], pairs[1], ir.Constant(ir.VectorType(I32, lanes),
                                                            [lane // 32 * lanes + lane for lane in range(lanes)]))


@njit(nogil=True)
def tile_config():  # noqa: ANN202
    """The 64 bytes `ldtilecfg` reads: palette 1, and all 8 tiles of 16 rows of 64 bytes (C: 16
    int32; A: a chunk's 64 values; B: 16 rows of 16 x rows' 4 bytes)."""
    config = np.zeros(64, np.uint8)
    config[0] = 1
    for t in range(8):
        config[16 + 2 * t] = 4 * LANES
        config[48 + t] = ROWS
    return config


@njit(inline="always", nogil=True)
def rounded_bf16(bits):  # noqa: ANN001, ANN202
    """The bfloat16 nearest a float32's bits (ties to even), as the high 16 bits of a uint32."""
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)


@njit(nogil=True)
def _parts(values, parts):  # noqa: ANN001, ANN202
    """Float32 `values` (2-D, C-contiguous) as bfloat16 parts each (`parts [count, *values.shape]`,
    their bits, largest first), each the bfloat16 nearest what the ones before leave: three hold
    a float32's 24 bits, two a value of 17 significant bits. Loops over whole rows, which
    vectorize."""
    left = values.copy()
    rounded = np.empty_like(values)
    left_bits, rounded_bits = left.view(np.uint32), rounded.view(np.uint32)
    for part in range(parts.shape[0]):
        for r in range(values.shape[0]):
            for i in range(values.shape[1]):
                bits = rounded_bf16(left_bits[r, i])
                rounded_bits[r, i] = bits
                parts[part, r, i] = np.uint16(bits >> np.uint32(16))
            for i in range(values.shape[1]):
                left[r, i] -= rounded[r, i]


@njit(parallel=True, nogil=True)
def _pack(xq, dx, xsum_parts, rows, starts, stops, bases, xb, dxt, xsb):  # noqa: ANN001, ANN202
    """Each group's rows `starts[g]:stops[g]` (x row `rows[r]` for row r) as B tiles from tile
    `bases[g]` on (16 rows a tile, past the group's last row zeros): `xb [tiles, chunks, 16, 16]` int32, 4 bytes of each
    row a lane; their dx likewise as `dxt`; where `xsb [tiles, SUM_PARTS, steps, 16, 32]` (zeros)
    has steps, their block sums' parts (`xsum_parts [SUM_PARTS, x rows, blocks]`, `_parts`) as
    `tdpbf16ps`' B tiles (step s row i lane n: blocks 32 s + 2 i and + 1 of x row n). A tile at a
    time, on the kernels' threads."""
    words = xq.view(np.int32)
    per_chunk = CHUNK // 4
    groups = np.searchsorted(bases, np.arange(bases[-1]), side="right") - 1
    for tile in prange(bases[-1]):
        g = groups[tile]
        first = starts[g] + (tile - bases[g]) * ROWS
        for lane in range(ROWS):
            if first + lane < stops[g]:
                r = rows[first + lane]
                for c in range(xb.shape[1]):
                    for i in range(per_chunk):
                        xb[tile, c, i, lane] = words[r, c * per_chunk + i]
                for part in range(SUM_PARTS if xsb.shape[2] else 0):
                    for block in range(xsum_parts.shape[2]):
                        xsb[tile, part, block // 32, block % 32 // 2, 2 * lane + block % 2] = xsum_parts[part, r, block]
                for s in range(dxt.shape[1]):
                    dxt[tile, s, lane] = dx[r, s]
            else:
                for c in range(xb.shape[1]):
                    for i in range(per_chunk):
                        xb[tile, c, i, lane] = 0
                for s in range(dxt.shape[1]):
                    dxt[tile, s, lane] = 0


RECIPES = (NIBBLE_RECIPE, FIVE_BIT_RECIPE, SIX_BIT_RECIPE)


@njit(nogil=True)
def _fill_digits(scale, o0, digits, signed, bits):  # noqa: ANN001, ANN202
    """Matrix rows `o0:o0 + 16`'s sub-block scales (`scale [rows, blocks]`, past the last row:
    it again) as a recipe's digits, `digits [planes, 16, blocks]`: unsigned scales split at
    `bits` (nibbles: 4, Q5_K: 3); `signed` ones in balanced base 7 (-3..3, Q6_K)."""
    last = scale.shape[0] - 1
    for j in range(ROWS):
        o = min(o0 + j, last)
        for block in range(scale.shape[1]):
            value = np.int64(scale[o, block])
            if signed:
                shifted = value + 171  # 3 * (1 + 7 + 49): every digit shifted up by 3
                for plane in range(3):
                    digits[plane, j, block] = shifted % 7 - 3
                    shifted //= 7
            else:
                digits[0, j, block] = value & ((1 << bits) - 1)
                digits[1, j, block] = value >> bits


def _grouped_body(recipe: Recipe):  # noqa: ANN202  (a Numba function, inlined into `_grouped_by`'s)
    """The grouped product by `recipe`'s planes: rows `starts[g]:stops[g]` (x's rows `rows[r]`,
    each rounded to int8 once however many groups take it) times matrix `experts[g]` of the
    stack q into `out`, on `threads` threads (each with its buffers and tile
    configuration once, for a run of the units: a group's 16 matrix rows each)."""
    product, unpack = _plane_product(recipe), _unpack_planes(recipe)
    x_tiles, planes, signed, with_offsets = recipe.x_tiles, recipe.planes, recipe.signed, recipe.offsets
    bits = recipe.weights[1].bit_length() - 1

    @njit(inline="always", nogil=True)
    def grouped(x, rows, q, scale, offset, supers, experts, starts, stops, out, threads):  # noqa: ANN001, ANN202
        columns = x.shape[1]
        size = columns // scale.shape[2]
        per = SUPERBLOCK // size
        blocks, superblocks = columns // size, columns // SUPERBLOCK
        xq, dx, xsum = _quantize(x, size, SUPERBLOCK, NATURAL_SIGNED)
        groups = len(starts)
        bases = np.zeros(groups + 1, np.int64)
        for g in range(groups):
            bases[g + 1] = bases[g] + -(-(stops[g] - starts[g]) // (ROWS * x_tiles)) * x_tiles
        xb = np.empty((bases[groups], columns // CHUNK, CHUNK // 4, LANES), np.int32)
        dxt = np.empty((bases[groups], superblocks, LANES), np.float32)
        steps = -(-blocks // 32) if with_offsets else 0  # Q6_K's are centered away
        xsum_parts = np.empty((SUM_PARTS, len(xsum), blocks if with_offsets else 0), np.uint16)
        if with_offsets:
            _parts(xsum, xsum_parts)
        xsb = np.zeros((bases[groups], SUM_PARTS, steps, ROWS, 32), np.uint16)
        _pack(xq, dx, xsum_parts, rows, starts, stops, bases, xb, dxt, xsb)
        rows = q.shape[1]
        tiles = -(-rows // ROWS)
        spans = np.zeros(groups + 1, np.int64)
        spans[1:] = np.cumsum(stops - starts)
        bounds = even_work(spans, tiles, PARTS)
        most = 0  # x tiles of the largest group
        for g in range(groups):
            most = max(most, bases[g + 1] - bases[g])
        for thread in prange(threads):
            config = tile_config()
            configure_tiles(config)
            digits = np.empty((planes, ROWS, blocks), np.int8)
            unpacked = np.empty((planes * ROWS, columns), np.uint8)
            products = np.empty((2, 4, ROWS, LANES), np.int32)
            terms = np.empty((most, ROWS, ROWS), np.float32)  # a group's x tiles' `total`s
            factors = np.empty((ROWS, superblocks), np.float32)
            offsets = np.zeros((ROWS, steps * 32), np.float32)  # past the last block: zeros
            offset_parts = np.empty((OFFSET_PARTS, ROWS, steps * 32), np.uint16)
            for unit in range(bounds[PARTS * thread // threads], bounds[PARTS * (thread + 1) // threads]):
                g, o0 = unit // tiles, unit % tiles * ROWS
                e = experts[g]
                _fill_digits(scale[e], o0, digits, signed, bits)
                unpack(q[e], digits, unpacked, o0)
                for j in range(ROWS):
                    o = min(o0 + j, rows - 1)
                    for s in range(superblocks if with_offsets else 0):
                        least = supers[e, o, 2 * s + 1]
                        for block in range(s * per, (s + 1) * per):
                            offsets[j, block] = offset[e, o, block] * least
                    for s in range(superblocks):
                        factors[j, s] = supers[e, o, 2 * s]
                if with_offsets:
                    _parts(offsets, offset_parts)
                    _offsets_terms(offset_parts, xsb, bases[g], bases[g + 1] - bases[g], terms)
                for x_tile in range(bases[g], bases[g + 1], x_tiles):
                    first = starts[g] + (x_tile - bases[g]) * ROWS
                    total = terms[x_tile - bases[g]:x_tile - bases[g] + x_tiles]
                    product(unpacked, xb, x_tile, products, factors, dxt, total, out, first, o0, stops[g])
            release_tiles()
        return out
    return grouped


_nibble_body, _five_bit_body, _six_bit_body = (_grouped_body(recipe) for recipe in RECIPES)
# A compiled function a recipe, each cached under its own name: with the recipe an argument, every
# recipe's code was compiled into each (16 s cold for one form, about 8 s now), and closures made by one
# factory would share one name in Numba's cache index.


@njit(parallel=True, cache=True, nogil=True)
def _grouped_nibbles(x, rows, q, scale, offset, supers, experts, starts, stops, out, threads):  # noqa: ANN001, ANN202
    return _nibble_body(x, rows, q, scale, offset, supers, experts, starts, stops, out, threads)


@njit(parallel=True, cache=True, nogil=True)
def _grouped_five_bits(x, rows, q, scale, offset, supers, experts, starts, stops, out, threads):  # noqa: ANN001, ANN202
    return _five_bit_body(x, rows, q, scale, offset, supers, experts, starts, stops, out, threads)


@njit(parallel=True, cache=True, nogil=True)
def _grouped_six_bits(x, rows, q, scale, offset, supers, experts, starts, stops, out, threads):  # noqa: ANN001, ANN202
    return _six_bit_body(x, rows, q, scale, offset, supers, experts, starts, stops, out, threads)


_GROUPED = (_grouped_nibbles, _grouped_five_bits, _grouped_six_bits)  # by recipe, RECIPES' order


def recipe_for(values: np.dtype, scales: np.dtype, block: int) -> int | None:
    """The index in RECIPES of a matrix form (values' and scales' dtypes, values a scale; None: not
    on the tiles): Q4_K (nibbles, blocks of 32), Q5_K (six bits, blocks of 32) or Q6_K (six bits,
    blocks of 16)."""
    if not by_superblock(values, scales):
        return None
    if values == NIBBLES and block == 32:
        return 0
    if values == SIXBITS:
        return 1 if block == 32 else 2
    return None


def recipe_of(q: np.ndarray, scale: np.ndarray) -> int | None:
    """`recipe_for` a matrix's arrays (or an expert stack's)."""
    return recipe_for(q.dtype, scale.dtype, values_in(q.dtype, q.shape[-1]) // scale.shape[-1])


def check_setting() -> None:
    """ModelLoadError for an ENV value other than `auto` or `off` (checked at load, as the
    settings are, rather than taken silently as `auto`)."""
    value = os.environ.get(ENV, "auto")
    if value not in ("auto", "off"):
        raise ModelLoadError(f"{ENV} must be auto or off, not {value!r}")


def enabled() -> bool:
    """Whether products may take the tiles: available here, and not turned off (ENV, read at each
    product, so a benchmark can alternate the two in one process)."""
    return os.environ.get(ENV, "auto") != "off" and available()


def takes_form(q: np.ndarray, scale: np.ndarray) -> bool:
    """Whether a prompt chunk's products with this matrix (or stack) run here: int8 activations
    on, a form with a recipe, the tiles enabled."""
    return int8_kernels.takes(q.dtype) and recipe_of(q, scale) is not None and enabled()


def takes(q: np.ndarray, scale: np.ndarray, rows: int) -> bool:
    """Whether a product of `rows` x rows with this matrix runs here (each group's rows, for a
    stack): `takes_form`, and more rows than a verify pass."""
    return rows > COLUMN_ROWS and takes_form(q, scale)


def grouped_times(x: np.ndarray, q: np.ndarray, scale: np.ndarray, offset: np.ndarray, supers: np.ndarray,
                  experts: np.ndarray, firsts: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """`int8_kernels.grouped_times` with the groups of more than COLUMN_ROWS rows on the tiles;
    the others keep `int8_kernels`' kernels, whose bits are a decode step's. Grouped row r is x's
    row `rows[r]` (None: row r): a MoE's experts read its prompt rows where they are, each rounded
    to int8 once, rather than a copy of each row for each of its experts."""
    if not available():  # the tiles' instructions would end the process (SIGILL)
        raise RuntimeError("AMX tiles are not available to this process")
    rows = np.arange(firsts[-1]) if rows is None else rows
    sizes = np.diff(firsts)
    large = sizes > COLUMN_ROWS
    out = np.empty((len(rows), q.shape[1]), np.float32)
    _GROUPED[recipe_of(q, scale)](x, rows, q, scale, offset, supers, experts[large], firsts[:-1][large], firsts[1:][large],
                                  out, get_num_threads())
    if not large.all():
        small = np.concatenate([np.arange(a, b) for a, b in zip(firsts[:-1][~large], firsts[1:][~large], strict=True)])
        small_firsts = np.concatenate([[0], np.cumsum(sizes[~large])])
        out[small] = int8_kernels.grouped_times(x[rows[small]], q, scale, offset, supers, experts[~large], small_firsts)
    return out


def times(x: np.ndarray, q: np.ndarray, scale: np.ndarray, offset: np.ndarray, supers: np.ndarray) -> np.ndarray:
    """`int8_kernels.times` on the tiles (`takes`)."""
    whole = np.array([0, len(x)], np.int64)
    return grouped_times(x, q[None], scale[None], offset[None], supers[None], np.zeros(1, np.int64), whole)


def prepare(forms: Iterable[tuple[np.dtype, np.dtype, int]]) -> None:
    """Compile the grouped product for the forms (values' and scales' dtypes, block size) of the
    matrices the engine keeps that run here (`kernels.prepare`), or load it from Numba's cache."""
    if not enabled():
        return
    matrix, cube, ids = types.Array(types.float32, 2, "C"), types.Array(types.float32, 3, "C"), types.Array(types.int64, 1, "C")
    for values, scales, block in sorted(set(forms), key=str):
        kind = recipe_for(values, scales, block)
        if kind is not None and int8_kernels.takes(values):
            q, s = (types.Array(numba.from_dtype(dtype), 3, "C") for dtype in (values, scales))
            _GROUPED[kind].compile((matrix, ids, q, s, s, cube, ids, ids, ids, matrix, types.int64))
