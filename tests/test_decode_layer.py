"""A decode step's plain layer halves as compiled calls (`decode_layer`): which families' layers
take them (with int8 activations: a matrix on the float kernels keeps its half in Python), and
one-stream decode steps, a verify pass and a batched step giving the Python path's logits to the
bit, over a float32 cache and a q8_0 one."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from lmserve.engine_cpu import decode_layer
from lmserve.engine_cpu.engine import CPUEngine
from lmserve.model.config import ModelConfig
from lmserve.model.default_model import default_model_path
from lmserve.model.gguf_file import GGUFFile
from tests.families import Fixture

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("int8_dots"),  # the halves run the int8 kernels only
              pytest.mark.skipif(sys.platform == "darwin", reason="numba is not installed on macOS (MLX serves)")]


def engine(path: object, kv_type: str = "f32") -> CPUEngine:
    gguf = GGUFFile(path)
    return CPUEngine(gguf, ModelConfig.from_gguf(gguf), kv_type=kv_type, tune_threads=False)


@pytest.mark.parametrize(("family", "attention", "ffn", "moe"), [
    ("llama3", True, True, False), ("mistral", True, True, False),
    ("qwen2", False, True, False),  # QKV biases
    ("qwen3moe", True, False, True),  # q/k norms are fine; its experts run the compiled MoE half
    ("gpt-oss", False, False, False),  # biases
    ("qwen35moe", False, False, False),  # a shared expert; gated attention
    ("gemma3", False, False, False)])  # post-norms; GeGLU
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])  # Q4_K_M: Q/K/V a stack of Q4_K and Q6_K in some layers
def test_plain_halves_are_the_compiled_ones(family: str, attention: bool, ffn: bool, moe: bool, quant: str) -> None:
    halves = engine(Fixture(family, quant).path)._halves
    assert [h.attention is not None for h in halves] == [attention] * len(halves)
    assert [h.ffn is not None for h in halves] == [ffn] * len(halves)
    assert any(h.moe is not None for h in halves) == moe


MODELS = {"SmolLM2, f32 KV": (default_model_path(), "f32"), "SmolLM2, q8_0 KV": (default_model_path(), "q8_0"),
          "llama3 Q4_K_M": (Fixture("llama3", "Q4_K_M").path, "f32"),
          "qwen3moe Q4_K_M": (Fixture("qwen3moe", "Q4_K_M").path, "f32")}


@pytest.mark.parametrize("model", MODELS)
def test_compiled_halves_give_the_python_paths_logits(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """qwen3moe's FFN half is its experts'; a batch's attention is a call a cache (Python's loop)."""
    e = engine(*MODELS[model])
    assert any(h.attention is not None or h.ffn is not None or h.moe is not None for h in e._halves)
    vocab = e.config.vocab_size
    prompts = [[(7 * i) % vocab for i in range(40, 90)], [(11 * i) % vocab for i in range(300, 370)]]

    def passes() -> list[np.ndarray]:
        alone, other = e.new_cache(256), e.new_cache(256)
        logits = [e.prefill(alone, prompts[0])[None]]
        e.prefill(other, prompts[1])
        for _ in range(4):  # one stream
            logits.append(e.decode([alone], [int(logits[-1][-1].argmax())]))
        logits.extend(e.verify([alone], [[11, 12, 13]]))  # one cache, three rows
        logits.append(e.decode([alone, other], [7, 8]))  # a batch: the FFN half only
        return logits

    compiled = passes()
    monkeypatch.setattr(e, "_halves", [decode_layer.NONE] * len(e._halves))
    for got, want in zip(compiled, passes(), strict=True):  # the same compiled pieces, in the same order
        np.testing.assert_array_equal(got, want)
