"""A decode step's attention over a float32 cache in one compiled call (`row_attention_kernel`):
the new rows' rotated keys and their values written where the NumPy path writes them, and each
query's output against float64 attention, for one decode row and a verify pass's rows, partial
rotary, sliding windows, gpt-oss's sinks, query heads in groups of 4, 3 and 1 a KV head, and the
query and value views a layer passes; and a served engine's decode steps giving the answers of the
NumPy path."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from lmserve.engine_cpu import ops
from lmserve.model.default_model import default_model_path
from tests.test_kv_types import engine
from tests.test_softmax_kernel import reference

pytestmark = [pytest.mark.fast,
              pytest.mark.skipif(sys.platform == "darwin", reason="numba is not installed on macOS (MLX serves)")]

# rows, cached positions before them, window, sinks, head_dim, rotary dimensions
CASES = {"one decode row": (1, 70, 0, False, 64, 64), "verify pass": (4, 300, 0, False, 64, 64),
         "partial rotary": (1, 90, 0, False, 128, 32), "sliding window": (2, 200, 48, False, 64, 64),
         "sinks": (1, 120, 0, True, 64, 64), "window and sinks": (3, 150, 32, True, 128, 64),
         "first position": (1, 0, 0, False, 64, 64),
         "heads on threads": (2, 700, 0, False, 64, 64), "heads on threads, window and sinks": (3, 500, 100, True, 64, 64)}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (9, 3), (6, 6)], ids=["groups of 4", "groups of 3", "no groups"])
def test_rows_are_written_and_attended_as_in_float64(case: str, heads: int, kv_heads: int) -> None:
    """Each query head reads its own KV head (h // group), whether its group's heads share the reads or not."""
    n, start, window, with_sinks, head_dim, rotary = CASES[case]
    rng = np.random.default_rng(len(case))
    # One layer's projections as attention views them: queries, keys and values of each row side by side.
    projected = rng.standard_normal((n, heads + 2 * kv_heads, head_dim)).astype(np.float32)
    qk, v = projected[:, :heads + kv_heads], projected[:, heads + kv_heads:]
    inv_freq = 1.0 / 10000 ** (np.arange(0, rotary, 2) / rotary)
    cos, sin = ops.rope_tables(np.arange(start, start + n), inv_freq)
    keys, values = (rng.standard_normal((kv_heads, start + n + 20, head_dim)).astype(np.float32) for _ in range(2))
    untouched = keys[:, start + n:].copy(), values[:, start + n:].copy()
    sinks = rng.standard_normal(heads).astype(np.float32) * 3 if with_sinks else None
    assert ops.attends_in_one_call(n * heads // kv_heads, start + n)
    out = np.empty((n, heads, head_dim), np.float32)
    ops.attend_rows(qk, v, cos, sin, keys, values, start, 0.125, window, sinks, out)

    rotated = ops.rope(qk, cos, sin)
    np.testing.assert_allclose(keys[:, start:start + n], rotated[:, heads:].transpose(1, 0, 2), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(values[:, start:start + n], v.transpose(1, 0, 2))
    np.testing.assert_array_equal(keys[:, start + n:], untouched[0])
    np.testing.assert_array_equal(values[:, start + n:], untouched[1])
    want = reference(rotated[:, :heads], keys[:, :start + n], values[:, :start + n], start, 0.125, window, sinks)
    np.testing.assert_allclose(out.reshape(n, -1), want, rtol=1e-5, atol=2e-6)


def test_long_contexts_are_cases_of_their_own() -> None:
    """Past PARALLEL_SCORES a pass's heads run on the kernels' threads: the cases cover both sides."""
    from lmserve.engine_cpu.row_attention_kernel import PARALLEL_SCORES

    scores = {case: (n + start) * 8 for case, (n, start, *_) in CASES.items()}
    assert min(scores.values()) < PARALLEL_SCORES <= scores["heads on threads"]
    assert scores["heads on threads, window and sinks"] >= PARALLEL_SCORES


def test_long_passes_and_wide_ones_stay_on_numpy() -> None:
    assert ops.attends_in_one_call(ops.FEW_QUERY_ROWS, ops.ONE_CALL_POSITIONS)
    assert not ops.attends_in_one_call(ops.FEW_QUERY_ROWS + 1, 100)
    assert not ops.attends_in_one_call(3, ops.ONE_CALL_POSITIONS + 1)


def test_decode_steps_give_the_numpy_paths_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 decoding two caches together, in one call a cache and then through NumPy."""
    e = engine(default_model_path(), "f32")
    prompts = [list(range(40, 90)), list(range(300, 420))]

    def steps() -> list[np.ndarray]:
        caches = [e.new_cache(256) for _ in prompts]
        tokens = [int(e.prefill(c, p).argmax()) for c, p in zip(caches, prompts, strict=True)]
        logits = []
        for _ in range(6):
            logits.append(e.decode(caches, tokens))
            tokens = logits[-1].argmax(-1).tolist()
        return logits

    compiled = steps()
    monkeypatch.setattr(ops, "ONE_CALL_POSITIONS", 0)
    for got, want in zip(compiled, steps(), strict=True):
        assert (got.argmax(-1) == want.argmax(-1)).all()
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-3)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "rotary"), [(9, 3, 64, 64), (8, 2, 128, 32), (4, 4, 64, 64)])
def test_a_prompts_rows_are_rotated_into_the_cache_and_a_kv_heads_positions(heads: int, kv_heads: int, head_dim: int,
                                                                            rotary: int) -> None:
    """`rope_rows` for a prompt pass: keys and values where the NumPy path writes them, and each
    query head's rotated row at `[h // group, r, h % group]`, the layout attention multiplies."""
    from lmserve.engine_cpu.row_attention_kernel import rope_rows

    n, start, group = 37, 11, heads // kv_heads
    rng = np.random.default_rng(heads + rotary)
    projected = rng.standard_normal((n, heads + 2 * kv_heads, head_dim)).astype(np.float32)
    qk, v = projected[:, :heads + kv_heads], projected[:, heads + kv_heads:]
    cos, sin = ops.rope_tables(np.arange(start, start + n), 1.0 / 10000 ** (np.arange(0, rotary, 2) / rotary))
    keys, values = (np.zeros((kv_heads, start + n + 5, head_dim), np.float32) for _ in range(2))
    q = np.empty((kv_heads, n, group, head_dim), np.float32)
    rope_rows(qk, v, cos, sin, keys, values, start, q, True)
    rotated = ops.rope(qk, cos, sin)
    np.testing.assert_allclose(q, rotated[:, :heads].reshape(n, kv_heads, group, head_dim).transpose(1, 0, 2, 3),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(keys[:, start:start + n], rotated[:, heads:].transpose(1, 0, 2), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(values[:, start:start + n], v.transpose(1, 0, 2))
    assert not keys[:, :start].any() and not keys[:, start + n:].any() and not values[:, start + n:].any()


def test_prompts_rotated_in_one_pass_give_the_numpy_paths_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 prefilling a prompt in two passes (the second after cached positions, past a run
    of positions) with the compiled rotation and then with NumPy's."""
    from lmserve.engine_cpu import attention

    e = engine(default_model_path(), "f32")
    prompt = list(range(40, 440))

    def logits() -> np.ndarray:
        cache = e.new_cache(512)
        first = e.prefill(cache, prompt[:150], all_logits=True)
        return np.concatenate([first, e.prefill(cache, prompt[150:], all_logits=True)])

    compiled = logits()
    monkeypatch.setattr(attention, "_rotates_in_one_pass", lambda batch: False)
    numpy = logits()
    assert (compiled.argmax(-1) == numpy.argmax(-1)).mean() > 0.99
    np.testing.assert_allclose(compiled, numpy, rtol=1e-3, atol=2e-3)
