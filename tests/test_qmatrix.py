"""Quantized matrices on the NumPy engine: the compiled kernels against float32 arithmetic, and the
engine that keeps the file's quants against the float32 one."""

from __future__ import annotations

import sys
from functools import cache

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from lmserve.engine_cpu import CPUEngine, moe, ops
from lmserve.engine_cpu.encodings import encode, encoding_of
from lmserve.engine_cpu.engine import kernels_available
from lmserve.engine_cpu.qmatrix import KERNEL_ROWS, ExpertStack, MatrixStack, QuantMatrix
from lmserve.engine_cpu.quant_blocks import FACTORED_TYPES
from lmserve.model.config import ModelConfig
from lmserve.model.default_model import default_model_path
from lmserve.model.gguf_file import GGUFFile
from tests.conftest import TINY_LLAMA
from tests.families import ARCH
from tests.test_quant_blocks import random_blocks

T = GGMLQuantizationType
pytestmark = [pytest.mark.fast, pytest.mark.skipif(sys.platform == "darwin", reason="numba is not installed on macOS (MLX serves)")]


def random_matrix(rows: int, columns: int, block: int, seed: int = 0) -> tuple[QuantMatrix, np.ndarray]:
    """A QuantMatrix of random quants and the float32 matrix of its values."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-32, 32, (rows, columns), dtype=np.int8)
    scale = rng.uniform(0.001, 0.02, (rows, columns // block)).astype(np.float32)
    offset = rng.uniform(-0.3, 0.3, (rows, columns // block)).astype(np.float32)
    values = q.reshape(rows, -1, block) * scale[:, :, None] + offset[:, :, None]
    return QuantMatrix(q, scale, offset, np.empty((rows, 0), np.float32)), values.reshape(rows, columns).astype(np.float32)


def test_the_kernels_run_here() -> None:
    """Linux CI must exercise them: without OpenMP (or numba) the engine quietly keeps float32."""
    assert kernels_available()


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, KERNEL_ROWS, KERNEL_ROWS + 1, 70])
def test_products_match_float32(block: int, rows: int) -> None:
    """Every row count (the 4-, 2- and 1-row kernels, and BLAS on dequantized tiles past
    KERNEL_ROWS) gives the float32 product up to rounding."""
    matrix, values = random_matrix(201, 576, block)  # odd: the last tile repeats the last row
    x = np.random.default_rng(1).standard_normal((rows, 576)).astype(np.float32)
    got = matrix.times(x)
    assert got.shape == (rows, 201) and got.dtype == np.float32
    np.testing.assert_allclose(got, x.astype(np.float64) @ values.T.astype(np.float64), rtol=2e-5, atol=2e-5)


def test_a_row_gets_the_same_bits_whatever_it_is_batched_with() -> None:
    """Decode batches differ step to step; a sequence's logits must not."""
    matrix, _ = random_matrix(97, 512, 32)
    x = np.random.default_rng(2).standard_normal((KERNEL_ROWS, 512)).astype(np.float32)
    batched = matrix.times(x)
    for i in range(len(x)):
        assert np.array_equal(matrix.times(x[i:i + 1])[0], batched[i])
    assert np.array_equal(matrix.times(x[3:6]), batched[3:6])


def test_embedding_rows_and_views() -> None:
    matrix, values = random_matrix(40, 256, 16)
    ids = np.array([5, 0, 39, 5])
    np.testing.assert_allclose(matrix[ids], values[ids], rtol=1e-6, atol=1e-7)
    part = matrix.rows(10, 20)
    assert part.shape == (10, 256) and part.block == 16 and np.shares_memory(part.q, matrix.q)
    assert matrix.nbytes == 40 * 256 + 2 * 4 * 40 * 16


@cache
def engines() -> tuple[CPUEngine, CPUEngine]:
    gguf = GGUFFile(default_model_path())
    config = ModelConfig.from_gguf(gguf)
    return CPUEngine(gguf, config), CPUEngine(gguf, config, quantized=False)


def test_the_engine_keeps_the_files_quants_in_a_third_of_the_bytes() -> None:
    quantized, float32 = engines()
    assert isinstance(quantized.weights.layers[0].mixer.qkv, QuantMatrix)
    assert isinstance(quantized.weights.output, QuantMatrix)  # SmolLM2's tied Q8_0 embeddings
    assert isinstance(float32.weights.layers[0].mixer.qkv, np.ndarray)
    assert quantized.weight_bytes < float32.weight_bytes / 3
    assert "kernels on the file's quants" in quantized.device and "float32" in float32.device


def test_the_quantized_engine_decodes_as_the_float32_one() -> None:
    """Same prompt, both engines: close logits at every step and the same greedy tokens, in
    prefill (tiles through BLAS), one-row decode and a batched decode (kernels)."""
    quantized, float32 = engines()
    prompt = list(range(200, 240))
    caches = [(e, e.new_cache(128)) for e in (quantized, float32)]
    logits = [e.prefill(c, prompt) for e, c in caches]
    for _ in range(6):
        np.testing.assert_allclose(logits[0], logits[1], rtol=1e-3, atol=2e-3)
        assert logits[0].argmax() == logits[1].argmax()
        token = int(logits[1].argmax())
        logits = [e.decode([c], [token])[0] for e, c in caches]
    others = [quantized.new_cache(64) for _ in range(3)]
    for c in others:
        quantized.prefill(c, [1, 2, 3])
    alone = quantized.decode([caches[0][1]], [7])[0]
    quantized.truncate(caches[0][1], caches[0][1].length - 1)
    together = quantized.decode([*others, caches[0][1]], [9, 8, 5, 7])[3]
    assert np.array_equal(alone, together)


def test_the_kernels_are_built_for_every_block_size_unpacked() -> None:
    from lmserve.engine_cpu.kernel_ir import BLOCK_SIZES
    from lmserve.engine_cpu.quant_blocks import SUPPORTED

    assert set(SUPPORTED.values()) == set(BLOCK_SIZES)


# -- every encoding ------------------------------------------------------------------------------

ENCODED_TYPES = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_XS, T.MXFP4, T.F16, T.BF16]


def encoded_matrix(qtype: GGMLQuantizationType, rows: int, columns: int) -> tuple[QuantMatrix, np.ndarray]:
    """A matrix of `qtype` from random raw rows, kept as the engine keeps it, and gguf's float32
    values of those rows."""
    if qtype in (T.F16, T.BF16):
        values = np.random.default_rng(3).standard_normal((rows, columns)).astype(np.float32) * 0.1
        if qtype == T.F16:
            raw = values.astype(np.float16).view(np.uint8)
        else:
            raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        raw = random_blocks(qtype, rows, columns, seed=4)
    encoding = encoding_of(qtype, columns)
    assert encoding is not None
    matrix = QuantMatrix(*encode(raw, qtype, columns))
    assert matrix.q.dtype == encoding.dtype and matrix.shape == (rows, columns) and matrix.block == encoding.block
    return matrix, gguf_quants.dequantize(raw, qtype).reshape(rows, columns).astype(np.float32)


@pytest.mark.parametrize("qtype", ENCODED_TYPES, ids=lambda t: t.name)
def test_every_encoding_multiplies_as_its_values(qtype: GGMLQuantizationType) -> None:
    """The kernels (1-24 rows), the tiles for BLAS (more) and the embedding lookup all read each
    encoding as gguf's own values."""
    matrix, values = encoded_matrix(qtype, 37, 512)
    for rows in (1, 2, 5, KERNEL_ROWS + 1):
        x = np.random.default_rng(rows).standard_normal((rows, 512)).astype(np.float32)
        want = x.astype(np.float64) @ values.T.astype(np.float64)
        np.testing.assert_allclose(matrix.times(x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    ids = np.array([0, 36, 5])
    np.testing.assert_allclose(matrix[ids], values[ids], rtol=1e-6, atol=1e-6 * float(np.abs(values).max()))


@pytest.mark.parametrize("qtype", ENCODED_TYPES, ids=lambda t: t.name)
def test_compact_scales_give_the_float32_scales_bits(qtype: GGMLQuantizationType) -> None:
    """float16 scales (the legacy types' own fields) and the K-quants' int8 multiples of a factor
    per 256 values give every product and dequantized row the bits of float32 scales and offsets.
    Rows of 19 blocks of 32 leave three float16 scales past the kernels' groups of 8."""
    columns = 512 if qtype in FACTORED_TYPES else 19 * 32
    matrix, _ = encoded_matrix(qtype, 37, columns)
    scale, offset = (values(matrix, which) for which in (0, 1))
    wide = QuantMatrix(matrix.q, scale, offset, np.empty((37, 0), np.float32))
    assert matrix.nbytes < wide.nbytes or qtype == T.MXFP4
    assert scale.shape == (37, columns // matrix.block)
    for rows in (1, 4, 7, KERNEL_ROWS + 1):
        x = np.random.default_rng(rows).standard_normal((rows, columns)).astype(np.float32)
        assert np.array_equal(matrix.times(x), wide.times(x))
    ids = np.arange(37)
    assert np.array_equal(matrix[ids], wide[ids])


def values(matrix: QuantMatrix, which: int) -> np.ndarray:
    """`matrix`'s scales (`which` 0) or offsets (1) as float32, from whichever form they are kept in."""
    part = (matrix.scale, matrix.offset)[which]
    if part.dtype == np.float32:
        return part
    if part.dtype == np.int16:
        return part.view(np.float16).astype(np.float32)
    factors = matrix.supers[:, which::2]
    return np.repeat(factors, part.shape[1] // factors.shape[1], axis=1) * part.astype(np.float32)


@pytest.mark.parametrize("qtype", ENCODED_TYPES, ids=lambda t: t.name)
def test_kept_bytes_are_what_the_encoding_says(qtype: GGMLQuantizationType) -> None:
    """What the RAM guard prices (`Encoding.bytes_per_value`) is what a matrix takes, and 4-bit
    K-quants and Q4_1 take within 6% of the file's bytes."""
    matrix, _ = encoded_matrix(qtype, 8, 512)
    encoding = encoding_of(qtype, 512)
    assert matrix.nbytes == encoding.bytes_per_value * 8 * 512
    block, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in (T.Q4_K, T.Q4_1):
        assert matrix.nbytes <= 1.06 * (8 * 512 // block * type_size)


def test_four_bit_types_take_half_a_byte_a_value_q3_k_three_eighths_and_q2_k_a_quarter() -> None:
    """The non-linear ones too (IQ4_NL, IQ4_XS, MXFP4: their levels' indices); Q3_K and Q2_K,
    whose scales then take a good part of their bytes, within 26% of the file."""
    for qtype in (T.Q4_0, T.Q4_1, T.Q4_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4):
        matrix, _ = encoded_matrix(qtype, 8, 256)
        assert matrix.q.nbytes == 8 * 256 // 2
    for qtype, eighths in ((T.Q3_K, 3), (T.Q2_K, 2)):
        matrix, _ = encoded_matrix(qtype, 8, 256)
        assert matrix.q.nbytes == 8 * 256 * eighths // 8
        block, type_size = GGML_QUANT_SIZES[qtype]
        assert matrix.nbytes <= 1.26 * (8 * 256 // block * type_size)


def test_five_and_six_bit_k_quants_take_three_quarters_of_a_byte_a_value() -> None:
    """Q5_K and Q6_K keep six bits a value, not a byte: Q6_K (Q4_K_M's V and down projections)
    within 11% of the file's bytes with its scales."""
    for qtype in (T.Q5_K, T.Q6_K):
        matrix, _ = encoded_matrix(qtype, 8, 512)
        assert matrix.q.nbytes == 8 * 512 * 3 // 4
    block, type_size = GGML_QUANT_SIZES[T.Q6_K]
    assert encoded_matrix(T.Q6_K, 8, 512)[0].nbytes <= 1.11 * (8 * 512 // block * type_size)
    assert encoded_matrix(T.F16, 8, 256)[0].q.nbytes == 8 * 256 * 2


def test_a_stack_of_encodings_is_one_matrix() -> None:
    """Q4_K_M files fuse Q4_K and Q6_K rows: each part keeps its own encoding."""
    parts = [encoded_matrix(qtype, 16, 256) for qtype in (T.Q4_K, T.Q6_K, T.Q4_K)]
    stack = MatrixStack(tuple(matrix for matrix, _ in parts))
    values = np.concatenate([v for _, v in parts])
    assert stack.shape == (48, 256)
    x = np.random.default_rng(5).standard_normal((3, 256)).astype(np.float32)
    np.testing.assert_allclose(stack.times(x), x @ values.T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("name", ["tiny-llama-Q4_0", "tiny-llama-Q2_K", "tiny-llama-Q3_K_M", "tiny-llama-IQ4_NL",
                                  "tiny-llama-F16"])
def test_the_engine_keeps_each_type_in_its_encoding(name: str) -> None:
    """No weight matrix of these files is expanded to float32."""
    gguf = GGUFFile(TINY_LLAMA / f"{name}.gguf")
    e = CPUEngine(gguf, ModelConfig.from_gguf(gguf))
    layer = e.weights.layers[0]
    for matrix in (layer.mixer.qkv, layer.mixer.o, layer.gate_up, layer.down, e.weights.output):
        assert isinstance(matrix, QuantMatrix | MatrixStack), name
    assert e.weight_bytes < 2.3 * ModelConfig.from_gguf(gguf).n_params  # float32: 4


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("counts", [(1, 1, 1, 1), (1, 5, 2), (4, 1, 3, 2)])
def test_grouped_expert_products_have_each_rows_own_bits(qtype: GGMLQuantizationType, counts: tuple[int, ...]) -> None:
    """One kernel call for every routed expert (rows grouped by expert) gives each row the bits
    its expert's own product gives it, so MoE decode does not depend on what it is batched with."""
    experts, rows_each = 6, 40
    whole, _ = encoded_matrix(qtype, experts * rows_each, 512)
    stack = ExpertStack(whole, experts)
    groups = np.array([5, 0, 3, 2][:len(counts)])
    firsts = np.cumsum([0, *counts])
    x = np.random.default_rng(7).standard_normal((firsts[-1], 512)).astype(np.float32)
    got = stack.times_grouped(x, groups, firsts)
    for expert, start, stop in zip(groups.tolist(), firsts[:-1], firsts[1:], strict=True):
        assert np.array_equal(got[start:stop], stack[expert].times(x[start:stop]))
        for row in range(start, stop):
            assert np.array_equal(got[row], stack[expert].times(x[row:row + 1])[0])


def test_moe_experts_are_kept_one_matrix_per_expert() -> None:
    gguf = GGUFFile(ARCH / "qwen3moe" / "tiny-qwen3moe-Q4_K_M.gguf")
    config = ModelConfig.from_gguf(gguf)
    e = CPUEngine(gguf, config)
    experts = e.weights.layers[0].experts
    assert experts is not None and len(experts.gate_up) == len(experts.down) == config.n_experts
    assert isinstance(experts.gate_up, ExpertStack) and isinstance(experts.down, ExpertStack)
    assert all(isinstance(m, QuantMatrix) for m in [*experts.gate_up, *experts.down])
    float32 = CPUEngine(gguf, config, quantized=False)
    ids = list(range(100, 140))
    kept, reference = (engine.prefill(engine.new_cache(64), ids, all_logits=True) for engine in (e, float32))
    np.testing.assert_allclose(kept, reference, rtol=1e-3, atol=2e-3)
    assert e.weight_bytes < float32.weight_bytes / 3


def test_a_prompt_chunks_experts_give_each_row_its_experts_own_bits() -> None:
    """A prompt chunk routes more than KERNEL_ROWS rows to some experts (dequantized for BLAS)
    and fewer to others (one grouped kernel call): each row's sum is what running its experts one
    by one and adding their outputs in order gives, so a prompt's logits do not depend on the path."""
    gguf = GGUFFile(ARCH / "qwen3moe" / "tiny-qwen3moe-Q4_K_M.gguf")
    config = ModelConfig.from_gguf(gguf)
    m = CPUEngine(gguf, config).weights.layers[0].experts
    assert m is not None and isinstance(m.gate_up, ExpertStack)
    n = KERNEL_ROWS + 12
    chosen = np.stack([np.zeros(n, np.int64), np.where(np.arange(n) < 10, 1, 2 + np.arange(n) % 2)], axis=1)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, config.hidden_size)).astype(np.float32)
    weights = rng.uniform(0.1, 0.9, chosen.shape).astype(np.float32)
    got = moe._experts(x, m, chosen, weights, ops.silu_mul)
    expected = np.zeros_like(x)
    for slot in range(2):  # expert 0 is every row's first choice, so slot order is expert order
        for expert in np.unique(chosen[:, slot]).tolist():
            rows = np.flatnonzero(chosen[:, slot] == expert)
            y = ops.linear(ops.silu_mul(ops.linear(x[rows], m.gate_up[expert])), m.down[expert])
            expected[rows] += y * weights[rows, slot, None]
    assert np.array_equal(got, expected)
