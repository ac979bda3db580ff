"""Prompt-sized products on AMX tiles (`amx_kernels`): the products of x rounded to int8 as the
VNNI kernels compute them, up to float32 sums; a row's bits independent of what else a chunk
holds; a decode step's and a verify pass's rows (and small expert groups) on the VNNI kernels with
their one-row bits; a model's prompt pass giving the same greedy tokens either way."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from lmserve.engine_cpu import CPUEngine, amx_attention, amx_kernels, int8_kernels
from lmserve.engine_cpu.encodings import encode
from lmserve.engine_cpu.int8_kernels import COLUMN_ROWS
from lmserve.engine_cpu.qmatrix import KERNEL_ROWS, SUPERBLOCK, WIDE_VALUES, ExpertStack, QuantMatrix
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile, ModelLoadError
from tests.families import Fixture
from tests.test_int8_kernels import rounded
from tests.test_qmatrix import encoded_matrix
from tests.test_quant_blocks import random_blocks

T = GGMLQuantizationType
TILE_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K]  # the forms with a recipe (`amx_kernels.RECIPES`)
pytestmark = [pytest.mark.fast,
              pytest.mark.skipif(sys.platform == "darwin", reason="numba is not installed on macOS (MLX serves)")]


@pytest.fixture
def tiles(int8_dots: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 activations with the AMX tiles on, where this CPU and kernel allow them."""
    if not amx_kernels.available():
        pytest.skip("AMX-INT8 tiles are not available here")
    monkeypatch.setenv(amx_kernels.ENV, "auto")


def vnni(x: np.ndarray, matrix: object) -> np.ndarray:
    """The VNNI kernels' product, whatever the row count."""
    return int8_kernels.times(x, *matrix.arrays)


@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
def test_tile_products_are_the_products_of_x_rounded_to_int8(qtype: GGMLQuantizationType, tiles: None) -> None:
    """Row counts past a verify pass's, odd ones too (x tiles padded), and a matrix row count that
    is not a whole number of tiles: the float64 product of the file's values with x rounded to
    int8 per superblock, up to float32 sums, as close as the VNNI kernels come."""
    matrix, values = encoded_matrix(qtype, 45, 512)
    for rows in (COLUMN_ROWS + 1, 40, 67):
        x = np.random.default_rng(rows).standard_normal((rows, 512)).astype(np.float32)
        want = rounded(x, SUPERBLOCK).astype(np.float64) @ values.T.astype(np.float64)
        got = amx_kernels.times(x, *matrix.arrays)
        scale = float(np.abs(want).max())
        assert np.abs(got - want).max() <= 2e-6 * scale, (qtype.name, rows)
        assert np.abs(got - vnni(x, matrix)).max() <= 2e-6 * scale


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K], ids=lambda t: t.name)
def test_the_offsets_term_is_a_float32_product(qtype: GGMLQuantizationType, tiles: None) -> None:
    """With every superblock's factor 0, a product is the offsets' term alone (each block's
    offset times x's block sum, on the bfloat16 tiles as parts of each float32): within a few
    float32 roundings of the float64 product, over 1,024 columns (a whole step of 32 blocks) and
    1,280 (a step and a partial one). Five products of parts hold what float32 does; three, two
    parts a side, left 2^-18 of each term out."""
    rng = np.random.default_rng(9)
    for columns in (1024, 1280):
        raw = random_blocks(qtype, 40, columns, seed=columns)
        size = GGML_QUANT_SIZES[qtype][1]
        raw.reshape(-1, size)[:, 0:2] = 0  # each superblock's factor d, float16 zero
        matrix = QuantMatrix(*encode(raw, qtype, columns))
        values = gguf_quants.dequantize(raw, qtype).reshape(40, columns).astype(np.float64)
        x = rounded(rng.standard_normal((48, columns)).astype(np.float32), SUPERBLOCK).astype(np.float64)
        got = amx_kernels.times(x.astype(np.float32), *matrix.arrays)
        bound = np.abs(x) @ np.abs(values).T
        assert np.all(np.abs(got - x @ values.T) <= 2.0**-21 * bound), (qtype.name, columns)

@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
def test_a_rows_tile_bits_do_not_depend_on_what_else_the_chunk_holds(qtype: GGMLQuantizationType, tiles: None) -> None:
    """The same row in chunks of other sizes, at other positions, gets the same bits; a row of x
    that is not finite makes its own results NaN and leaves the others' bits alone."""
    matrix, _ = encoded_matrix(qtype, 37, 512)
    x = np.random.default_rng(3).standard_normal((60, 512)).astype(np.float32)
    whole = amx_kernels.times(x, *matrix.arrays)
    assert np.array_equal(amx_kernels.times(x[13:50], *matrix.arrays), whole[13:50])
    assert np.array_equal(amx_kernels.times(x[::-1].copy(), *matrix.arrays)[::-1], whole)
    x[5, 100], x[41, 7] = np.inf, np.nan
    got = amx_kernels.times(x, *matrix.arrays)
    assert np.isnan(got[[5, 41]]).all()
    assert np.array_equal(np.delete(got, [5, 41], axis=0), np.delete(whole, [5, 41], axis=0))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_small_groups_keep_the_vnni_kernels_one_row_bits(qtype: GGMLQuantizationType, tiles: None) -> None:
    """In one grouped call, groups of a verify pass's size get each row its expert's one-row bits
    (the VNNI kernels'); larger groups run on the tiles, their rows as the tiles give them alone."""
    experts, rows_each = 6, 40
    stack = ExpertStack(encoded_matrix(qtype, experts * rows_each, 512)[0], experts)
    x = np.random.default_rng(5).standard_normal((70, 512)).astype(np.float32)
    groups, firsts = np.array([4, 0, 2, 5]), np.array([0, 3, 33, 49, 70])
    got = stack.times_grouped(x, groups, firsts)
    for expert, start, stop in zip(groups.tolist(), firsts[:-1], firsts[1:], strict=True):
        rows = slice(start, stop)
        if stop - start <= COLUMN_ROWS:
            for row in range(start, stop):
                assert np.array_equal(got[row], vnni(x[row:row + 1], stack[expert])[0])
        else:
            assert np.array_equal(got[rows], amx_kernels.times(x[rows], *stack[expert].arrays))


def test_a_grouped_call_reads_a_moes_rows_where_they_are(tiles: None) -> None:
    """A MoE's grouped rows given as indices into its prompt rows (each row once for each of its
    experts, as routing orders them) get the bits of the gathered copy's, small groups too."""
    experts, rows_each = 6, 40
    stack = ExpertStack(encoded_matrix(T.Q4_K, experts * rows_each, 512)[0], experts)
    x = np.random.default_rng(9).standard_normal((30, 512)).astype(np.float32)
    rows = np.random.default_rng(10).permutation(np.repeat(np.arange(30), 3))  # 90 grouped rows
    groups, firsts = np.array([4, 0, 2, 5]), np.array([0, 3, 33, 49, 90])
    assert np.array_equal(stack.times_grouped(x, groups, firsts, rows), stack.times_grouped(x[rows], groups, firsts))


def test_products_past_a_verify_pass_take_the_tiles_unless_they_are_off(tiles: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt chunk's product with a large Q4_K matrix runs on the tiles; a verify pass's rows
    keep the VNNI kernels; LMSERVE_CPU_TILES=off puts every product back on them; forms without
    a recipe (Q4_0) never take the tiles."""
    matrix, _ = encoded_matrix(T.Q4_K, WIDE_VALUES // 512, 512)
    x = np.random.default_rng(7).standard_normal((48, 512)).astype(np.float32)
    assert np.array_equal(matrix.times(x), amx_kernels.times(x, *matrix.arrays))
    assert not np.array_equal(matrix.times(x), vnni(x, matrix))  # other sums: float32's rounding
    assert np.array_equal(matrix.times(x[:COLUMN_ROWS]), vnni(x[:COLUMN_ROWS], matrix))
    monkeypatch.setenv(amx_kernels.ENV, "off")
    assert np.array_equal(matrix.times(x), vnni(x, matrix))
    assert not amx_kernels.takes(encoded_matrix(T.Q4_0, 37, 512)[0].q, encoded_matrix(T.Q4_0, 37, 512)[0].scale, 48)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_a_small_matrix_takes_the_tiles_rather_than_blas(qtype: GGMLQuantizationType, tiles: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A matrix under WIDE_VALUES values (a Q4_K_M file's V projection) runs a prompt chunk on the
    tiles, which beat dequantizing it for BLAS at any size; with the tiles off it goes back to
    BLAS past KERNEL_ROWS, as before the tiles."""
    matrix, values = encoded_matrix(qtype, 37, 512)
    x = np.random.default_rng(8).standard_normal((KERNEL_ROWS + 24, 512)).astype(np.float32)
    assert np.array_equal(matrix.times(x), amx_kernels.times(x, *matrix.arrays))
    monkeypatch.setenv(amx_kernels.ENV, "off")
    assert matrix.kernel_rows == KERNEL_ROWS
    blas = matrix.times(x)
    assert not np.array_equal(blas, vnni(x, matrix))  # float32 x, not x rounded to int8
    np.testing.assert_allclose(blas, x @ values.T, rtol=1e-5, atol=1e-5 * float(np.abs(blas).max()))

def test_a_prompt_pass_gives_the_greedy_tokens_the_vnni_kernels_give(tiles: None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """llama3's Q4_K_M fixture (Q4_K and Q6_K matrices): a 20-token prompt's rows take the tiles,
    and its logits are the VNNI kernels' up to float32 sums, the same top token at every position.
    Attention keeps BLAS both times: its tiles' rounding tips int8 activations' (their own tests:
    tests/test_amx_attention.py)."""
    monkeypatch.setattr(amx_attention, "takes", lambda *_: False)
    gguf = GGUFFile(Fixture("llama3", "Q4_K_M").path)
    engine = CPUEngine(gguf, ModelConfig.from_gguf(gguf), kv_type="f32", tune_threads=False)
    prompt = [(7 * i) % engine.config.vocab_size for i in range(20)]
    on, off = prompt_logits_with_and_without_tiles(engine, prompt, amx_kernels, "grouped_times", monkeypatch)
    assert np.array_equal(on.argmax(-1), off.argmax(-1))
    assert np.abs(on - off).max() <= 1e-3 * np.abs(off).max()


def test_the_banner_names_the_tiles_for_a_model_they_serve(tiles: None, smollm2_path) -> None:  # noqa: ANN001
    """/health's device names the products' tiles for a model with K-quants (llama3's Q4_K_M
    fixture), not for one they never run (SmolLM2's Q4_1)."""
    devices = [CPUEngine(gguf, ModelConfig.from_gguf(gguf), tune_threads=False).device
               for gguf in (GGUFFile(Fixture("llama3", "Q4_K_M").path), GGUFFile(smollm2_path))]
    assert "prompt chunks of K-quants" in devices[0] and "K-quants" not in devices[1]


def test_a_tiles_setting_other_than_auto_or_off_is_refused_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mistyped LMSERVE_CPU_TILES stops the load with one line naming it, on any CPU."""
    monkeypatch.setenv(amx_kernels.ENV, "of")
    gguf = GGUFFile(Fixture("llama3", "Q4_K_M").path)
    with pytest.raises(ModelLoadError, match="LMSERVE_CPU_TILES must be auto or off, not 'of'"):
        CPUEngine(gguf, ModelConfig.from_gguf(gguf), tune_threads=False)


def prompt_logits_with_and_without_tiles(engine: CPUEngine, prompt: list[int], module: object, name: str,
                                         monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, np.ndarray]:
    """Every position's logits of `prompt` with the tiles on (`module.name`, the tiles' entry,
    seen called) and with them off (amx_kernels.ENV)."""
    calls, entry = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or entry(*a))
    on = engine.prefill(engine.new_cache(64), prompt, all_logits=True)
    assert calls
    monkeypatch.setenv(amx_kernels.ENV, "off")
    return on, engine.prefill(engine.new_cache(64), prompt, all_logits=True)
