"""Attention with the compiled softmax (`softmax_kernel`) against float64 attention computed
here from its definition, and against the NumPy softmax macOS runs: causal prompt chunks after
cached positions (whole, and in runs of positions over the keys they see), one decode row,
sliding windows, gpt-oss's sinks, grouped KV heads. And the
scores of a decode step's few query rows, run as keys times queries, have the bits of queries
times keys."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from lmserve.engine_cpu import ops

pytestmark = [pytest.mark.fast,
              pytest.mark.skipif(sys.platform == "darwin", reason="numba is not installed on macOS (MLX serves)")]


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, scale: float, window: int,
              sinks: np.ndarray | None) -> np.ndarray:
    """Each query head's softmax over the keys its position sees, in float64, one row at a time."""
    n, heads, head_dim = q.shape
    group = heads // len(keys)
    out = np.zeros((n, heads, head_dim))
    for i in range(n):
        position = start + i
        seen = [p for p in range(position + 1) if not window or p > position - window]
        for h in range(heads):
            logits = keys[h // group, seen].astype(np.float64) @ q[i, h] * scale
            extra = [] if sinks is None else [float(sinks[h])]
            peak = max([logits.max(), *extra])
            weights = np.exp(logits - peak)
            weights /= weights.sum() + sum(np.exp(s - peak) for s in extra)
            out[i, h] = weights @ values[h // group, seen]
    return out.reshape(n, heads * head_dim)


CASES = {"prompt chunk after cached keys": (24, 40, 0, False), "first chunk": (17, 0, 0, False),
         "one decode row": (1, 70, 0, False), "sliding window chunk": (20, 50, 16, False),
         "sliding window decode": (1, 90, 16, False), "sinks": (12, 30, 0, True),
         "sinks and window": (9, 40, 8, True)}


@pytest.mark.parametrize("case", CASES)
def test_compiled_softmax_attention_matches_float64(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    n, start, window, with_sinks = CASES[case]
    rng = np.random.default_rng(len(case))
    heads, kv_heads, head_dim = 8, 2, 32
    q = rng.standard_normal((n, heads, head_dim)).astype(np.float32) * 2
    keys = rng.standard_normal((kv_heads, start + n, head_dim)).astype(np.float32)
    values = rng.standard_normal((kv_heads, start + n, head_dim)).astype(np.float32)
    sinks = rng.standard_normal(heads).astype(np.float32) * 3 if with_sinks else None
    want = reference(q, keys, values, start, 0.2, window, sinks)
    compiled = ops.attention(q, keys, values, start, 0.2, window, sinks)
    monkeypatch.setattr(ops, "_compiled_softmax", lambda: None)
    numpy = ops.attention(q, keys, values, start, 0.2, window, sinks)
    assert np.abs(compiled - want).max() < 2e-5
    assert np.abs(numpy - want).max() < 2e-5


@pytest.mark.parametrize("case", CASES)
def test_runs_of_positions_over_the_keys_they_see_match_float64(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt chunk's products run a few positions at a time over only the keys those see (a
    run of 5 here: ragged at the chunk's end, and inside a sliding window)."""
    n, start, window, with_sinks = CASES[case]
    rng = np.random.default_rng(len(case) + 7)
    q = rng.standard_normal((n, 8, 32)).astype(np.float32) * 2
    keys, values = (rng.standard_normal((2, start + n, 32)).astype(np.float32) for _ in range(2))
    sinks = rng.standard_normal(8).astype(np.float32) * 3 if with_sinks else None
    want = reference(q, keys, values, start, 0.2, window, sinks)
    monkeypatch.setattr(ops, "CAUSAL_RUN", 5)
    assert np.abs(ops.attention(q, keys, values, start, 0.2, window, sinks, ops.Scratch()) - want).max() < 2e-5
    monkeypatch.setattr(ops, "_compiled_softmax", lambda: None)
    assert np.abs(ops.attention(q, keys, values, start, 0.2, window, sinks) - want).max() < 2e-5


def test_masked_keys_count_for_nothing() -> None:
    """Keys after a query (and before its window) leave its output unchanged, however large."""
    rng = np.random.default_rng(3)
    n, start, window = 16, 20, 10
    q = rng.standard_normal((n, 4, 16)).astype(np.float32)
    keys = rng.standard_normal((1, start + n, 16)).astype(np.float32)
    values = rng.standard_normal((1, start + n, 16)).astype(np.float32)
    before = ops.attention(q, keys, values, start, 0.25, window)
    keys[:, :start - window + 1] *= 1e3  # before every query's window
    values[:, :start - window + 1] = 1e6
    np.testing.assert_array_equal(ops.attention(q, keys, values, start, 0.25, window), before)
    keys[:, start + n - 1] *= 1e3  # seen only by the chunk's last query
    values[:, start + n - 1] = 1e6
    after = ops.attention(q, keys, values, start, 0.25, window)
    np.testing.assert_array_equal(after[:-1], before[:-1])
    assert np.abs(after[-1]).max() > 1e3


@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (4, 4, 64), (8, 4, 128), (1, 8, 256)])
@pytest.mark.parametrize("rows", [1, 4])
def test_decode_scores_have_the_bits_of_queries_times_keys(kv_heads: int, group: int, head_dim: int,
                                                            rows: int) -> None:
    rng = np.random.default_rng(kv_heads * group + rows)
    for seen in (50, 700, 5000):  # under and past SMALL_PRODUCT
        qg = rng.standard_normal((kv_heads, group * rows, head_dim)).astype(np.float32)
        keys = rng.standard_normal((kv_heads, seen + 30, head_dim)).astype(np.float32)[:, :seen]  # a cache's view
        scores = ops._scores(qg, keys)
        assert scores.flags.c_contiguous and np.array_equal(scores, qg @ keys.transpose(0, 2, 1))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("parts", [2, 3])
def test_a_softmax_split_between_threads_has_the_bits_of_one(case: str, parts: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt pass's softmax runs a range of rows on each CPU; each row comes out as on one."""
    n, start, window, with_sinks = CASES[case]
    rng = np.random.default_rng(len(case) + parts)
    q = rng.standard_normal((n, 8, 32)).astype(np.float32) * 2
    keys, values = (rng.standard_normal((2, start + n, 32)).astype(np.float32) for _ in range(2))
    sinks = rng.standard_normal(8).astype(np.float32) * 3 if with_sinks else None
    whole = ops.attention(q, keys, values, start, 0.2, window, sinks)
    monkeypatch.setattr(ops, "THREADED_SCORES", 1)
    monkeypatch.setattr(ops, "_cpus", lambda: parts)
    np.testing.assert_array_equal(ops.attention(q, keys, values, start, 0.2, window, sinks), whole)


def test_scores_written_into_one_pass_buffer_have_the_bits_of_new_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass's layers write their scores into one buffer in turn, as it grows and shrinks (a
    decode step's caches of different lengths, a prompt chunk after them). BLAS's passes: AMX
    tiles keep a prompt pass's scores in buffers of their own."""
    monkeypatch.setenv("LMSERVE_CPU_TILES", "off")  # amx_kernels.ENV
    rng = np.random.default_rng(5)
    scratch = ops.Scratch()
    for n, start in [(16, 100), (256, 900), (1, 3000), (40, 20), (256, 1200)]:
        q = rng.standard_normal((n, 9, 64)).astype(np.float32)
        keys, values = (rng.standard_normal((3, start + n, 64)).astype(np.float32) for _ in range(2))
        np.testing.assert_array_equal(ops.attention(q, keys, values, start, 0.125, scratch=scratch),
                                      ops.attention(q, keys, values, start, 0.125))


def test_a_row_of_any_length_gets_numpys_softmax_and_a_nan_reaches_it_all() -> None:
    """The scaled row's largest value is found a vector at a time, then over the values past
    its whole vectors: rows of 1-40 values (none, one and two whole vectors, with and without a
    tail), their largest placed in the vectors or in the tail, and a NaN anywhere."""
    from numba import njit

    from lmserve.engine_cpu.softmax_kernel import softmax_row

    @njit
    def softmax(row, scale):  # noqa: ANN001, ANN202
        softmax_row(row, scale, np.float32(0.0), False)

    rng = np.random.default_rng(11)
    for length in range(1, 41):
        for peak_at in {0, length // 2, length - 1}:
            row = rng.standard_normal(length).astype(np.float32)
            row[peak_at] = 400.0  # the largest by far: exp of it less any other value overflows float32
            want = np.exp((row.astype(np.float64) - row.max()) * 0.5)
            got = row.copy()
            softmax(got, np.float32(0.5))
            np.testing.assert_allclose(got, want / want.sum(), rtol=2e-6, atol=1e-30)
        poisoned = rng.standard_normal(length).astype(np.float32)
        poisoned[rng.integers(length)] = np.nan
        softmax(poisoned, np.float32(0.5))
        assert np.isnan(poisoned).all()
