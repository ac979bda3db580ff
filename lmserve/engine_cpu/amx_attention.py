"""A prompt pass's attention on Intel AMX-BF16 tiles, each float32 product in three.

A prompt pass's scores (queries times keys) and mix (softmax weights times values) ran in BLAS at
float32's peak and were a third of the synthetic MoE's prompt; its scores array, a pass's heads x
rows x positions, was written, read and written by the softmax, and read again. One `tdpbf16ps`
does 16 x 16 x 32 products of bfloat16 pairs into float32 sums. bfloat16 keeps 8 bits of a
float's 24, so each operand is split into a bfloat16 `hi` and the bfloat16 of what is left,
`lo`, and a product is `hi * hi + hi * lo + lo * hi` (the "bf16x3" product): what is dropped is
`lo * lo` and the rounding of `lo`, about 2^-16 of the product, where one bfloat16 product would
drop 2^-8 (and the float16 keys and queries of llama.cpp's CPU attention 2^-11).

A thread takes 4 row tiles of 16 query rows of a KV head at a time (each B tile loaded once for
all four): their scores against the keys some row of them sees (in steps of 32 positions: the
causal triangle's masked half skipped at that grain) into a buffer of its own, each row's largest scaled score, its exponentials
split into bfloat16 parts in one IR pass (`_weights`; keys a row does not see weigh exactly 0),
those times the values, and each row divided by its sum. The softmax is `softmax_kernel`'s
arithmetic (Cephes' exponential), its division moved after the mix: a row's head-size sums
rather than its weights. A row's bits depend on its own query, keys and values only, not on the
pass or the thread count it runs in.

Tiles are all 16 rows of 64 bytes (`amx_kernels.tile_config`): A, 16 rows of 32 bfloat16 (hi
rows, then lo rows); B, 16 pairs of rows of 16 columns, each a bfloat16 pair (`_pack` lays the keys
and values out so, once a pass); C, 16 x 16 float32, two at a time.
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from lmserve.engine_cpu import amx_kernels
from lmserve.engine_cpu.amx_kernels import (
    PTR,
    ROWS,
    byte_address,
    call_void,
    configure_tiles,
    release_tiles,
    rounded_bf16,
    tile_config,
)
from lmserve.engine_cpu.kernel_ir import I8, I16, I64, LANES, VF, VH, VI32, Builder
from lmserve.engine_cpu.softmax_kernel import (
    _FAST,
    _LN2_HIGH,
    _LN2_LOW,
    _LOG2E,
    _LOWEST,
    _P0,
    _P1,
    _P2,
    _P3,
    _P4,
    _P5,
    _exp,
    _scaled_peak,
)

COLUMNS = 16  # a C tile's columns: positions (scores) or head dimensions (mix)
PAIRS = 32  # bfloat16 values an A tile's row holds: a step of the products' inner dimension
TILE_BYTES = 1024  # a tile's 16 rows of 64 bytes
HEAD_MULTIPLE = 64  # head sizes taken: whole steps of the scores' inner dimension and of 4 C tiles
BLOCK_TILES = 4  # row tiles a thread takes at once: B read from memory once for 64 query rows
MIX_STEPS = 32  # the mix's steps of 32 positions a row block takes before the next: a pair's B, 128 KiB, stays in L2
_FEATURE = "amx-bf16"
_CS, _A_HI, _A_LO, _BS = (0, 1), 2, 3, ((4, 5), (6, 7))  # tile numbers: C pair, A's hi and lo, B pair's hi and lo


@functools.cache
def available() -> bool:
    """Whether this CPU has AMX-BF16 and this process may use the tiles (`amx_kernels.available`)."""
    return amx_kernels.available() and llvm.get_host_cpu_features().get(_FEATURE, False)


def enabled(head_size: int) -> bool:
    """Whether a prompt pass's attention over heads of `head_size` runs here: a head size of whole
    tiles, the tiles not turned off (`amx_kernels.enabled`: ENV, the benchmarks' baseline), and
    AMX-BF16 here."""
    return head_size % HEAD_MULTIPLE == 0 and amx_kernels.enabled() and available()


def takes(query_rows: int, head_size: int) -> bool:
    """Whether a pass's products run here: a prompt pass's rows (more than a verify pass's, which
    keep BLAS's bits and a decode step's) and `enabled`."""
    return query_rows > amx_kernels.COLUMN_ROWS and enabled(head_size)


@intrinsic
def _tile_products(typingctx, a, b, dest, first_tile, tiles, first_step, steps, accumulate):  # noqa: ANN001, ANN202, ARG001
    """For each row tile r of `a` (`[row tiles, 32, K]` uint16, any strides: a tile's 16 hi rows,
    then its 16 lo rows), C tiles `first_tile` to `first_tile + tiles` (an even count) of B (`b
    [2, tiles of B, steps of B, 512]`, its hi then its lo) times it, over B's steps `first_step`
    on (`steps` of 32 of A's columns from 0), into `dest` (`[16 x row tiles, >= 16 x tiles]`
    float32, any row stride) at rows 16 r, columns 16 t: stored, or added to what is there
    (`accumulate`). Two C tiles at a time (one C's sums wait for its previous product; a pair's
    alternate), each pair of B tiles for every row tile in turn: B comes from memory once for
    all of them, where one row tile at a time streamed a long pass's keys and values from L3 once
    for 16 rows."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        b_ = builder
        tile = functools.partial(ir.Constant, I8)
        arrays = [context.make_array(signature.args[i])(context, builder, args[i]) for i in range(3)]
        row_tiles = cgutils.unpack_tuple(b_, arrays[0].shape, 3)[0]
        tile_stride, a_stride = cgutils.unpack_tuple(b_, arrays[0].strides, 3)[:2]
        b_tiles, b_steps = cgutils.unpack_tuple(b_, arrays[1].shape, 4)[1:3]
        dest_stride = cgutils.unpack_tuple(b_, arrays[2].strides, 2)[0]
        load = ("llvm.x86.tileloadd64", [I8, PTR, I64])
        with cgutils.for_range(b_, b_.udiv(args[4], ir.Constant(I64, 2))) as pair_loop, \
                cgutils.for_range(b_, row_tiles) as r_loop:
            t0 = b_.mul(pair_loop.index, ir.Constant(I64, 2))
            a_first = b_.mul(r_loop.index, tile_stride)
            c_at = [b_.add(b_.mul(b_.mul(r_loop.index, ir.Constant(I64, ROWS)), dest_stride),
                           b_.mul(b_.add(t0, ir.Constant(I64, k)), ir.Constant(I64, 4 * COLUMNS))) for k in range(2)]
            with b_.if_else(b_.icmp_unsigned("!=", args[7], ir.Constant(args[7].type, 0))) as (added, stored):
                with added:
                    for c, at in zip(_CS, c_at, strict=True):
                        call_void(b_, *load, [tile(c), byte_address(context, b_, signature, args, 2, at), dest_stride])
                with stored:
                    for c in _CS:
                        call_void(b_, "llvm.x86.tilezero", [I8], [tile(c)])
            with cgutils.for_range(b_, args[6]) as s_loop:
                a_at = b_.add(a_first, b_.mul(s_loop.index, ir.Constant(I64, 2 * PAIRS)))
                lo_at = b_.add(a_at, b_.mul(a_stride, ir.Constant(I64, ROWS)))
                for number, at in ((_A_HI, a_at), (_A_LO, lo_at)):
                    call_void(b_, *load, [tile(number), byte_address(context, b_, signature, args, 0, at), a_stride])
                step = b_.add(args[5], s_loop.index)
                for k, numbers in enumerate(_BS):
                    j = b_.add(args[3], b_.add(t0, ir.Constant(I64, k)))
                    for part, number in enumerate(numbers):
                        index = b_.add(b_.mul(b_.add(b_.mul(ir.Constant(I64, part), b_tiles), j), b_steps), step)
                        at = b_.mul(index, ir.Constant(I64, TILE_BYTES))
                        call_void(b_, *load, [tile(number), byte_address(context, b_, signature, args, 1, at),
                                              ir.Constant(I64, 64)])
                for left, right in ((_A_LO, 0), (_A_HI, 1), (_A_HI, 0)):  # the small terms first
                    for c, numbers in zip(_CS, _BS, strict=True):
                        call_void(b_, "llvm.x86.tdpbf16ps", [I8] * 3, [tile(c), tile(left), tile(numbers[right])])
            for c, at in zip(_CS, c_at, strict=True):
                call_void(b_, "llvm.x86.tilestored64", [I8, PTR, I64],
                          [tile(c), byte_address(context, b_, signature, args, 2, at), dest_stride])
        return context.get_dummy_value()
    return types.void(a, b, dest, first_tile, tiles, first_step, steps, accumulate), codegen


def _bf16_bits(b: ir.IRBuilder, values: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Float32 vector `values` rounded to bfloat16 (ties to even): the bfloat16 bits (16 lanes
    of int16) and the rounded value as float32."""
    bits = b.bitcast(values, VI32)
    odd = b.and_(b.lshr(bits, ir.Constant(VI32, [16] * LANES)), ir.Constant(VI32, [1] * LANES))
    rounded = b.and_(b.add(b.add(bits, ir.Constant(VI32, [0x7FFF] * LANES)), odd), ir.Constant(VI32, [-0x10000] * LANES))
    return b.trunc(b.lshr(rounded, ir.Constant(VI32, [16] * LANES)), VH), b.bitcast(rounded, VF)


@intrinsic
def _weights(typingctx, row, peak, hi, lo):  # noqa: ANN001, ANN202, ARG001
    """`row`'s (scaled scores, -inf where the query does not see; whole vectors of 16) e ** (s -
    peak), by `softmax_kernel._exp`'s Cephes polynomial (x / ln 2 rounded to even rather than
    up at a tie), split into bfloat16 `hi` and `lo` (uint16,
    contiguous, as long); returns their sum. One pass over the row where NumPy-style loops took
    three (the exponentials, then the split's two)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202, ARG001
        k, b = Builder(context, builder, signature, args), builder
        fma = k.fma(VF)
        roundeven = cgutils.get_or_insert_function(b.module, ir.FunctionType(VF, [VF]), "llvm.roundeven.v16f32")
        constant = lambda value: ir.Constant(VF, [float(value)] * LANES)  # noqa: E731
        peak = k.splat(args[1])
        total = cgutils.alloca_once_value(b, constant(0.0))
        length = cgutils.unpack_tuple(b, k.arrays[0].shape, 1)[0]
        halves = [b.bitcast(k.data(i), I16.as_pointer()) for i in (2, 3)]
        with cgutils.for_range(b, b.udiv(length, ir.Constant(I64, LANES))) as loop:
            at = b.mul(loop.index, ir.Constant(I64, LANES))
            x = b.fsub(k.load_vector(k.data(0), at, VF), peak)
            seen = b.fcmp_ordered(">=", x, constant(_LOWEST))
            x = b.select(seen, x, constant(_LOWEST))
            whole = b.call(roundeven, [b.fmul(x, constant(_LOG2E))])
            r = b.call(fma, [whole, constant(-_LN2_LOW), b.call(fma, [whole, constant(-_LN2_HIGH), x])])
            p = constant(_P0)
            for coefficient in (_P1, _P2, _P3, _P4, _P5):
                p = b.call(fma, [p, r, constant(coefficient)])
            e = b.fadd(b.call(fma, [p, b.fmul(r, r), r]), constant(1.0))
            power = b.shl(b.add(b.fptosi(whole, VI32), ir.Constant(VI32, [127] * LANES)), ir.Constant(VI32, [23] * LANES))
            e = b.select(seen, b.fmul(e, b.bitcast(power, VF)), constant(0.0))
            b.store(b.fadd(b.load(total), e), total)
            high, rounded = _bf16_bits(b, e)
            low = _bf16_bits(b, b.fsub(e, rounded))[0]
            for half, value in zip(halves, (high, low), strict=True):
                b.store(value, b.bitcast(b.gep(half, [at]), VH.as_pointer()), align=2)
        return k.horizontal_sum(b.load(total))
    return types.float32(row, peak, hi, lo), codegen


@njit(inline="always", nogil=True)
def _split(bits, hi, lo, whole, rest):  # noqa: ANN001, ANN202
    """Float32s given as their bits (`bits`, uint32, any layout) as bfloat16 `hi` and the
    bfloat16 of what is left, `lo` (uint16 each); `whole` and `rest` contiguous uint32 scratch
    of the same length (a float's bits are read as a float through an array view only)."""
    for i in range(len(bits)):
        whole[i] = bits[i]
        rounded = rounded_bf16(bits[i])
        rest[i] = rounded
        hi[i] = np.uint16(rounded >> np.uint32(16))
    values, left = whole.view(np.float32), rest.view(np.float32)
    for i in range(len(bits)):
        left[i] = values[i] - left[i]
    for i in range(len(bits)):
        lo[i] = np.uint16(rounded_bf16(rest[i]) >> np.uint32(16))


@njit(parallel=True, nogil=True, cache=True)
def _pack(rows, keys):  # noqa: ANN001, ANN202
    """`rows [kv_heads, seen, head]` (their bits) as B tiles, uint16 (hi, then lo), positions past
    `seen` zeros, to a whole step of 32. `keys`, the scores': `[kv_heads, 2, seen / 16, head / 32,
    512]`, tile j's step s row i column n the dimensions 32 s + 2 i and + 1 of position 16 j + n
    (an even count of tiles: the scores' products take them in pairs, and an odd one read past
    the last head's, off the end of the array). Else the mix's: `[kv_heads, 2, head / 16, seen /
    32, 512]`, tile j's step s row i column d positions 32 s + 2 i and + 1 at dimension 16 j + d."""
    kv_heads, seen, head = rows.shape
    per = COLUMNS if keys else PAIRS  # positions a unit lays out
    units = -(-seen // PAIRS) * (PAIRS // per)
    outer, inner = (units, head // PAIRS) if keys else (head // COLUMNS, units)
    packed = np.zeros((kv_heads, 2, outer, inner, ROWS * PAIRS), np.uint16)
    for unit in prange(kv_heads * units):
        h, u = unit // units, unit % units
        halves = np.empty((2, head), np.uint16)
        whole, rest = np.empty(head, np.uint32), np.empty(head, np.uint32)
        for p in range(min(per, seen - u * per)):
            _split(rows[h, u * per + p], halves[0], halves[1], whole, rest)
            for part in range(2):
                for d in range(head):
                    if keys:
                        packed[h, part, u, d // PAIRS, (d % PAIRS) // 2 * PAIRS + p * 2 + d % 2] = halves[part, d]
                    else:
                        packed[h, part, d // COLUMNS, u, p // 2 * PAIRS + d % COLUMNS * 2 + p % 2] = halves[part, d]
    return packed


@njit(parallel=True, fastmath=_FAST, error_model="numpy", cache=True, nogil=True)
def _attend(qg, keys, values, n, start, first, scale, window, sinks, out, threads):  # noqa: ANN001, ANN202
    """`out [kv_heads, rows, head]`: attention of `qg [kv_heads, rows, head]` (query row i at
    position `start + i // group`) over `keys` and `values` `[kv_heads, seen, head]` (key column
    c at position `first + c`), all three given as their bits. BLOCK_TILES row tiles at a time:
    their scores in a buffer of the thread's own, each row's exponentials (`softmax_kernel`'s)
    split into bfloat16 parts, times the values, and divided by their sums."""
    kv_heads, rows, head = qg.shape
    seen = keys.shape[1]
    group = rows // n
    keys_packed, values_packed = _pack(keys, True), _pack(values, False)
    width = -(-seen // PAIRS) * PAIRS
    block_rows = BLOCK_TILES * ROWS
    blocks = -(-rows // block_rows)
    for thread in prange(threads):
        configure_tiles(tile_config())
        query = np.zeros((BLOCK_TILES, 2 * ROWS, head), np.uint16)
        a = np.zeros((BLOCK_TILES, 2 * ROWS, width), np.uint16)
        whole, rest = np.empty(head, np.uint32), np.empty(head, np.uint32)
        weights = np.zeros((block_rows, width), np.float32)
        mixed = np.empty((block_rows, head), np.float32)
        totals = np.empty(block_rows, np.float32)
        for unit in range(thread, kv_heads * blocks, threads):  # interleaved: later blocks see more keys
            h, r0 = unit // blocks, unit % blocks * block_rows
            filled = min(block_rows, rows - r0)
            tiles = -(-filled // ROWS)
            for r in range(tiles * ROWS):
                t, i = r // ROWS, r % ROWS
                if r < filled:
                    _split(qg[h, r0 + r], query[t, i], query[t, ROWS + i], whole, rest)
                else:
                    query[t, i] = 0
                    query[t, ROWS + i] = 0
            last = start + (r0 + filled - 1) // group - first + 1  # one past the last column a row sees
            begin = max(0, start + r0 // group - window + 1 - first) if window else 0
            step0, step1 = begin // PAIRS, -(-last // PAIRS)
            c0, c1 = step0 * PAIRS, step1 * PAIRS
            _tile_products(query[:tiles], keys_packed[h], weights[:, c0:], c0 // COLUMNS, (c1 - c0) // COLUMNS, 0,
                           head // PAIRS, False)
            for r in range(tiles * ROWS):
                t, i = r // ROWS, r % ROWS
                row = weights[r, c0:c1]
                if r < filled:
                    position = start + (r0 + r) // group
                    stop = position - first + 1 - c0
                    low = max(0, position - window + 1 - first - c0) if window else 0
                    row[:low] = -np.inf
                    row[stop:] = -np.inf
                    peak = _scaled_peak(row, scale)
                    sink = sinks[h * group + (r0 + r) % group] if len(sinks) else np.float32(-np.inf)
                    if len(sinks):
                        peak = max(peak, sink)
                    totals[r] = _weights(row, peak, a[t, i, :c1 - c0], a[t, ROWS + i, :c1 - c0])
                    if len(sinks):
                        totals[r] += _exp(sink - peak)
                else:
                    a[t, i, :c1 - c0] = 0
                    a[t, ROWS + i, :c1 - c0] = 0
            for step in range(step0, step1, MIX_STEPS):
                _tile_products(a[:tiles, :, (step - step0) * PAIRS:], values_packed[h], mixed, 0, head // COLUMNS, step,
                               min(MIX_STEPS, step1 - step), step > step0)
            for r in range(filled):  # the softmax's division, a row's head-size sums rather than its weights
                for d in range(head):
                    out[h, r0 + r, d] = mixed[r, d] / totals[r]
        release_tiles()


def _check() -> None:
    """RuntimeError unless the tiles are `available` (asked for): without, their instructions end
    the process (SIGILL)."""
    if not available():
        raise RuntimeError("AMX-BF16 tiles are not available to this process")


def attend(qg: np.ndarray, keys: np.ndarray, values: np.ndarray, n: int, start: int, first: int, scale: float,
           window: int, sinks: np.ndarray) -> np.ndarray:
    """`ops.grouped_attention`'s products and softmax on the tiles (`takes`): `qg [kv_heads, n *
    group, head]`, `keys` and `values` `[kv_heads, seen, head]` from position `first`, `sinks` a
    logit a query head (empty: none). The result `[kv_heads, n * group, head]`."""
    _check()
    out = np.empty(qg.shape, np.float32)
    _attend(qg.view(np.uint32), keys.view(np.uint32), values.view(np.uint32), n, start, first, np.float32(scale),
            window, sinks, out, get_num_threads())
    return out


def prepare() -> None:
    """Compile `_attend` (or load it from Numba's cache) where it runs: for a float32 cache's keys
    and values (strided views of it) and for a quantized cache's (read back into new arrays)."""
    if not (amx_kernels.enabled() and available()):
        return
    bits, layouts = types.uint32, ("A", "C")
    for layout in layouts:
        stored = types.Array(bits, 3, layout)
        _attend.compile((types.Array(bits, 3, "C"), stored, stored, types.int64, types.int64, types.int64, types.float32,
                         types.int64, types.Array(types.float32, 1, "C"), types.Array(types.float32, 3, "C"), types.int64))
