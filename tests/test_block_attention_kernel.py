"""A decode step's attention over a q8_0, q4_0 or f16 cache in one compiled call, reading its
stored rows (`block_attention_kernel.attend_rows`): the new rows stored to within the type's
rounding and each output against float64 attention over what the cache holds, for one decode row
and a verify pass's rows, across chunk boundaries, sliding windows, gpt-oss's sinks and the first
position; the same bits on one thread and two, and on the calling thread and the kernels'; and an
engine's decode step after hundreds of cached positions giving the answer the float32 path gives."""

from __future__ import annotations

import sys

import numba
import numpy as np
import pytest

from lmserve.engine.kv_types import KV_TYPES
from lmserve.engine_cpu import ops
from lmserve.engine_cpu.kv_codec import KVCodec
from lmserve.model.default_model import default_model_path
from lmserve.model.loader import load_model
from tests.families import cosine
from tests.kv_checks import PASSAGE
from tests.test_kv_types import engine
from tests.test_softmax_kernel import reference

pytestmark = [pytest.mark.fast,
              pytest.mark.skipif(sys.platform == "darwin", reason="numba is not installed on macOS (MLX serves)")]

# rows, cached positions before them, window, sinks, head_dim: chunks are 256 positions
CASES = {"one decode row": (1, 70, 0, False, 64), "decode across chunks": (1, 700, 0, False, 64),
         "verify pass": (3, 520, 0, False, 128), "sliding window decode": (1, 600, 128, False, 64),
         "sinks": (2, 300, 0, True, 64), "window and sinks": (1, 400, 64, True, 128),
         "first position": (1, 0, 0, False, 64)}
HEADS, KV_HEADS = 8, 2
# What a cache holds of a row, as a fraction of the row's norm: its type's rounding.
ROUNDING = {"q8_0": 0.01, "q4_0": 0.12, "f16": 0.001}


def case_arrays(case: str, kv_type: str) -> tuple:
    """A layer's new rows (queries and keys before rotation, values), their rope tables, and a
    cache of `kv_type` holding `start` earlier positions with room past them."""
    n, start, window, with_sinks, head_dim = CASES[case]
    rng = np.random.default_rng(len(case))
    projected = rng.standard_normal((n, HEADS + 2 * KV_HEADS, head_dim)).astype(np.float32) * 2
    qk, v = projected[:, :HEADS + KV_HEADS], projected[:, HEADS + KV_HEADS:]
    cos, sin = ops.rope_tables(np.arange(start, start + n), 1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim))
    codec = KVCodec(KV_TYPES[kv_type])
    keys, values = codec.empty(KV_HEADS, start + n + 37, head_dim), codec.empty(KV_HEADS, start + n + 37, head_dim)
    for stored in (keys, values):
        stored[:, :start] = codec.encode(rng.standard_normal((KV_HEADS, start, head_dim)).astype(np.float32))
    sinks = rng.standard_normal(HEADS).astype(np.float32) * 3 if with_sinks else None
    return codec, (qk, v, cos, sin, keys, values, start, 0.125, window, sinks)


def attend(kv_type: str, qk: np.ndarray, v: np.ndarray, cos: np.ndarray, sin: np.ndarray, keys: np.ndarray,
           values: np.ndarray, start: int, scale: float, window: int, sinks: np.ndarray | None) -> np.ndarray:
    """`ops.attend_rows` over the cache's stored rows: the rows' outputs `[n, heads * head_dim]`."""
    n, head_dim = len(qk), qk.shape[2]
    assert ops.attends_in_one_call(n * HEADS // KV_HEADS, start + n, kv_type)
    out = np.empty((n, HEADS, head_dim), np.float32)
    ops.attend_rows(qk, v, cos, sin, keys, values, start, scale, window, sinks, out, kv_type)
    return out.reshape(n, -1)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0", "f16"])
@pytest.mark.parametrize("case", CASES)
def test_rows_are_stored_and_attended_as_in_float64_over_what_the_cache_holds(case: str, kv_type: str) -> None:
    """The new rows' keys (rotated) and values are stored at their positions to within the type's
    rounding, and each query's output is float64 attention over the values the cache holds."""
    codec, arguments = case_arrays(case, kv_type)
    qk, v, cos, sin, keys, values, start, scale, window, sinks = arguments
    n = len(qk)
    earlier = keys[:, :start].copy(), values[:, :start].copy()
    out = attend(kv_type, *arguments)

    rotated = ops.rope(qk, cos, sin)
    held_keys, held_values = codec.values(keys[:, :start + n]), codec.values(values[:, :start + n])
    for held, new in ((held_keys, rotated[:, HEADS:]), (held_values, v)):
        want = new.transpose(1, 0, 2)
        assert np.linalg.norm(held[:, start:] - want, axis=-1).max() < ROUNDING[kv_type] * np.linalg.norm(want, axis=-1).min()
    np.testing.assert_array_equal(keys[:, :start], earlier[0])
    np.testing.assert_array_equal(values[:, :start], earlier[1])
    assert not keys[:, start + n:].any() and not values[:, start + n:].any()
    want = reference(rotated[:, :HEADS], held_keys, held_values, start, scale, window, sinks)
    assert np.abs(out - want).max() < 2e-5


def test_cases_read_on_the_calling_thread_and_on_the_kernels_threads() -> None:
    """Past PARALLEL_SCORES scores a pass's positions are read in chunks on the kernels' threads."""
    from lmserve.engine_cpu.row_attention_kernel import PARALLEL_SCORES

    scores = {case: (n + start) * HEADS for case, (n, start, *_) in CASES.items()}
    assert scores["one decode row"] < PARALLEL_SCORES <= scores["decode across chunks"]


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one CPU")
@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0", "f16"])
def test_a_rows_output_does_not_depend_on_the_thread_count(kv_type: str) -> None:
    _, arguments = case_arrays("decode across chunks", kv_type)
    before = numba.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2):
            numba.set_num_threads(threads)
            outputs.append(attend(kv_type, *arguments))
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(outputs[0], outputs[1])


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0", "f16"])
def test_the_calling_threads_readers_give_the_threaded_ones_bits(kv_type: str) -> None:
    """A short context's scores and mix (on the calling thread) sum as the threads' chunks do."""
    from lmserve.engine_cpu import block_attention_kernel as kernels

    codec = KVCodec(KV_TYPES[kv_type])
    rng = np.random.default_rng(3)
    keys, values = (codec.encode(rng.standard_normal((2, 600, 64)).astype(np.float32)).view(np.uint8)
                    for _ in range(2))
    queries = rng.standard_normal((2, 5, 64)).astype(np.float32)
    scores = [np.empty((2, 5, 600), np.float32) for _ in range(2)]
    kernels.block_scores(queries, keys, scores[0], kernels.KINDS[kv_type])
    kernels.block_scores_serial(queries, keys, scores[1], kernels.KINDS[kv_type])
    np.testing.assert_array_equal(*scores)
    weights = rng.random((2, 5, 600)).astype(np.float32)
    mixed = [np.empty((2, 5, 64), np.float32) for _ in range(2)]
    kernels.block_mix(weights, values, mixed[0], kernels.KINDS[kv_type])
    kernels.block_mix_serial(weights, values, mixed[1], kernels.KINDS[kv_type])
    np.testing.assert_array_equal(*mixed)


def test_only_a_few_query_rows_read_the_blocks() -> None:
    """A prompt pass's hundreds of rows a KV head run in BLAS over float32, faster there."""
    assert ops.reads_blocks(1) and ops.reads_blocks(ops.FEW_QUERY_ROWS)
    assert not ops.reads_blocks(ops.FEW_QUERY_ROWS + 1)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0", "f16"])
def test_a_decode_step_over_blocks_answers_as_the_float32_path_does(kv_type: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 after 700 cached positions of a real passage: the step reading the blocks and the
    same step through float32 keys and values pick the same token, logits pointing the same way."""
    path = default_model_path()
    e = engine(path, kv_type)
    ids = load_model(path, None, None, embedded=True).tokenizer.encode(PASSAGE.read_text())[:701]
    kv = e.new_cache(800)
    e.prefill(kv, ids[:700])
    over_blocks = e.decode([kv], [ids[700]])[0]
    e.truncate(kv, 700)
    monkeypatch.setattr(ops, "reads_blocks", lambda rows: False)
    through_floats = e.decode([kv], [ids[700]])[0]
    assert over_blocks.argmax() == through_floats.argmax()
    assert cosine(over_blocks, through_floats) > 0.9999
