"""Embeddings: `Engine.embed` on both engines and `serving/embeddings.py`'s pooling, against a tiny
random-weight Qwen3 embedding model made by llama.cpp's converter from a transformers model with
Qwen3-Embedding's sentence-transformers metadata (last-token pooling, L2-normalized;
scripts/make_embedding_fixture.py, tests/data/fixtures/embedding).

References: transformers in float32 on the model itself (whose weights are float16 values, so the
F16 file holds it exactly) and llama.cpp's llama-server `/v1/embeddings` on each file. Measured
here (both engines, the NumPy one with its quantized kernels and in float32 alike): on the F16 file both engines agree with transformers at cosine
>= 0.99999995 and with llama-server at >= 0.99999984; on Q8_0 with llama-server at >= 0.99995
(llama.cpp quantizes activations to 8 bits against a Q8_0 matrix) and with transformers at
>= 0.99991. Distinct inputs' embeddings are 0.34-0.89 apart in cosine, so these bounds separate them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from lmserve.engine.protocol import Engine
from lmserve.engine_cpu import CPUEngine
from lmserve.engine_cpu import engine as cpu_engine_module
from lmserve.model import config as config_module
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile
from lmserve.serving.embeddings import check_pooling, embed_tokens, normalize, pool
from tests.conftest import DATA, TINY_LLAMA
from tests.engine_proxies import TrackingEngine

pytestmark = pytest.mark.fast  # tiny models, in-process: a few seconds

FIXTURE = DATA / "fixtures" / "embedding"
FILES = {kind: FIXTURE / f"tiny-qwen3-embedding-{kind}.gguf" for kind in ("F16", "Q8_0")}
REFERENCES = json.loads((FIXTURE / "references.json").read_text())
LISTS: list[list[int]] = REFERENCES["token_ids"]
LONGEST = max(LISTS, key=len)
# The least cosine each file's embeddings must reach against each reference (measured: module docstring).
BOUNDS = {"F16": {"transformers": 0.9999, "llama_server": 0.9999},
          "Q8_0": {"transformers": 0.999, "llama_server": 0.9999}}


def open_model(path: Path) -> tuple[GGUFFile, ModelConfig]:
    gguf = GGUFFile(path)
    return gguf, ModelConfig.from_gguf(gguf)


def make_cpu(kind: str) -> CPUEngine:
    return CPUEngine(*open_model(FILES[kind]))


def make_mlx(kind: str) -> Engine:
    pytest.importorskip("mlx.core")
    from lmserve.engine_mlx import MLXEngine

    return MLXEngine(*open_model(FILES[kind]))


MAKERS = {"cpu": make_cpu, "mlx": make_mlx}
_engines: dict[tuple[str, str], Engine] = {}


def engine_for(name: str, kind: str) -> Engine:
    """One engine per (engine, file) for the whole module (MLX skips where it is not importable)."""
    if (name, kind) not in _engines:
        _engines[name, kind] = MAKERS[name](kind)
    return _engines[name, kind]


def reference(source: str, kind: str) -> list[np.ndarray]:
    if source == "transformers":
        return [np.array(e) for e in REFERENCES["transformers"]]
    return [np.array(e) for e in REFERENCES["llama_server"][FILES[kind].name]["embeddings"]]


# -- the model's metadata --------------------------------------------------------------------


def test_config_reads_the_pooling_of_an_embedding_model() -> None:
    _, config = open_model(FILES["F16"])
    assert (config.architecture, config.pooling, config.is_embedding) == ("qwen3", "last", True)
    _, generative = open_model(TINY_LLAMA / "tiny-llama-F32.gguf")
    assert (generative.pooling, generative.is_embedding) == (None, False)


@pytest.mark.parametrize(("value", "name", "embedding"), [
    (0, "none", False), (1, "mean", True), (2, "cls", True), (3, "last", True), (4, "rank", False),
    (9, "unknown (9)", False), (None, None, False),
])
def test_pooling_types_by_llama_cpp_value(value: int | None, name: str | None, embedding: bool) -> None:
    pooling = config_module._pooling(value)
    assert pooling == name
    _, config = open_model(FILES["F16"])
    assert dataclasses.replace(config, pooling=pooling).is_embedding is embedding


# -- against the references ------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(FILES))
@pytest.mark.parametrize("source", ["transformers", "llama_server"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_embeddings_match_the_references(name: str, source: str, kind: str) -> None:
    """Pooled by the file's own pooling (last) and L2-normalized, end to end."""
    engine = engine_for(name, kind)
    for ids, expected in zip(LISTS, reference(source, kind), strict=True):
        got = embed_tokens(engine, ids)
        assert got.dtype == np.float32 and got.shape == (engine.config.hidden_size,)
        assert abs(np.linalg.norm(got) - 1) < 1e-5
        assert float(got @ expected) >= BOUNDS[kind][source], (len(ids), float(got @ expected))


@pytest.mark.parametrize("name", list(MAKERS))
def test_embed_gives_every_position_after_the_output_norm(name: str) -> None:
    """`embed` itself: transformers' final hidden state (after the norm) at every position of the
    longest input, on the F16 file that holds that model exactly."""
    hidden = engine_for(name, "F16").embed(LONGEST)
    expected = np.array(REFERENCES["hidden_longest"], dtype=np.float32)
    assert hidden.dtype == np.float32 and hidden.shape == expected.shape
    assert (normalize(hidden) * normalize(expected)).sum(-1).min() >= 0.9999
    assert np.allclose(hidden, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(MAKERS))
def test_a_prefix_embeds_as_the_start_of_the_whole(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Causal attention from a fresh cache: the first k positions of an input are the input of
    length k, and cutting the pass into chunks changes nothing."""
    engine = engine_for(name, "F16")
    whole = engine.embed(LONGEST)
    assert np.allclose(engine.embed(LONGEST[:10]), whole[:10], atol=1e-4)
    if name == "cpu":
        monkeypatch.setattr(cpu_engine_module, "FORWARD_CHUNK", 16)
    else:
        from lmserve.engine_mlx import engine as mlx_engine_module

        monkeypatch.setattr(mlx_engine_module, "FORWARD_CHUNK", 16)
    assert np.allclose(engine.embed(LONGEST), whole, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen35", "gemma4"])
def test_generative_families_embed_alike_on_both_engines(family: str) -> None:
    """A hybrid model (Qwen3.5: recurrent state in the temporary cache) and Gemma 4 (its own
    norms, soft-capped head left out): both engines give the same final hidden states, and a
    prefix's are the start of the whole's. Such files name no pooling: the last position's."""
    gguf, config = open_model(DATA / "fixtures" / "arch" / family / f"tiny-{family}-F16.gguf")
    assert config.pooling is None and not config.is_embedding
    ids = list(range(5, 45))
    cpu = CPUEngine(gguf, config).embed(ids)
    assert cpu.shape == (len(ids), config.hidden_size) and cpu.dtype == np.float32
    assert np.allclose(CPUEngine(gguf, config).embed(ids[:10]), cpu[:10], atol=1e-3)
    pytest.importorskip("mlx.core")
    from lmserve.engine_mlx import MLXEngine

    engine = MLXEngine(gguf, config)
    assert np.allclose(engine.embed(ids), cpu, atol=1e-3)
    assert np.allclose(engine.embed(ids[:10]), cpu[:10], atol=1e-3)


# -- pooling -----------------------------------------------------------------------------------


def test_mean_and_cls_pooling_on_embeds_hidden_states() -> None:
    engine = engine_for("cpu", "F16")
    for ids in LISTS:
        hidden = engine.embed(ids)
        mean = hidden.astype(np.float64).sum(0) / len(ids)
        assert np.allclose(pool(hidden, "mean"), mean, rtol=1e-6, atol=1e-7)
        assert np.array_equal(pool(hidden, "cls"), hidden[0])
        assert np.array_equal(pool(hidden, "last"), hidden[-1])
        assert np.array_equal(pool(hidden, None), hidden[-1])  # no pooling in the file: the last position
        for pooling, pooled in (("mean", mean), ("cls", hidden[0]), ("last", hidden[-1])):
            config = dataclasses.replace(engine.config, pooling=pooling)
            got = embed_tokens(engine, ids, config)
            assert np.allclose(got, pooled / np.linalg.norm(pooled), atol=1e-6)
            assert np.allclose(embed_tokens(engine, ids, config, normalized=False), pooled, atol=1e-6)
    # the first position of any input is that token alone (cls pooling of a causal model)
    assert np.allclose(pool(engine.embed(LONGEST), "cls"), engine.embed(LONGEST[:1])[0], atol=1e-4)


def test_what_gives_no_embedding_is_refused() -> None:
    engine = engine_for("cpu", "F16")
    hidden = engine.embed(LISTS[0])
    for pooling in ("none", "rank", "unknown (9)"):
        with pytest.raises(ValueError, match=re.escape(f"pooling '{pooling}'")):
            pool(hidden, pooling)
        with pytest.raises(ValueError, match=re.escape(f"pooling '{pooling}'")):
            embed_tokens(engine, LISTS[0], dataclasses.replace(engine.config, pooling=pooling))
    check_pooling(None)
    with pytest.raises(ValueError):
        pool(hidden[:0], "last")
    assert np.array_equal(normalize(np.zeros(4, np.float32)), np.zeros(4, np.float32))
    assert np.allclose(normalize(np.array([[3.0, 4.0], [0.0, 2.0]])), [[0.6, 0.8], [0.0, 1.0]])


@pytest.mark.parametrize("name", list(MAKERS))
def test_embed_refuses_bad_input(name: str) -> None:
    engine = engine_for(name, "F16")
    for ids in ([], [engine.config.vocab_size], [-1]):
        with pytest.raises(ValueError):
            engine.embed(ids)


# -- caches ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MAKERS))
def test_embed_leaves_the_engines_caches_as_they_were(name: str) -> None:
    """A cache prefilled, then greedy-decoded (the MLX engine queues the next greedy step on the
    device), goes on exactly as a twin that saw no `embed` between its steps."""
    engine = engine_for(name, "F16")
    prompt = LONGEST[:20]

    def run(embed_between: bool) -> tuple[list[int], np.ndarray, int]:
        cache = engine.new_cache(64)
        engine.prefill(cache, prompt)
        ids = [int(engine.decode_argmax([cache], [5])[0])]
        for _ in range(3):
            if embed_between:
                engine.embed(LONGEST)
                engine.embed(LISTS[1])
            ids.append(int(engine.decode_argmax([cache], [ids[-1]])[0]))
        if embed_between:
            engine.embed(LONGEST)
        return ids, engine.decode([cache], [ids[-1]])[0], cache.length

    twin_ids, twin_logits, twin_length = run(False)
    ids, logits, length = run(True)
    assert ids == twin_ids and length == twin_length == len(prompt) + 5
    assert np.array_equal(logits, twin_logits)


def test_a_wrapping_engine_forwards_embed() -> None:
    engine = engine_for("cpu", "F16")
    assert np.array_equal(TrackingEngine(engine).embed(LISTS[1]), engine.embed(LISTS[1]))
