"""Unpack GGUF quantized blocks into int8 values plus per-block float32 scale and offset.

The NumPy engine keeps quantized weight matrices quantized in memory (about 1 byte per weight
instead of 4 for float32) and lets a compiled kernel do the dot products. That kernel wants one
uniform layout whatever the file's quant type: int8 `q [rows, columns]` and float32
`scale, offset [rows, columns // B]` such that each weight is `scale[block] * q + offset[block]`.
`unpack` produces it from the raw GGUF block bytes, mirroring `gguf.quants`' own dequantizers
(float16 fields widened to float32, scale products formed in float32 as gguf forms them) so that
`scale * q + offset` in float32 gives gguf's values.

Per type (`B` the block size of the unpacked scales):

- Q4_0 `d*(q-8)`, Q5_0 `d*(q-16)`, Q8_0 `d*q`: centered q, scale d, offset 0 (B=32).
- Q4_1, Q5_1 `d*q + m`: unsigned q, scale d, offset m (B=32).
- Q4_K, Q5_K: 8 sub-blocks of 32 per 256-superblock, `d*sc*q - dmin*m` with 6-bit sc and m:
  scale `d*sc`, offset `-(dmin*m)` (B=32).
- Q6_K: 16 sub-blocks of 16, `d*sc*(q-32)` with int8 sc: q-32, scale `d*sc`, offset 0 (B=16).
- Q2_K: 16 sub-blocks of 16, `d*(sc&0xF)*q - dmin*(sc>>4)` with 2-bit q: scale `d*(sc&0xF)`,
  offset `-(dmin*(sc>>4))` (B=16).
- Q3_K: 16 sub-blocks of 16, `d*(sc-32)*q` with 6-bit sc and q = the 2 low bits minus 4 unless the
  hmask bit is set (-4..3): scale `d*(sc-32)`, offset 0 (B=16).
- IQ4_NL `d*kvalues[nibble]` (int8 table, -127..113): q the table value, scale d, offset 0 (B=32).
- IQ4_XS: 8 sub-blocks of 32 per 256-superblock, `d*(ls-32)*kvalues[nibble]` with 6-bit ls (4 low
  bits in scales_l, 2 high in scales_h): q the IQ4_NL table value, scale `d*(ls-32)`, offset 0 (B=32).
- MXFP4 `2^(e-128) * kvalues[nibble]` with an E8M0 exponent byte e and the doubled e2m1 values
  (-12..12): q the table value, scale the power of two (exact), offset 0 (B=32).

The K-quants and IQ4_XS (FACTORED_TYPES) form each sub-block's scale and offset as a float16 of
the superblock times a small integer; `unpack_factored` gives those two factors apart (`Factors`),
which the engine keeps in 1 byte a sub-block and 4 a superblock instead of 4 a sub-block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

_T = GGMLQuantizationType

SUPPORTED: dict[GGMLQuantizationType, int] = {
    _T.Q4_0: 32,
    _T.Q4_1: 32,
    _T.Q5_0: 32,
    _T.Q5_1: 32,
    _T.Q8_0: 32,
    _T.Q4_K: 32,
    _T.Q5_K: 32,
    _T.Q6_K: 16,
    _T.Q2_K: 16,
    _T.Q3_K: 16,
    _T.IQ4_NL: 32,
    _T.IQ4_XS: 32,
    _T.MXFP4: 32,
}

FACTORED_TYPES = frozenset({_T.Q4_K, _T.Q5_K, _T.Q6_K, _T.Q2_K, _T.Q3_K, _T.IQ4_XS})


@dataclass(frozen=True)
class Factors:
    """Superblocks' sub-block scales (or offsets) as int8 multiples `sub [n, per]` of a float32
    factor `sup [n]` each; every product is exact in float32 (a float16 times at most 8 bits)."""

    sub: np.ndarray
    sup: np.ndarray

    def values(self) -> np.ndarray:
        return self.sup[:, None] * self.sub.astype(np.float32)

    @classmethod
    def zeros(cls, n: int, per: int) -> Factors:
        return cls(np.zeros((n, per), np.int8), np.zeros(n, np.float32))


Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray]
Blocks = tuple[np.ndarray, np.ndarray | Factors, np.ndarray | Factors]  # what a type's unpacker gives

# The 16-entry int8 tables of the non-linear 4-bit types (gguf.quants.IQ4_NL.kvalues, MXFP4.kvalues:
# e2m1 values doubled).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def unpack(rows: np.ndarray, qtype: GGMLQuantizationType, columns: int) -> Unpacked:
    """rows: uint8 array [n_rows, bytes_per_row] of raw GGUF blocks (each row = `columns` values).
    Returns q int8 [n_rows, columns], scale float32 [n_rows, columns // B], offset float32
    [n_rows, columns // B] with B = SUPPORTED[qtype], such that scale*q + offset reproduces
    gguf.quants.dequantize."""
    q, scale, offset = _unpack_blocks(rows, qtype, columns)
    n_rows = len(rows)
    flat = (f.values() if isinstance(f, Factors) else f for f in (scale, offset))
    return q.reshape(n_rows, columns), *(f.reshape(n_rows, -1) for f in flat)


def unpack_factored(rows: np.ndarray, qtype: GGMLQuantizationType,
                    columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """`unpack`, but FACTORED_TYPES' scale and offset as int8 `[n_rows, columns // B]` each, and
    `supers` float32 `[n_rows, 2 * superblocks]`: each superblock's scale factor, then its offset
    factor (`sup * sub` is `unpack`'s value). Other types as `unpack` gives them, supers None."""
    q, scale, offset = _unpack_blocks(rows, qtype, columns)
    n_rows = len(rows)
    if not isinstance(scale, Factors) or not isinstance(offset, Factors):
        return q.reshape(n_rows, columns), scale.reshape(n_rows, -1), offset.reshape(n_rows, -1), None
    supers = np.stack([scale.sup, offset.sup], axis=-1).reshape(n_rows, -1)
    return q.reshape(n_rows, columns), scale.sub.reshape(n_rows, -1), offset.sub.reshape(n_rows, -1), supers


def _unpack_blocks(rows: np.ndarray, qtype: GGMLQuantizationType, columns: int) -> Blocks:
    """The checks of `unpack`, then the type's unpacker over every block of `rows`."""
    if qtype not in SUPPORTED:
        raise ValueError(f"unpack does not support {qtype.name}; supported: {', '.join(t.name for t in SUPPORTED)}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = np.asarray(rows)
    if rows.dtype != np.uint8:
        rows = rows.view(np.uint8)
    if columns <= 0 or columns % block:
        raise ValueError(f"{qtype.name}: {columns} columns is not a positive multiple of the block size {block}")
    if rows.ndim != 2 or rows.shape[1] != columns // block * type_size:
        raise ValueError(f"{qtype.name}: rows of shape {rows.shape} do not hold {columns} values each "
                         f"(expected [n_rows, {columns // block * type_size}])")
    return _UNPACKERS[qtype](rows.reshape(-1, type_size))


# -- helpers ---------------------------------------------------------------------------------


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte `start` of every block, widened to float32: shape [n_blocks]."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16)[:, 0].astype(np.float32)


def _nibbles(packed: np.ndarray, groups: int, width: int) -> np.ndarray:
    """[n, groups * width] bytes -> uint8 [n, groups, 2, width]: each group's low nibbles, then
    its high nibbles (the order every GGUF 4-bit layout uses)."""
    packed = packed.reshape(-1, groups, width)
    out = np.empty((packed.shape[0], groups, 2, width), dtype=np.uint8)
    np.bitwise_and(packed, np.uint8(0x0F), out=out[:, :, 0])
    np.right_shift(packed, np.uint8(4), out=out[:, :, 1])
    return out


def _add_high_bits(q: np.ndarray, bits: np.ndarray, shift: int) -> None:
    """q |= bits << shift, in place (both uint8 of the same shape)."""
    np.left_shift(bits, np.uint8(shift), out=bits)
    np.bitwise_or(q, bits, out=q)


def _center(q: np.ndarray, zero: int) -> np.ndarray:
    """q - zero as int8 (uint8 arithmetic wraps to the right two's complement value)."""
    np.subtract(q, np.uint8(zero), out=q)
    return q.view(np.int8)


def _qh_bits32(qh: np.ndarray) -> np.ndarray:
    """A 32-bit little-endian high-bit mask per block [n, 4] -> uint8 [n, 32], bit i at index i."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes -> the 8 six-bit scales and 8 six-bit mins (gguf's get_scale_min)."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _crumbs(packed: np.ndarray, halves: int) -> np.ndarray:
    """[n, halves * 32] bytes -> uint8 [n, halves, 4, 32]: the 2-bit fields at bits 0, 2, 4, 6 of
    each half's 32 bytes, in that order (Q2_K's and Q3_K's layout)."""
    packed = packed.reshape(-1, halves, 32)
    out = np.empty((packed.shape[0], halves, 4, 32), dtype=np.uint8)
    for k in range(4):
        np.right_shift(packed, np.uint8(2 * k), out=out[:, :, k])
    np.bitwise_and(out, np.uint8(0x03), out=out)
    return out


def _lookup(table: tuple[int, ...], nibbles: np.ndarray) -> np.ndarray:
    """int8 table[nibbles] for a 16-entry table."""
    return np.asarray(table, dtype=np.int8)[nibbles]


def _zeros(n_blocks: int, per_block: int) -> np.ndarray:
    return np.zeros((n_blocks, per_block), dtype=np.float32)


# -- the formats -----------------------------------------------------------------------------


def _q4_0(blocks: np.ndarray) -> Unpacked:
    d = _half(blocks, 0)
    q = _center(_nibbles(blocks[:, 2:], 1, 16), 8)
    return q, d, _zeros(len(blocks), 1)


def _q4_1(blocks: np.ndarray) -> Unpacked:
    d, m = _half(blocks, 0), _half(blocks, 2)
    q = _nibbles(blocks[:, 4:], 1, 16).view(np.int8)
    return q, d, m


def _q5_0(blocks: np.ndarray) -> Unpacked:
    d = _half(blocks, 0)
    q = _nibbles(blocks[:, 6:], 1, 16).reshape(-1, 32)
    _add_high_bits(q, _qh_bits32(blocks[:, 2:6]), 4)
    return _center(q, 16), d, _zeros(len(blocks), 1)


def _q5_1(blocks: np.ndarray) -> Unpacked:
    d, m = _half(blocks, 0), _half(blocks, 2)
    q = _nibbles(blocks[:, 8:], 1, 16).reshape(-1, 32)
    _add_high_bits(q, _qh_bits32(blocks[:, 4:8]), 4)
    return q.view(np.int8), d, m


def _q8_0(blocks: np.ndarray) -> Unpacked:
    d = _half(blocks, 0)
    q = blocks[:, 2:].copy().view(np.int8)  # always a copy, never a view of the (read-only) map
    return q, d, _zeros(len(blocks), 1)


def _k_scales(blocks: np.ndarray) -> tuple[Factors, Factors]:
    """Q4_K/Q5_K header (d, dmin, 12 scale bytes) -> scale d*sc and offset -dmin*m, [n, 8]."""
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    return Factors(sc.view(np.int8), d), Factors(mn.view(np.int8), -dmin)


def _q4_k(blocks: np.ndarray) -> Blocks:
    scale, offset = _k_scales(blocks)
    q = _nibbles(blocks[:, 16:], QK_K // 64, 32)  # [n, 4, 2, 32] = sub-blocks 0..7 of 32
    return q.view(np.int8), scale, offset


def _q5_k(blocks: np.ndarray) -> Blocks:
    scale, offset = _k_scales(blocks)
    qh = np.ascontiguousarray(blocks[:, 16:48])  # bit i of byte l: high bit of sub-block i, value l
    q = _nibbles(blocks[:, 48:], QK_K // 64, 32).reshape(-1, 8, 32)
    bits = np.unpackbits(qh[:, None, :], axis=1, count=8, bitorder="little")  # [n, 8, 32]
    _add_high_bits(q, bits, 4)
    return q.view(np.int8), scale, offset


def _q6_k(blocks: np.ndarray) -> Blocks:
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)
    d = _half(blocks, 208)
    q = _nibbles(ql, 2, 64).reshape(-1, 2, 4, 32)  # each half's 128 values: 4 runs of 32
    qh = qh.reshape(-1, 2, 1, 32)
    hi = np.empty_like(q)
    for k in range(4):  # 2-bit fields of qh: run k of each half
        np.right_shift(qh[:, :, 0], np.uint8(2 * k), out=hi[:, :, k])
    np.bitwise_and(hi, np.uint8(0x03), out=hi)
    _add_high_bits(q, hi, 4)
    return _center(q, 32), Factors(sc, d), Factors.zeros(len(blocks), QK_K // 16)


def _q2_k(blocks: np.ndarray) -> Blocks:
    sc = blocks[:, :16]
    d, dmin = _half(blocks, 80), _half(blocks, 82)
    q = _crumbs(blocks[:, 16:80], 2)  # [n, 2, 4, 32] = sub-blocks 0..15 of 16
    return q.view(np.int8), Factors((sc & 0x0F).view(np.int8), d), Factors((sc >> 4).view(np.int8), -dmin)


def _q3_k(blocks: np.ndarray) -> Blocks:
    hmask, packed = blocks[:, :32], blocks[:, 96:108]
    d = _half(blocks, 108)
    # 6-bit scales: low nibbles of bytes 0..7 then their high nibbles; the top 2 bits are the 2-bit
    # fields of bytes 8..11, at shift 0 for scales 0..3, 2 for 4..7, 4 for 8..11, 6 for 12..15.
    low = np.concatenate([packed[:, :8] & 0x0F, packed[:, :8] >> 4], axis=-1)
    shifts = np.arange(0, 8, 2, dtype=np.uint8)[:, None]
    high = ((packed[:, None, 8:12] >> shifts) & np.uint8(0x03)).reshape(-1, 16)
    sc = (low | (high << 4)).view(np.int8) - np.int8(32)
    q = _crumbs(blocks[:, 32:96], 2).reshape(-1, 8, 32)  # value 32*j + l: 2-bit field of run j
    bits = np.unpackbits(np.ascontiguousarray(hmask)[:, None, :], axis=1, count=8, bitorder="little")
    np.bitwise_xor(bits, np.uint8(1), out=bits)  # subtract 4 where the hmask bit is clear
    np.left_shift(bits, np.uint8(2), out=bits)
    np.subtract(q, bits, out=q)
    return q.view(np.int8), Factors(sc, d), Factors.zeros(len(blocks), QK_K // 16)


def _iq4_nl(blocks: np.ndarray) -> Unpacked:
    d = _half(blocks, 0)
    q = _lookup(IQ4_VALUES, _nibbles(blocks[:, 2:], 1, 16))
    return q, d, _zeros(len(blocks), 1)


def _iq4_xs(blocks: np.ndarray) -> Blocks:
    d = _half(blocks, 0)
    scales_h = np.ascontiguousarray(blocks[:, 2:4]).view(np.uint16)  # [n, 1]
    scales_l = _nibbles(blocks[:, 4:8], 4, 1).reshape(-1, 8)  # sub-block 2i: low nibble of byte i
    shifts = np.arange(0, 16, 2, dtype=np.uint16)
    high = ((scales_h >> shifts) & np.uint16(0x03)).astype(np.uint8)
    ls = (scales_l | (high << 4)).view(np.int8) - np.int8(32)
    q = _lookup(IQ4_VALUES, _nibbles(blocks[:, 8:], 8, 16))  # [n, 8, 2, 16] = sub-blocks of 32
    return q, Factors(ls, d), Factors.zeros(len(blocks), QK_K // 32)


def _mxfp4(blocks: np.ndarray) -> Unpacked:
    # gguf's e8m0_to_fp32_half: 2^(e-128), subnormal for e < 2; ldexp forms the same float32.
    scale = np.ldexp(np.float32(1.0), blocks[:, 0].astype(np.int32) - 128).astype(np.float32)
    q = _lookup(MXFP4_VALUES, _nibbles(blocks[:, 1:], 1, 16))
    return q, scale, _zeros(len(blocks), 1)


_UNPACKERS: dict[GGMLQuantizationType, Callable[[np.ndarray], Blocks]] = {
    _T.Q4_0: _q4_0,
    _T.Q4_1: _q4_1,
    _T.Q5_0: _q5_0,
    _T.Q5_1: _q5_1,
    _T.Q8_0: _q8_0,
    _T.Q4_K: _q4_k,
    _T.Q5_K: _q5_k,
    _T.Q6_K: _q6_k,
    _T.Q2_K: _q2_k,
    _T.Q3_K: _q3_k,
    _T.IQ4_NL: _iq4_nl,
    _T.IQ4_XS: _iq4_xs,
    _T.MXFP4: _mxfp4,
}
