"""A weight matrix kept as its GGUF quants: values, and a scale and offset per block.

Every value is `scale * q + offset` of its block, the value the file's own dequantizer gives, so
the model is the file's, not a re-quantization of it; only the products' rounding differs from
float32 BLAS. How `q` holds the values is its dtype (`ENCODINGS`): 4-bit types as packed nibbles
(half a byte a value; the IQ4 and MXFP4 ones as indices into their tables), Q2_K in two bits,
5- and 6-bit K-quants in six (three quarters of a byte), other quants as int8, float16 and
bfloat16 as their own bits. How the
scales and offsets are held is theirs (`SCALE_FORMS`), each the fewest bytes that give the
file's float32 scale exactly. Decode-sized products (up to KERNEL_ROWS rows) run the compiled
kernels, which read the values where they lie (0.59-2.1 bytes a value instead of float32's 4);
wider ones (prompt chunks) dequantize a tile of rows at a time into float32 and hand it to BLAS,
whose matrix product then costs more than the conversion, except where int8 activations beat it
at any width (`QuantMatrix.kernel_rows`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from lmserve.engine_cpu.quant_blocks import IQ4_VALUES, MXFP4_VALUES

# Up to this many rows the kernels beat dequantizing tiles for BLAS; a little past it BLAS catches
# up, and it gains from there on (figures: docs/PERFORMANCE.md, measurements behind code choices).
KERNEL_ROWS = 24
# Float32 values dequantized per BLAS product: 16 MiB, reused from the heap (glibc keeps it, see
# weights._retain_freed_heap), so a layer's matrices are one product each; smaller tiles cost BLAS
# more than they save (figures: docs/PERFORMANCE.md, measurements behind code choices).
TILE_VALUES = 1 << 22
# Matrices of fewer values keep BLAS past KERNEL_ROWS even where int8 activations would take them:
# their gain was smaller than what the kernels' OpenMP threads, spinning after each call, cost the
# BLAS products around them, and with the shorter spinning set in engine_cpu/__init__.py there is
# none to take (SmolLM2's down projections on the kernels: its prompts even with BLAS; figures:
# docs/PERFORMANCE.md, measurements behind code choices). The AMX tiles beat BLAS at every size,
# so the matrices they take run there whatever their size (`QuantMatrix.kernel_rows`).
WIDE_VALUES = 1 << 20

# `q`'s dtype -> (values, elements): how many values that many elements hold; the kernels decode
# each dtype their own way.
INT8 = np.dtype(np.int8)  # one value a byte
NIBBLES = np.dtype(np.uint8)  # two: value i of a block of 32 in the low half, value i + 16 in the high
# Values of 0-63 (5- and 6-bit K-quants), 128 in 24 words: their low 4 bits as NIBBLES' 64 bytes,
# then 32 bytes of the high 2 bits. Low-nibble lane j (0-63) of the 64 bytes has its high bits in
# bits 0-1 of high byte j (j < 32) or bits 2-3 of byte j - 32; high-nibble lane j in bits 4-5 or
# 6-7: a 32-byte vector of them then makes both 64-lane halves (`int8_kernels`).
SIXBITS = np.dtype(np.uint32)
SIXBIT_GROUP, SIXBIT_BYTES = 128, 96  # values in a group, and its bytes (64 of nibbles, 32 of highs)
CRUMBS = np.dtype(np.uint64)  # values of 0-3 (Q2_K), 128 in 32 bytes laid out as SIXBITS' high bits
CRUMB_BYTES = 32  # a group's bytes in CRUMBS, and SIXBITS' last 32
# Values of 0-7 (Q3_K), 128 in 48 bytes: their low 2 bits as CRUMBS' 32 bytes, then their high bits
# as two 64-bit masks, bit j of the first for the nibbles' low-half lane j, of the second for the
# high-half lane j (a mask register's lanes: `int8_kernels`). float64 is only the marker of the form.
THREEBITS = np.dtype(np.float64)
THREEBIT_BYTES = 48
# Nibbles laid out as NIBBLES' that index a 16-entry int8 table, the non-linear 4-bit types' levels;
# the dtype names the table (`TABLES`), which the kernels look each nibble up in.
IQ4_LEVELS = np.dtype(np.int32)  # IQ4_NL's and IQ4_XS's: 8 nibbles an element
MXFP4_LEVELS = np.dtype(np.int64)  # MXFP4's: 16 an element
TABLES = {IQ4_LEVELS: IQ4_VALUES, MXFP4_LEVELS: MXFP4_VALUES}
HALF = np.dtype(np.int16)  # float16 bits
BFLOAT = np.dtype(np.uint16)  # bfloat16 bits
ENCODINGS = {INT8: (1, 1), NIBBLES: (2, 1), SIXBITS: (16, 3), CRUMBS: (32, 1), THREEBITS: (64, 3),
             IQ4_LEVELS: (8, 1), MXFP4_LEVELS: (16, 1), HALF: (1, 1), BFLOAT: (1, 1)}


def elements(dtype: np.dtype, columns: int) -> int:
    """The elements of `dtype` a row of `columns` values takes."""
    values, count = ENCODINGS[dtype]
    return columns * count // values


def values_in(dtype: np.dtype, count: int) -> int:
    """The values `count` elements of `dtype` hold."""
    values, elements_ = ENCODINGS[dtype]
    return count * values // elements_

# `scale`'s (and `offset`'s) dtype -> their form; the kernels read each their own way.
FLOAT = np.dtype(np.float32)  # the values
HALF_SCALES = np.dtype(np.int16)  # float16 bits (the legacy types' scales are float16 fields)
# int8 multiples of a float32 factor per SUPERBLOCK values in `supers` (the K-quants' int8 sub-block
# scales times a float16 one per 256 values: exact in float32).
FACTORED = np.dtype(np.int8)
SUPERBLOCK = 256
SCALE_FORMS = (FLOAT, HALF_SCALES, FACTORED)


@dataclass(frozen=True)
class QuantMatrix:
    """`[out, in]` weights: `q` `[out, elements(q.dtype, in)]`, `scale` and `offset`
    `[out, in // block]` in one of SCALE_FORMS, and for FACTORED ones `supers` float32
    `[out, 2 * in // SUPERBLOCK]`, each superblock's scale factor then its offset factor
    (`[out, 0]` for the other forms)."""

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    supers: np.ndarray

    @classmethod
    def empty(cls, rows: int, columns: int, block: int, dtype: np.dtype = INT8, scales: np.dtype = FLOAT) -> QuantMatrix:
        blocks, supers = columns // block, 2 * columns // SUPERBLOCK if scales == FACTORED else 0
        return cls(np.empty((rows, elements(dtype, columns)), dtype), np.empty((rows, blocks), scales),
                   np.empty((rows, blocks), scales), np.empty((rows, supers), np.float32))

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The arrays, in the kernels' argument order."""
        return self.q, self.scale, self.offset, self.supers

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.q), values_in(self.q.dtype, self.q.shape[1])

    @property
    def block(self) -> int:
        return self.shape[1] // self.scale.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.arrays)

    def __len__(self) -> int:
        return len(self.q)

    def rows(self, start: int, stop: int) -> QuantMatrix:
        """Rows `start:stop` as views (loading fills fused matrices a tensor at a time)."""
        return QuantMatrix(*(part[start:stop] for part in self.arrays))

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` in float32: the embedding lookup."""
        from lmserve.engine_cpu import kernels

        out = np.empty((len(ids), self.shape[1]), np.float32)
        kernels.dequantize(*(part[ids] for part in self.arrays), out)
        return out

    @property
    def kernel_rows(self) -> int:
        """The most rows a product runs on the kernels rather than on BLAS: KERNEL_ROWS, or more
        where int8 activations beat BLAS at a prompt chunk's width (`int8_kernels.wide_rows`): a
        matrix of at least WIDE_VALUES values, or any that the AMX tiles take (a 256 x 1,024
        Q6_K's 512 rows: 0.71 ms there, 0.98 dequantized for BLAS)."""
        from lmserve.engine_cpu import amx_kernels, int8_kernels

        rows, columns = self.shape
        if rows * columns < WIDE_VALUES and not amx_kernels.takes_form(self.q, self.scale):
            return KERNEL_ROWS
        return max(KERNEL_ROWS, int8_kernels.wide_rows(self.q.dtype, columns))

    def times(self, x: np.ndarray) -> np.ndarray:
        """`x [n, in]` times this matrix transposed: `[n, out]` float32."""
        from lmserve.engine_cpu import kernels  # numba: only once a QuantMatrix exists (not on macOS)

        x = np.ascontiguousarray(x, dtype=np.float32)
        if len(x) <= KERNEL_ROWS or len(x) <= self.kernel_rows:  # the first test: a decode step's, cheaper
            return kernels.times(x, *self.arrays)
        step = max(1, TILE_VALUES // self.shape[1])
        tile = np.empty((min(step, len(self)), self.shape[1]), np.float32)
        if step >= len(self):  # one tile: BLAS writes the result itself
            kernels.dequantize(*self.arrays, tile)
            return x @ tile.T
        out = np.empty((len(x), len(self)), np.float32)
        for start in range(0, len(self), step):
            part = self.rows(start, start + step)
            kernels.dequantize(*part.arrays, tile[:len(part)])
            out[:, start:start + len(part)] = x @ tile[:len(part)].T
        return out


@dataclass(frozen=True)
class MatrixStack:
    """Matrices of one width stacked along their rows, each kept in its own encoding: a fused
    matrix (Q/K/V, gate/up) whose tensors come in different quant types (Q4_K_M files mix Q4_K
    and Q6_K). Converting all to their finest common form would double the 4-bit parts' bytes."""

    parts: tuple[QuantMatrix, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return len(self), self.parts[0].shape[1]

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)

    def times(self, x: np.ndarray) -> np.ndarray:
        """`x [n, in]` times the stacked matrix transposed: `[n, out]` float32."""
        out = np.empty((len(x), len(self)), np.float32)
        row = 0
        for part in self.parts:
            out[:, row:row + len(part)] = part.times(x)
            row += len(part)
        return out


@dataclass(frozen=True)
class ExpertStack:
    """One kept matrix per expert of a mixture-of-experts layer, all in one encoding and one
    QuantMatrix: expert 0's rows, then expert 1's, and so on. A decode step then runs every
    routed expert in one kernel call, where one call per expert cost more in Python than the
    products themselves (figures: docs/PERFORMANCE.md, measurements behind code choices)."""

    whole: QuantMatrix
    experts: int

    @property
    def rows_each(self) -> int:
        return len(self.whole) // self.experts

    def __len__(self) -> int:
        return self.experts

    def __getitem__(self, expert: int) -> QuantMatrix:
        return self.whole.rows(expert * self.rows_each, (expert + 1) * self.rows_each)

    def __iter__(self) -> Iterator[QuantMatrix]:
        return (self[expert] for expert in range(self.experts))

    @property
    def kernel_rows(self) -> int:
        """The most rows a group of a prompt chunk runs in the grouped kernel call rather than on
        BLAS: any number where int8 activations take the whole stack at a chunk's width (one call
        reads the stack, so WIDE_VALUES is the stack's, not one expert's), else KERNEL_ROWS. A
        group past INT8_WIDE_ROWS still gains there: on BLAS it would dequantize its expert in a
        call of its own (figures: docs/PERFORMANCE.md, measurements behind code choices)."""
        return sys.maxsize if self.whole.kernel_rows > KERNEL_ROWS else KERNEL_ROWS

    def times_grouped(self, x: np.ndarray, experts: np.ndarray, firsts: np.ndarray,
                      rows: np.ndarray | None = None) -> np.ndarray:
        """Grouped rows (row r is `x`'s row `rows[r]`; None: row r) whose rows `firsts[g]:firsts[g +
        1]` go to expert `experts[g]`, each group times its expert's matrix transposed: `[grouped
        rows, rows_each]` float32. For groups the kernels take (at most an expert's `kernel_rows`
        rows each)."""
        from lmserve.engine_cpu import kernels

        return kernels.grouped_times(np.ascontiguousarray(x, dtype=np.float32), *self.cubes, experts, firsts, rows)

    @functools.cached_property
    def cubes(self) -> tuple[np.ndarray, ...]:
        """The arrays as `[experts, rows_each, ...]` views, in the kernels' argument order."""
        shape = (self.experts, self.rows_each, -1)
        return tuple(part.reshape(shape) for part in self.whole.arrays)


Matrix = np.ndarray | QuantMatrix | MatrixStack  # a weight matrix as the forward pass reads it
