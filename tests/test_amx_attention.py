"""A prompt pass's attention on AMX-BF16 tiles (`amx_attention`): within about 1e-5 of the float64
softmax attention (bf16x3 products), keys a query does not see weighted by exactly zero, a row's
bits independent of the pass and the thread count it runs in, a decode step's rows left to the
float32 paths, and a model's prompt giving the logits BLAS gives within that rounding."""

from __future__ import annotations

import sys

import numba
import numpy as np
import pytest

from lmserve.engine_cpu import CPUEngine, amx_attention, amx_kernels, ops
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile
from tests.families import Fixture
from tests.test_amx_kernels import prompt_logits_with_and_without_tiles

pytestmark = [pytest.mark.fast,
              pytest.mark.skipif(sys.platform == "darwin", reason="numba is not installed on macOS (MLX serves)")]


@pytest.fixture(autouse=True)
def tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    if not amx_attention.available():
        pytest.skip("AMX-BF16 tiles are not available here")
    monkeypatch.setenv(amx_kernels.ENV, "auto")


def reference(qg: np.ndarray, keys: np.ndarray, values: np.ndarray, n: int, start: int, first: int, scale: float,
              window: int, sinks: np.ndarray | None) -> np.ndarray:
    """Softmax attention in float64, the masks spelled out."""
    kv_heads, rows, _ = qg.shape
    group = rows // n
    scores = np.einsum("hrd,hcd->hrc", qg.astype(np.float64), keys.astype(np.float64)) * scale
    position = start + np.arange(rows) // group
    column = first + np.arange(keys.shape[1])
    hidden = column[None, :] > position[:, None]
    if window:
        hidden |= column[None, :] <= position[:, None] - window
    scores[:, hidden] = -np.inf
    peak = scores.max(-1, keepdims=True)
    sink = (np.full((kv_heads, rows, 1), -np.inf) if sinks is None
            else np.tile(sinks.reshape(kv_heads, 1, group), (1, n, 1)).reshape(kv_heads, rows, 1))
    peak = np.maximum(peak, sink)
    weights = np.exp(scores - peak)
    return weights @ values.astype(np.float64) / (weights.sum(-1, keepdims=True) + np.exp(sink - peak))


def case(kv_heads: int, n: int, group: int, head: int, start: int, window: int = 0, sink: bool = False,
         seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    first = max(0, start - window + 1) if window else 0
    seen = start + n - first
    qg = rng.standard_normal((kv_heads, n * group, head)).astype(np.float32)
    keys, values = (rng.standard_normal((kv_heads, seen, head)).astype(np.float32) for _ in range(2))
    sinks = rng.standard_normal(kv_heads * group).astype(np.float32) if sink else None
    return qg, keys, values, n, start, first, head ** -0.5, window, sinks


def attend(qg, keys, values, n, start, first, scale, window, sinks) -> np.ndarray:  # noqa: ANN001
    return amx_attention.attend(qg, keys, values, n, start, first, scale, window, ops.NO_SINKS if sinks is None else sinks)


@pytest.mark.parametrize("shape", [
    (2, 37, 3, 64, 0),  # rows and positions not whole tiles
    (4, 200, 4, 64, 300),  # a later chunk of a grouped-query model
    (1, 90, 1, 128, 45),
    (2, 70, 2, 64, 100, 40, True),  # a sliding window and sinks (gpt-oss)
    (1, 33, 2, 256, 0, 0, True),
])
def test_the_tiles_attention_is_float64s_within_bf16x3_rounding(shape: tuple) -> None:
    """Each product in three bfloat16 products: about 2^-16 of it dropped."""
    args = case(*shape)
    want = reference(*args)
    got = attend(*args)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.abs(got - want).max() <= 5e-5 * np.abs(want).max()


@pytest.mark.parametrize("seen", [1, 16, 17, 33, 48, 50])
def test_the_keys_layout_holds_every_tile_the_scores_read(seen: int) -> None:
    """The scores' products read the keys' tiles of 16 positions in pairs, up to the step of 32
    that holds the last position: the layout has every one, zeros past the last position. With an
    odd count (17-32 positions past a step) they read one tile past the last head's, off the end
    of the array, which crashed a served prompt (SIGSEGV) where the page after it was unmapped."""
    keys = np.random.default_rng(seen).standard_normal((2, seen, 64)).astype(np.float32)
    packed = amx_attention._pack(keys.view(np.uint32), True)
    assert packed.shape[2] * amx_attention.COLUMNS == -(-seen // amx_attention.PAIRS) * amx_attention.PAIRS
    assert not packed[:, :, -(-seen // amx_attention.COLUMNS):].any()

def test_keys_a_query_does_not_see_get_exactly_zero_weight() -> None:
    """Values past a query's position (and before its window) as large as 1e30 leave its output as
    it was: their weights are 0, not exp(-87) (Cephes' exponential's floor)."""
    qg, keys, values, n, start, first, scale, _, _ = case(2, 40, 2, 64, 30)
    window = 8
    base = attend(qg, keys, values, n, start, first, scale, window, None)
    loud = values.copy()
    loud[:, start + 5:] = 1e30  # after query 4's position
    loud[:, :start - window + 1] = -1e30  # before any query's window
    out = attend(qg, keys, loud, n, start, first, scale, window, None)
    rows = 5 * 2  # queries 0-4, both of a group's heads
    assert np.array_equal(out[:, :rows], base[:, :rows])


def test_a_rows_bits_do_not_depend_on_its_pass_or_the_thread_count() -> None:
    """A prompt in one pass or in two gives each row the same bits, as one thread or two: the
    engine's chunking and its thread tuner do not move a prompt's attention."""
    qg, keys, values, n, _, _, scale, _, _ = case(2, 96, 4, 64, 0)
    whole = attend(qg, keys, values, n, 0, 0, scale, 0, None)
    split = 40
    later = attend(qg[:, split * 4:], keys, values, n - split, split, 0, scale, 0, None)
    assert np.array_equal(later, whole[:, split * 4:])
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        alone = attend(qg, keys, values, n, 0, 0, scale, 0, None)
    finally:
        numba.set_num_threads(threads)
    assert np.array_equal(alone, whole)


def test_a_nan_query_spoils_its_own_row_only() -> None:
    qg, keys, values, n, start, first, scale, window, sinks = case(1, 32, 1, 64, 0)
    base = attend(qg, keys, values, n, start, first, scale, window, sinks)
    qg[0, 20, 3] = np.nan
    out = attend(qg, keys, values, n, start, first, scale, window, sinks)
    assert np.isnan(out[0, 20]).all()
    assert np.array_equal(np.delete(out, 20, axis=1), np.delete(base, 20, axis=1))


def test_which_passes_take_the_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt pass of more than a verify pass's rows, with a head size of whole tiles; the
    tiles' switch (amx_kernels.ENV) turns them off with the weights' tiles."""
    assert amx_attention.takes(17, 64) and amx_attention.takes(512, 128)
    assert not amx_attention.takes(16, 64)  # a verify pass's or a decode step's rows
    assert not amx_attention.takes(512, 80)
    monkeypatch.setenv(amx_kernels.ENV, "off")
    assert not amx_attention.takes(512, 64)


def test_a_prompts_logits_are_blass_within_the_tiles_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama3's fixture (float32 activations): a 40-token prompt's attention runs on the tiles,
    and every position's logits are BLAS's within 1e-4 of their range, the same top token."""
    gguf = GGUFFile(Fixture("llama3", "Q4_K_M").path)
    engine = CPUEngine(gguf, ModelConfig.from_gguf(gguf), kv_type="f32", dots="float32", tune_threads=False)
    prompt = [(7 * i) % engine.config.vocab_size for i in range(40)]
    on, off = prompt_logits_with_and_without_tiles(engine, prompt, amx_attention, "attend", monkeypatch)
    assert np.array_equal(on.argmax(-1), off.argmax(-1))
    assert 0 < np.abs(on - off).max() <= 1e-4 * np.abs(off).max()


def test_the_banner_names_the_attention_tiles(smollm2_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """/health's device says a prompt's attention runs on the tiles (SmolLM2's heads of 64), and
    not once they are turned off."""
    gguf = GGUFFile(smollm2_path)
    assert "prompt attention on AMX tiles" in CPUEngine(gguf, ModelConfig.from_gguf(gguf), tune_threads=False).device
    monkeypatch.setenv(amx_kernels.ENV, "off")
    assert "AMX" not in CPUEngine(gguf, ModelConfig.from_gguf(gguf), tune_threads=False).device
