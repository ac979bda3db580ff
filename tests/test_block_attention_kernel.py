"""A decode step's attention read straight from a cache's stored rows (`block_attention_kernel`):
against float64 attention over the values they hold, for q8_0, q4_0 and f16, one decode row and a verify pass's rows, across chunk boundaries, sliding windows and
gpt-oss's sinks, from a cache's sliced rows; the same bits on one thread and two; and an engine's
decode step after hundreds of cached positions giving the answer the float32 path gives."""

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
         "sinks": (2, 300, 0, True, 64), "window and sinks": (1, 400, 64, True, 128)}


def cache_rows(codec: KVCodec, values: np.ndarray) -> np.ndarray:
    """`values` `[kv_heads, positions, head_dim]` stored as a cache holds them: inside a longer
    allocation, so the kernels read a slice of it, as attention does."""
    stored = codec.empty(values.shape[0], values.shape[1] + 37, values.shape[2])
    stored[:, :values.shape[1]] = codec.encode(values)
    return stored[:, :values.shape[1]]


def case_arrays(case: str, kv_type: str) -> tuple:
    n, start, window, with_sinks, head_dim = CASES[case]
    rng = np.random.default_rng(len(case))
    heads, kv_heads = 8, 2
    q = rng.standard_normal((n, heads, head_dim)).astype(np.float32) * 2
    codec = KVCodec(KV_TYPES[kv_type])
    keys, values = (cache_rows(codec, rng.standard_normal((kv_heads, start + n, head_dim)).astype(np.float32))
                    for _ in range(2))
    sinks = rng.standard_normal(heads).astype(np.float32) * 3 if with_sinks else None
    return codec, q, keys, values, start, window, sinks


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0", "f16"])
@pytest.mark.parametrize("case", CASES)
def test_attention_over_blocks_matches_float64_over_their_values(case: str, kv_type: str) -> None:
    codec, q, keys, values, start, window, sinks = case_arrays(case, kv_type)
    assert ops.reads_blocks(len(q) * 4)
    want = reference(q, codec.decode(keys), codec.decode(values), start, 0.125, window, sinks)
    got = ops.attention(q, keys, values, start, 0.125, window, sinks, ops.Scratch(), kv_type)
    through_floats = ops.attention(q, codec.decode(keys), codec.decode(values), start, 0.125, window, sinks)
    assert np.abs(got - want).max() < 2e-5
    assert np.abs(through_floats - want).max() < 2e-5


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one CPU")
@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0", "f16"])
def test_a_rows_output_does_not_depend_on_the_thread_count(kv_type: str) -> None:
    codec, q, keys, values, start, window, sinks = case_arrays("decode across chunks", kv_type)
    before = numba.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2):
            numba.set_num_threads(threads)
            outputs.append(ops.attention(q, keys, values, start, 0.125, window, sinks, None, kv_type))
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(outputs[0], outputs[1])


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
