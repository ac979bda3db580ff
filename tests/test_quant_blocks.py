"""quant_blocks.unpack against gguf's own dequantizers: scale*q + offset must give gguf's values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from lmserve.engine_cpu.quant_blocks import SUPPORTED, unpack
from lmserve.model.gguf_file import GGUFFile

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

T = GGMLQuantizationType
# gguf 0.19 quantizes only the legacy types; the K-quants are tested on random blocks.
QUANTIZABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
# Byte offsets of each type's float16 fields (d, and m or dmin), which random bytes must not
# fill with inf/NaN.
HALF_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
               T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(qtype: GGMLQuantizationType, n_rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """Random raw rows of `qtype`: every bit pattern of q and scales, finite small float16 fields."""
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_rows * columns // block
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for start in HALF_FIELDS[qtype]:
        halves = rng.uniform(-0.05, 0.05, size=n_blocks).astype(np.float16)
        blocks[:, start:start + 2] = halves.view(np.uint8).reshape(n_blocks, 2)
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
              T.Q4_K: (0, 15), T.Q5_K: (0, 31), T.Q6_K: (-32, 31)}
    for qtype, (lo, hi) in ranges.items():
        q = unpack(random_blocks(qtype, 4, 1024), qtype, 1024)[0]
        assert (int(q.min()), int(q.max())) == (lo, hi), qtype.name


def test_symmetric_types_have_zero_offset() -> None:
    for qtype in (T.Q4_0, T.Q5_0, T.Q8_0, T.Q6_K):
        assert not unpack(random_blocks(qtype, 1, 256), qtype, 256)[2].any()


def test_unsupported_types() -> None:
    for qtype in (T.F32, T.F16, T.BF16, T.Q2_K, T.Q3_K):
        assert qtype not in SUPPORTED
    with pytest.raises(ValueError, match="Q2_K"):
        unpack(np.zeros((1, GGML_QUANT_SIZES[T.Q2_K][1]), dtype=np.uint8), T.Q2_K, 256)


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
