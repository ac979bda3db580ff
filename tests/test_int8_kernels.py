"""Products with int8 activations (`--cpu-dots int8`): exactly the float product of x rounded to
int8 per block, batched or not; how close that keeps a model to its f32 reference; and a server
that is told to use them does."""

from __future__ import annotations

import sys

import httpx
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from lmserve.engine_cpu import CPUEngine, int8_kernels, moe
from lmserve.engine_cpu.qmatrix import KERNEL_ROWS, SUPERBLOCK, WIDE_VALUES, ExpertStack
from lmserve.engine_cpu.quant_blocks import FACTORED_TYPES
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile, ModelLoadError
from lmserve.model.tokenizer import Tokenizer
from tests.server_util import start_server
from tests.test_qmatrix import encoded_matrix

T = GGMLQuantizationType
pytestmark = pytest.mark.skipif(sys.platform == "darwin", reason="numba is not installed on macOS (MLX serves)")
# Every type kept as nibbles or int8 (the others, F16 and BF16, keep the float kernels).
INTEGER_TYPES = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q2_K, T.Q3_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q8_0, T.IQ4_NL,
                 T.IQ4_XS, T.MXFP4]


def rounded(x: np.ndarray, block: int) -> np.ndarray:
    """x as the kernels see it: each block of `block` values `dx * xq`, dx = max|x| / 127."""
    blocks = x.reshape(len(x), -1, block)
    peak = np.abs(blocks).max(axis=-1, keepdims=True)
    inverse = np.divide(np.float32(127), peak, out=np.zeros_like(peak), where=peak > 0)
    xq = np.rint(blocks * inverse)
    return (xq * (peak / np.float32(127))).reshape(x.shape)


@pytest.mark.fast
@pytest.mark.parametrize("qtype", INTEGER_TYPES, ids=lambda t: t.name)
def test_int8_products_are_the_products_of_x_rounded_to_int8(qtype: GGMLQuantizationType, int8_dots: None) -> None:
    """Every row count (1-row, 4-, 2- and 1-row tiles) and row length (whole 128-value steps, and
    32-value ones past them: 19 blocks of 32) gives the float64 product of the file's values with
    x rounded to int8, up to float32 sums; that rounding, not the kernels, is all they lose."""
    for columns in (512,) if qtype in FACTORED_TYPES else (512, 19 * 32):
        matrix, values = encoded_matrix(qtype, 37, columns)
        for rows in (1, 2, 5, 7, KERNEL_ROWS):
            x = np.random.default_rng(rows).standard_normal((rows, columns)).astype(np.float32)
            want = rounded(x, SUPERBLOCK if int8_kernels.by_superblock(matrix.q.dtype, matrix.scale.dtype) else matrix.block).astype(np.float64) @ values.T.astype(np.float64)
            exact = x.astype(np.float64) @ values.T.astype(np.float64)
            got = matrix.times(x)
            scale = float(np.abs(exact).max())
            assert np.abs(got - want).max() <= 2e-6 * scale, (qtype.name, columns, rows)
            assert 1e-4 * scale < np.abs(got - exact).max() <= 2e-2 * scale  # int8's rounding, and only it


@pytest.mark.fast
@pytest.mark.parametrize(("qtype", "byte"), [(T.Q8_0, 0x7F), (T.Q8_0, 0x80), (T.Q6_K, 0xFF), (T.Q4_K, 0xFF),
                                             (T.IQ4_NL, 0x00), (T.Q3_K, 0xFF)],
                         ids=["Q8_0 127", "Q8_0 -128", "Q6_K 63", "Q4_K 15", "IQ4_NL -127", "Q3_K 7"])
@pytest.mark.parametrize("sign", [1, -1])
def test_the_largest_values_against_the_largest_x_do_not_overflow(qtype: GGMLQuantizationType, byte: int, sign: int,
                                                                     int8_dots: None) -> None:
    """Every value at its type's extreme against x rounded to +-127 everywhere: each pair of byte
    products at its largest, where AVX2's int16 pair sums (`vpmaddubsw`) would saturate if a
    form's bound did not hold; the product is still the float64 one."""
    matrix, _ = encoded_matrix(qtype, 37, 512)
    matrix.q.view(np.uint8)[:] = byte
    values = matrix[np.arange(len(matrix))]
    x = np.full((3, 512), sign, np.float32)
    want = x.astype(np.float64) @ values.T.astype(np.float64)
    got = matrix.times(x)
    assert np.abs(got - want).max() <= 2e-6 * float(np.abs(want).max()), qtype.name


@pytest.mark.fast
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q4_0, T.Q6_K], ids=lambda t: t.name)
def test_a_row_that_is_not_finite_gives_nan_and_leaves_the_others_alone(qtype: GGMLQuantizationType,
                                                                        int8_dots: None) -> None:
    """An inf or a NaN in a row's x makes that row's results NaN (its dx), not a finite guess,
    and the rows batched with it keep their bits."""
    matrix, _ = encoded_matrix(qtype, 37, 512)
    x = np.random.default_rng(6).standard_normal((6, 512)).astype(np.float32)
    finite = matrix.times(x)
    x[2, 100], x[4, 7] = np.inf, np.nan
    got = matrix.times(x)
    assert np.isnan(got[[2, 4]]).all()
    assert np.array_equal(np.delete(got, [2, 4], axis=0), np.delete(finite, [2, 4], axis=0))
    assert np.isnan(matrix.times(x[4:5])).all()


@pytest.mark.fast
@pytest.mark.parametrize("qtype", INTEGER_TYPES, ids=lambda t: t.name)
def test_int8_rows_get_the_same_bits_whatever_they_are_batched_with(qtype: GGMLQuantizationType,
                                                                   int8_dots: None) -> None:
    """A row's result has the same bits alone (a matrix row at a time), among a few rows and in a
    prompt chunk's tiles (whose matrix rows `_unpack` decodes once, in x rows by 4, 2 and 1, the
    last tile past the matrix's last row), and in an expert stack's groups either way."""
    columns = 512 if qtype in FACTORED_TYPES else 19 * 32  # whole 128-value steps, or 32-value ones past them
    matrix, _ = encoded_matrix(qtype, 97, columns)
    x = np.random.default_rng(2).standard_normal((KERNEL_ROWS + 3, columns)).astype(np.float32)
    batched = int8_kernels.times(x, *matrix.arrays)  # in tiles of OUTS matrix rows (not BLAS past kernel_rows)
    few = matrix.times(x[:7])  # a matrix row at a time (COLUMN_ROWS), x rows by 4, 2 and 1
    assert len(x) > int8_kernels.COLUMN_ROWS >= len(few)
    for i in range(len(x)):
        assert np.array_equal(matrix.times(x[i:i + 1])[0], batched[i]), i
        assert i >= len(few) or np.array_equal(few[i], batched[i])
    experts, rows_each = 6, 41
    stack = ExpertStack(encoded_matrix(qtype, experts * rows_each, columns)[0], experts)
    groups = np.array([5, 0, 3])
    for firsts in (np.array([0, 4, 5, 7]), np.array([0, 19, 20, 27])):  # a matrix row at a time; tiles
        got = stack.times_grouped(x[:firsts[-1]], groups, firsts)
        for expert, start, stop in zip(groups.tolist(), firsts[:-1], firsts[1:], strict=True):
            for row in range(start, stop):
                assert np.array_equal(got[row], stack[expert].times(x[row:row + 1])[0]), (firsts[1], row)


@pytest.mark.fast
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0], ids=["nibbles", "int8"])
def test_prompt_chunks_of_whole_wide_steps_run_the_int8_kernels(qtype: GGMLQuantizationType, int8_dots: None) -> None:
    """A prompt chunk's product with rows of whole 128-value steps stays on the int8 kernels
    (each row gets its one-row bits, which BLAS's rounding would not give): nibbles at any width,
    int8 values up to INT8_WIDE_ROWS rows with VNNI (on AVX2, KERNEL_ROWS). Rows ending in
    32-value steps, matrices under WIDE_VALUES values and float32 activations dequantize for BLAS
    past KERNEL_ROWS."""
    most = 256 if qtype == T.Q4_K else int8_kernels.INT8_WIDE_ROWS if int8_kernels.VNNI else KERNEL_ROWS
    matrix, _ = encoded_matrix(qtype, WIDE_VALUES // 512, 512)
    assert matrix.kernel_rows == (most if qtype == T.Q8_0 else sys.maxsize)
    x = np.random.default_rng(4).standard_normal((most, 512)).astype(np.float32)
    chunk = matrix.times(x)
    for i in range(len(x)):
        assert np.array_equal(matrix.times(x[i:i + 1])[0], chunk[i])
    assert encoded_matrix(T.Q4_0, WIDE_VALUES // 19 // 32 + 1, 19 * 32)[0].kernel_rows == KERNEL_ROWS
    assert encoded_matrix(qtype, 37, 512)[0].kernel_rows == KERNEL_ROWS  # a small matrix
    int8_kernels.ENABLED = False  # the fixture restores it
    assert matrix.kernel_rows == KERNEL_ROWS


@pytest.mark.fast
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_a_prompt_chunks_expert_groups_give_each_row_its_experts_own_bits(qtype: GGMLQuantizationType,
                                                                          int8_dots: None) -> None:
    """Groups of a decode step's size and past VNNI's INT8_WIDE_ROWS, in one call: all in the grouped
    kernel (each row its one-row bits), though each expert alone is under WIDE_VALUES, since the
    call reads the stack. With float32 activations the large group is on BLAS (its rows those of
    that expert's own product)."""
    experts, rows_each, large = 8, WIDE_VALUES // 512 // 4, 138
    stack = ExpertStack(encoded_matrix(qtype, experts * rows_each, 512)[0], experts)
    assert stack[0].kernel_rows == KERNEL_ROWS  # alone, an expert's chunk would go to BLAS
    x = np.random.default_rng(5).standard_normal((large + 5, 512)).astype(np.float32)
    groups, firsts = np.array([0, 3, 7]), np.array([0, 3, large + 3, large + 5])
    got = moe._grouped_product(x, stack, np.repeat(groups, np.diff(firsts)), firsts)
    for expert, start, stop in zip(groups.tolist(), firsts[:-1], firsts[1:], strict=True):
        for row in range(start, stop):
            assert np.array_equal(got[row], stack[expert].times(x[row:row + 1])[0])
    int8_kernels.ENABLED = False  # the fixture restores it
    got = moe._grouped_product(x, stack, np.repeat(groups, np.diff(firsts)), firsts)
    assert np.array_equal(got[3:large + 3], stack[3].times(x[3:large + 3]))
    assert not np.array_equal(got[3], stack[3].times(x[3:4])[0])  # BLAS's rounding, not one row's


@pytest.mark.fast
def test_float_values_keep_the_float_kernels(int8_dots: None) -> None:
    """F16 and BF16 have no integers to multiply: their products stay exact."""
    matrix, values = encoded_matrix(T.F16, 37, 512)
    assert not int8_kernels.takes(matrix.q.dtype)
    x = np.random.default_rng(3).standard_normal((1, 512)).astype(np.float32)
    np.testing.assert_allclose(matrix.times(x), x @ values.T, rtol=1e-5, atol=1e-5)


def test_smollm2_keeps_its_reference_greedy_tokens_at_most_positions(int8_dots: None, smollm2_path,
                                                                     chat_goldens: list[dict]) -> None:
    """Fed the f32 reference's greedy continuations, SmolLM2 with int8 activations picks the same
    next token at >= 105 of their 113 positions (108 measured; float32 activations: all)."""
    gguf = GGUFFile(smollm2_path)
    engine = CPUEngine(gguf, ModelConfig.from_gguf(gguf))
    agree = total = 0
    for case in chat_goldens:
        prompt, greedy = case["prompt_ids"], case["greedy_ids"]
        cache = engine.new_cache(len(prompt) + len(greedy))
        rows = [engine.prefill(cache, prompt)] + [engine.decode([cache], [t])[0] for t in greedy[:-1]]
        agree += sum(int(row.argmax()) == token for row, token in zip(rows, greedy, strict=True))
        total += len(greedy)
    assert total == 113 and agree >= 105


def test_cpu_dots_int8_where_the_cpu_lacks_it_is_refused(monkeypatch: pytest.MonkeyPatch, smollm2_path) -> None:
    monkeypatch.setattr(int8_kernels, "available", lambda: False)
    monkeypatch.setattr(int8_kernels, "ENABLED", False)
    gguf = GGUFFile(smollm2_path)
    with pytest.raises(ModelLoadError, match="AVX-512 VNNI"):
        CPUEngine(gguf, ModelConfig.from_gguf(gguf), dots="int8")


def test_a_server_told_cpu_dots_int8_decodes_with_int8_activations(int8_dots: None, smollm2_path,
                                                                   chat_goldens: list[dict]) -> None:
    """The flag reaches the engine (the suite's default is float32): the served reply is the int8
    engine's greedy one, which for this prompt differs from the f32 reference's from its first
    token (a near tie), and /health says which activations the products use."""
    golden = chat_goldens[0]
    gguf = GGUFFile(smollm2_path)
    engine, tokenizer = CPUEngine(gguf, ModelConfig.from_gguf(gguf)), Tokenizer.from_gguf(gguf)
    cache = engine.new_cache(len(golden["prompt_ids"]) + 8)
    tokens = [int(engine.prefill(cache, golden["prompt_ids"]).argmax())]
    while len(tokens) < 8 and tokens[-1] not in tokenizer.eog_ids:
        tokens.append(int(engine.decode([cache], [tokens[-1]])[0].argmax()))
    assert tokens[0] != golden["greedy_ids"][0]
    with start_server("--engine", "cpu", "--cpu-dots", "int8") as server:
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=300,
                       json={"messages": golden["messages"], "temperature": 0, "max_tokens": 8})
        assert "int8 activations" in httpx.get(server.base_url + "/health").json()["device"]
    want = tokenizer.decode([t for t in tokens if t not in tokenizer.eog_ids])
    assert r.json()["choices"][0]["message"]["content"] == want
