"""How the NumPy engine keeps each GGUF type's matrices in memory, and their values in that form.

Decode reads every weight once a step, so the bytes a value takes decide its speed; each type
keeps the file's own values in the fewest bytes the kernels can read (`qmatrix.ENCODINGS`):

- the 4-bit types with evenly spaced levels (Q4_0, Q4_1, Q4_K): packed nibbles, 0.5 byte a value
  plus a scale and offset per block of 32.
- Q3_K: three bits, 0.375 byte a value (`qmatrix.THREEBITS`), and Q2_K two, 0.25 (`qmatrix.CRUMBS`).
  Centered levels are shifted up: Q4_0's `d*(q-8)` becomes `d*q - 8*d`, exact in float32 (a
  float16 times a 4-bit integer, and times 8), Q3_K's `s*(q-4)` likewise.
- the 5- and 6-bit K-quants (Q5_K, Q6_K): six bits, 0.75 byte a value (`qmatrix.SIXBITS`), Q6_K's
  `s*(q-32)` shifted up as Q3_K's is.
- the non-linear 4-bit types (IQ4_NL, IQ4_XS, MXFP4): packed nibbles too, each the index of its
  level in the type's table (`qmatrix.TABLES`).
- every other type `quant_blocks` unpacks (Q5_0, Q5_1, Q8_0): int8.
- F16 and BF16: their own 2-byte values (scale 1, offset 0 per 32).

Scales and offsets (`qmatrix.SCALE_FORMS`): the K-quants' and IQ4_XS's as int8 multiples of a
float32 factor per 256 values (1 byte a block each, 8 a superblock), MXFP4's powers of two as
float32, every other type's as float16 (the file's own fields, or 1 and 0): all exact.

Anything else (F32, other types, tensors whose rows are not whole blocks) is float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from lmserve.engine_cpu.qmatrix import (
    BFLOAT,
    CRUMBS,
    ENCODINGS,
    FACTORED,
    FLOAT,
    HALF,
    HALF_SCALES,
    INT8,
    IQ4_LEVELS,
    MXFP4_LEVELS,
    NIBBLES,
    SIXBIT_BYTES,
    SIXBIT_GROUP,
    SIXBITS,
    SUPERBLOCK,
    TABLES,
    THREEBITS,
)
from lmserve.engine_cpu.quant_blocks import FACTORED_TYPES, SUPPORTED, unpack_factored

_T = GGMLQuantizationType
# Each packed type's form in memory (every other type `quant_blocks` unpacks is kept as int8).
FORMS = {_T.Q4_0: NIBBLES, _T.Q4_1: NIBBLES, _T.Q4_K: NIBBLES, _T.Q3_K: THREEBITS, _T.Q2_K: CRUMBS,
         _T.Q5_K: SIXBITS, _T.Q6_K: SIXBITS, _T.IQ4_NL: IQ4_LEVELS, _T.IQ4_XS: IQ4_LEVELS, _T.MXFP4: MXFP4_LEVELS}
ZERO = {_T.Q4_0: 8, _T.Q3_K: 4, _T.Q6_K: 32}  # centered types -> the level their int8 values are shifted up by
_FLOATS = {_T.F16: HALF, _T.BF16: BFLOAT}
FLOAT_BLOCK = 32  # F16/BF16: values per (unit) scale, the kernels' block

Parts = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # QuantMatrix.arrays


@dataclass(frozen=True)
class Encoding:
    """A matrix's form in memory: its values' dtype, the values per scale and the scales' form."""

    dtype: np.dtype
    block: int
    scales: np.dtype

    @property
    def bytes_per_value(self) -> float:
        supers = 2 * 4 / SUPERBLOCK if self.scales == FACTORED else 0.0
        values, elements = ENCODINGS[self.dtype]
        return self.dtype.itemsize * elements / values + 2 * self.scales.itemsize / self.block + supers


def encoding_of(qtype: GGMLQuantizationType, columns: int) -> Encoding | None:
    """How a matrix of `qtype` with rows of `columns` values is kept (None: as float32)."""
    if qtype in _FLOATS:
        return Encoding(_FLOATS[qtype], FLOAT_BLOCK, HALF_SCALES) if columns % FLOAT_BLOCK == 0 else None
    if qtype not in SUPPORTED:
        return None
    scales = FACTORED if qtype in FACTORED_TYPES else FLOAT if qtype == _T.MXFP4 else HALF_SCALES
    return Encoding(FORMS.get(qtype, INT8), SUPPORTED[qtype], scales)


def encode(rows: np.ndarray, qtype: GGMLQuantizationType, columns: int) -> Parts:
    """Raw GGUF rows (uint8 `[n, bytes a row]`) -> `q`, `scale`, `offset`, `supers` as
    `encoding_of` keeps them."""
    if qtype in _FLOATS:
        q = np.ascontiguousarray(rows).view(_FLOATS[qtype]).reshape(len(rows), columns)
        blocks = (len(rows), columns // FLOAT_BLOCK)
        return q, _halves(np.ones(blocks, np.float32)), _halves(np.zeros(blocks, np.float32)), _no_supers(len(rows))
    q, scale, offset, supers = unpack_factored(rows, qtype, columns)
    zero = ZERO.get(qtype, 0)
    if zero and supers is not None:  # Q3_K, Q6_K: `s*(q-4)` = `s*q - 4*s`, the offset's factor -4 times the scale's
        offset = scale
        supers[:, 1::2] = np.float32(-zero) * supers[:, 0::2]
    elif zero:  # Q4_0
        offset = offset - np.float32(zero) * scale
    form = FORMS.get(qtype)
    if form in TABLES:
        q = _nibbles(_indices(q, TABLES[form])).view(form)
    elif form is not None:
        levels = q.view(np.uint8) + np.uint8(zero)  # 0..3, 0..7, 0..15 or 0..63 (uint8 arithmetic wraps -8..-1 right)
        q = {NIBBLES: _nibbles, THREEBITS: _threebits, SIXBITS: _sixbits, CRUMBS: _crumbs}[form](levels)
    if supers is not None:
        return q, scale, offset, supers
    if encoding_of(qtype, columns).scales == HALF_SCALES:
        scale, offset = _halves(scale), _halves(offset)
    return q, scale, offset, _no_supers(len(q))


def _nibbles(levels: np.ndarray) -> np.ndarray:
    """Values 0..15 `[n, columns]` as `qmatrix.NIBBLES`: each block of 32's values 0-15 in the low
    halves of its 16 bytes, 16-31 in the high ones."""
    pairs = levels.reshape(len(levels), -1, 2, 16)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << np.uint8(4))).reshape(len(levels), -1)


def _indices(q: np.ndarray, table: tuple[int, ...]) -> np.ndarray:
    """int8 table values -> their indices in `table` (MXFP4's two zeros: either gives 0)."""
    inverse = np.zeros(256, np.uint8)
    inverse[np.array(table, np.int8).view(np.uint8)] = np.arange(len(table), dtype=np.uint8)
    return inverse[q.view(np.uint8)]


def _sixbits(levels: np.ndarray) -> np.ndarray:
    """Values 0..63 `[n, columns]` (columns whole groups of 128) as `qmatrix.SIXBITS`."""
    n = len(levels)
    groups = levels.reshape(n, -1, SIXBIT_GROUP)
    nibbles = _nibbles(groups.reshape(-1, SIXBIT_GROUP) & np.uint8(0x0F)).reshape(n, -1, 64)
    packed = np.concatenate([nibbles, _two_bits(groups >> np.uint8(4))], axis=-1)
    return np.ascontiguousarray(packed.reshape(n, groups.shape[1] * SIXBIT_BYTES)).view(SIXBITS)


def _threebits(levels: np.ndarray) -> np.ndarray:
    """Values 0..7 `[n, columns]` (columns whole groups of 128) as `qmatrix.THREEBITS`."""
    n = len(levels)
    groups = levels.reshape(n, -1, SIXBIT_GROUP)
    halves = (groups >> np.uint8(2)).reshape(n, -1, 4, 2, 16)  # [block of 32, its half, value]: the high bits
    masks = [np.packbits(halves[:, :, :, half].reshape(n, -1, 64), axis=-1, bitorder="little") for half in (0, 1)]
    packed = np.concatenate([_two_bits(groups & np.uint8(3)), *masks], axis=-1)
    return np.ascontiguousarray(packed.reshape(n, -1)).view(THREEBITS)


def _crumbs(levels: np.ndarray) -> np.ndarray:
    """Values 0..3 `[n, columns]` (columns whole groups of 128) as `qmatrix.CRUMBS`."""
    groups = levels.reshape(len(levels), -1, SIXBIT_GROUP)
    return np.ascontiguousarray(_two_bits(groups).reshape(len(levels), -1)).view(CRUMBS)


def _two_bits(groups: np.ndarray) -> np.ndarray:
    """Values 0..3 `[n, groups, 128]` -> `[n, groups, 32]` bytes: the nibbles' lane c*16 + t of
    the low halves (value c*32 + t) and of the high halves (c*32 + 16 + t), lanes j and j + 32 of
    each in byte j's bits 0-1, 2-3 (low) and 4-5, 6-7 (high)."""
    n = len(groups)
    halves = groups.reshape(n, -1, 4, 2, 16)  # [block of 32, its half, value]
    low_lanes, high_lanes = (halves[:, :, :, half].reshape(n, -1, 64) for half in (0, 1))
    return (low_lanes[..., :32] | low_lanes[..., 32:] << np.uint8(2)
            | high_lanes[..., :32] << np.uint8(4) | high_lanes[..., 32:] << np.uint8(6))


def _halves(values: np.ndarray) -> np.ndarray:
    """float32 values as float16 bits; the legacy types' scales are float16 fields, so exact
    (a Q4_0 scale past 8188 would overflow its offset of -8 scales: refused)."""
    with np.errstate(over="ignore"):
        halves = values.astype(np.float16)
    if not np.array_equal(halves.astype(np.float32), values, equal_nan=True):
        raise ValueError("a block's scale or offset does not fit float16 (a Q4_0 scale past 8188?)")
    return halves.view(HALF_SCALES)


def _no_supers(rows: int) -> np.ndarray:
    return np.empty((rows, 0), FLOAT)
