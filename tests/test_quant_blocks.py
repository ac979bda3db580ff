"""quant_blocks.unpack against gguf's own dequantizers: scale*q + offset must give gguf's values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from lmserve.engine_cpu.quant_blocks import FACTORED_TYPES, SUPPORTED, unpack, unpack_factored
from lmserve.model.gguf_file import GGUFFile
from tests.conftest import TINY_LLAMA

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

T = GGMLQuantizationType
# gguf 0.19 quantizes only the legacy types (and MXFP4); the K- and IQ-quants are tested on random
# blocks and on the tiny-llama fixture files.
QUANTIZABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4]
# Byte offsets of each type's float16 fields (d, and m or dmin), which random bytes must not
# fill with inf/NaN. MXFP4 has none: its scale is an exponent byte (see random_blocks).
HALF_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
               T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q2_K: (80, 82), T.Q3_K: (108,),
               T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.MXFP4: ()}


def random_blocks(qtype: GGMLQuantizationType, n_rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """Random raw rows of `qtype`: every bit pattern of q and scales, finite small float16 fields."""
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_rows * columns // block
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for start in HALF_FIELDS[qtype]:
        halves = rng.uniform(-0.05, 0.05, size=n_blocks).astype(np.float16)
        blocks[:, start:start + 2] = halves.view(np.uint8).reshape(n_blocks, 2)
    if qtype == T.MXFP4:  # E8M0 exponent byte: scales 2^-18 .. 2^12, well inside float32
        blocks[:, 0] = rng.integers(110, 141, size=n_blocks, dtype=np.uint8)
    return blocks.reshape(n_rows, -1)


def reconstruct(q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """scale*q + offset in float32, each scale/offset repeated over its block."""
    block = q.shape[1] // scale.shape[1]
    qs = q.astype(np.float32).reshape(q.shape[0], -1, block)
    return (scale[:, :, None] * qs + offset[:, :, None]).reshape(q.shape)


def check(raw: np.ndarray, qtype: GGMLQuantizationType, columns: int) -> None:
    q, scale, offset = unpack(raw, qtype, columns)
    expected = gguf_quants.dequantize(raw, qtype).reshape(raw.shape[0], columns)
    got = reconstruct(q, scale, offset)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7 * float(np.abs(expected).max()))


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_data(qtype: GGMLQuantizationType) -> None:
    data = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    check(gguf_quants.quantize(data, qtype), qtype, 512)


@pytest.mark.parametrize("qtype", list(SUPPORTED), ids=lambda t: t.name)
def test_random_blocks(qtype: GGMLQuantizationType) -> None:
    check(random_blocks(qtype, 3, 512), qtype, 512)


@pytest.mark.parametrize("qtype", list(SUPPORTED), ids=lambda t: t.name)
def test_random_blocks_exact(qtype: GGMLQuantizationType) -> None:
    """Computed without fused multiply-add, the result is gguf's float32 value bit for bit."""
    raw = random_blocks(qtype, 2, 1024, seed=2)
    got = reconstruct(*unpack(raw, qtype, 1024))
    np.testing.assert_array_equal(got, gguf_quants.dequantize(raw, qtype).reshape(2, 1024))


@pytest.mark.parametrize("qtype", list(SUPPORTED), ids=lambda t: t.name)
def test_shapes_and_dtypes(qtype: GGMLQuantizationType) -> None:
    block = SUPPORTED[qtype]
    q, scale, offset = unpack(random_blocks(qtype, 3, 512), qtype, 512)
    assert q.dtype == np.int8 and q.shape == (3, 512)
    assert scale.dtype == np.float32 and scale.shape == (3, 512 // block)
    assert offset.dtype == np.float32 and offset.shape == (3, 512 // block)


def test_rows_are_independent() -> None:
    """Unpacking rows one at a time gives the same as unpacking them together."""
    raw = random_blocks(T.Q5_K, 3, 512)
    together = unpack(raw, T.Q5_K, 512)
    for i in range(3):
        for whole, alone in zip(together, unpack(raw[i:i + 1], T.Q5_K, 512), strict=True):
            np.testing.assert_array_equal(whole[i:i + 1], alone)


def test_q_ranges() -> None:
    """The int8 values stay in each format's range (random bytes reach every extreme)."""
    ranges = {T.Q4_0: (-8, 7), T.Q4_1: (0, 15), T.Q5_0: (-16, 15), T.Q5_1: (0, 31), T.Q8_0: (-128, 127),
              T.Q4_K: (0, 15), T.Q5_K: (0, 31), T.Q6_K: (-32, 31), T.Q2_K: (0, 3), T.Q3_K: (-4, 3),
              T.IQ4_NL: (-127, 113), T.IQ4_XS: (-127, 113), T.MXFP4: (-12, 12)}
    for qtype, (lo, hi) in ranges.items():
        q = unpack(random_blocks(qtype, 4, 1024), qtype, 1024)[0]
        assert (int(q.min()), int(q.max())) == (lo, hi), qtype.name


def test_symmetric_types_have_zero_offset() -> None:
    for qtype in (T.Q4_0, T.Q5_0, T.Q8_0, T.Q6_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4):
        assert not unpack(random_blocks(qtype, 1, 256), qtype, 256)[2].any()


@pytest.mark.parametrize("qtype", sorted(SUPPORTED, key=lambda t: t.name), ids=lambda t: t.name)
def test_factored_scales_multiply_to_the_same_bits(qtype: GGMLQuantizationType) -> None:
    """The K-quants' sub-block scales and offsets, kept as int8 multiples of a float32 factor per
    256 values, give exactly the float32 scales and offsets `unpack` forms; other types unfactored."""
    raw = random_blocks(qtype, 3, 1024, seed=9)
    q, scale, offset = unpack(raw, qtype, 1024)
    parts = unpack_factored(raw, qtype, 1024)
    np.testing.assert_array_equal(parts[0], q)
    if qtype not in FACTORED_TYPES:
        assert parts[3] is None
        np.testing.assert_array_equal(parts[1], scale)
        np.testing.assert_array_equal(parts[2], offset)
        return
    _, scale_subs, offset_subs, supers = parts
    assert scale_subs.dtype == offset_subs.dtype == np.int8 and supers.shape == (3, 2 * 1024 // 256)
    per = scale.shape[1] // (1024 // 256)
    for subs, factors, want in ((scale_subs, supers[:, 0::2], scale), (offset_subs, supers[:, 1::2], offset)):
        got = np.repeat(factors, per, axis=1) * subs.astype(np.float32)
        assert np.array_equal(got, want)


def test_unsupported_types() -> None:
    for qtype in (T.F32, T.F16, T.BF16, T.IQ2_XXS, T.TQ1_0):
        assert qtype not in SUPPORTED
    with pytest.raises(ValueError, match="IQ2_XXS"):
        unpack(np.zeros((1, GGML_QUANT_SIZES[T.IQ2_XXS][1]), dtype=np.uint8), T.IQ2_XXS, 256)


def test_supported_block_sizes() -> None:
    """The compiled kernels take scale blocks of 16 or 32 values only."""
    assert set(SUPPORTED.values()) <= {16, 32}


def test_mxfp4_every_exponent() -> None:
    """All 256 E8M0 exponents, subnormal (0, 1) and overflowing (large ones times 12) included."""
    raw = np.random.default_rng(3).integers(0, 256, size=(256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    q, scale, offset = unpack(raw.reshape(1, -1), T.MXFP4, 256 * 32)
    with np.errstate(over="ignore"):
        got = reconstruct(q, scale, offset).reshape(256, 32)
        expected = gguf_quants.dequantize(raw, T.MXFP4)
    np.testing.assert_array_equal(got, expected)


def test_wrong_row_size() -> None:
    raw = random_blocks(T.Q4_1, 2, 512)
    with pytest.raises(ValueError):
        unpack(raw, T.Q4_1, 256)
    with pytest.raises(ValueError):
        unpack(raw, T.Q4_1, 500)


def test_real_model(smollm2_path: Path) -> None:
    """One 2-D tensor of each supported type in SmolLM2 (Q4_1 and Q8_0); the 49152-row
    embedding is checked on every 64th row to keep the test fast."""
    gguf = GGUFFile(smollm2_path)
    try:
        seen: dict[GGMLQuantizationType, str] = {}
        for name, info in gguf.tensors.items():
            if info.qtype in SUPPORTED and len(info.shape) == 2:
                seen.setdefault(info.qtype, name)
        assert seen, "SmolLM2 has no tensor of a supported type"
        for qtype, name in seen.items():
            info = gguf.tensors[name]
            rows = gguf.raw(name).reshape(info.shape[0], -1)
            if info.shape[0] > 4096:
                rows = rows[::64]
            check(rows, qtype, info.shape[1])
    finally:
        gguf.close()


@pytest.mark.parametrize(("name", "qtypes"), [
    ("tiny-llama-Q2_K.gguf", {T.Q2_K, T.Q3_K, T.Q6_K}),
    ("tiny-llama-Q3_K_M.gguf", {T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}),
    ("tiny-llama-IQ4_NL.gguf", {T.IQ4_NL, T.Q6_K}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_fixture_files(name: str, qtypes: set[GGMLQuantizationType]) -> None:
    """Every 2-D tensor of a supported type in the tiny-llama quant fixtures, bit for bit. No
    fixture holds an IQ4_XS or MXFP4 tensor (the gpt-oss ones are Q4_K/Q6_K and Q8_0): those two
    are covered by random blocks only."""
    gguf = GGUFFile(TINY_LLAMA / name)
    try:
        seen: set[GGMLQuantizationType] = set()
        for tensor, info in gguf.tensors.items():
            if info.qtype in SUPPORTED and len(info.shape) == 2:
                rows = gguf.raw(tensor).reshape(info.shape[0], -1)
                check(rows, info.qtype, info.shape[1])
                got = reconstruct(*unpack(rows, info.qtype, info.shape[1]))
                np.testing.assert_array_equal(got, gguf.dequantize(tensor), err_msg=tensor)
                seen.add(info.qtype)
        assert seen == qtypes
    finally:
        gguf.close()
