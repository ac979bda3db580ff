"""The NumPy engine against f32 references, llama.cpp, the SmolLM2 goldens and itself."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lmserve.engine_cpu import CacheFullError, CPUEngine, ops
from lmserve.engine_cpu import engine as engine_module
from lmserve.engine_cpu.cache import GROW_STEP, TOKEN_BYTES
from lmserve.engine_cpu.weights import AttentionWeights
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile
from tests.conftest import TINY_LLAMA
from tests.families import Fixture
from tests.fixture_models import write_all

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

REFERENCE = json.loads((TINY_LLAMA / "reference_f32_logits.json").read_text())
LLAMA_CPP = json.loads((TINY_LLAMA / "llama_cpp_logits.json").read_text())
# How far llama.cpp's own last logits are from the f32 reference's, at most, over the files.
LLAMA_CPP_STRAY = max(np.abs(np.array(LLAMA_CPP["by_file"][f]["last_logits"]) - np.array(REFERENCE["by_file"][f]["last_logits"])).max()
                      for f in REFERENCE["by_file"])


def load(path: Path) -> CPUEngine:
    gguf = GGUFFile(path)
    return CPUEngine(gguf, ModelConfig.from_gguf(gguf))


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> CPUEngine:
    return load(smollm2_path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_all(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="module")
def tiny_engines(tiny_models: dict[str, Path]) -> dict[str, CPUEngine]:
    return {name: load(path) for name, path in tiny_models.items()}


# -- tiny llama: every quant type ------------------------------------------------------------

@pytest.mark.parametrize("file", sorted(REFERENCE["by_file"]))
def test_tiny_llama_matches_f32_reference_and_llama_cpp(file: str, cpu_dots: str) -> None:
    """Float32 activations give the reference's logits; int8 ones (quantized types only) stray
    from them no further than llama.cpp's own logits do on some file of these (0.29-0.64): the
    K-quants' nibbles round x a superblock at a time, as llama.cpp's Q8_K does."""
    engine = load(TINY_LLAMA / file)
    ids = REFERENCE["token_ids"]
    logits = engine.prefill(engine.new_cache(len(ids)), ids, all_logits=True)
    assert logits.shape == (len(ids), engine.config.vocab_size) and logits.dtype == np.float32

    ref = REFERENCE["by_file"][file]
    int8 = cpu_dots == "int8" and not file.endswith(("F32.gguf", "F16.gguf"))
    assert np.abs(logits[-1] - np.array(ref["last_logits"])).max() <= (LLAMA_CPP_STRAY if int8 else 1e-3)
    assert (logits.argmax(-1) == np.array(ref["top1"])).sum() >= (15 if int8 else len(ids))

    cpp = LLAMA_CPP["by_file"][file]
    cpp_last = np.array(cpp["last_logits"])
    cosine = logits[-1] @ cpp_last / np.linalg.norm(logits[-1]) / np.linalg.norm(cpp_last)
    assert cosine >= 0.999
    assert (logits.argmax(-1) == np.array(cpp["top1"])).sum() >= 14


# -- SmolLM2 goldens -------------------------------------------------------------------------

def test_smollm2_logits_match_goldens(smollm2: CPUEngine, chat_goldens: list[dict]) -> None:
    for case in chat_goldens:
        ids = case["prompt_ids"]
        logits = smollm2.prefill(smollm2.new_cache(len(ids)), ids, all_logits=True)
        for stored in case["last_positions"]:
            row = logits[stored["position"]]
            top10 = np.argsort(-row)[:10]
            assert int(top10[0]) == stored["top_ids"][0], case["messages"]
            assert set(top10.tolist()) == set(stored["top_ids"]), case["messages"]
            assert np.abs(row[stored["top_ids"]] - np.array(stored["top_logits"])).max() <= 0.005


def test_smollm2_greedy_decode_matches_goldens(smollm2: CPUEngine, chat_goldens: list[dict]) -> None:
    """All goldens decode in one batch (a step per token, not per token per case); finished
    sequences leave the batch, as they do in the scheduler."""
    caches = [smollm2.new_cache(len(c["prompt_ids"]) + len(c["greedy_ids"])) for c in chat_goldens]
    got = [[int(smollm2.prefill(cache, c["prompt_ids"]).argmax())] for cache, c in zip(caches, chat_goldens,
                                                                                        strict=True)]
    while active := [i for i, c in enumerate(chat_goldens) if len(got[i]) < len(c["greedy_ids"])]:
        logits = smollm2.decode([caches[i] for i in active], [got[i][-1] for i in active])
        for i, row in zip(active, logits, strict=True):
            got[i].append(int(row.argmax()))
    for case, tokens in zip(chat_goldens, got, strict=True):
        assert tokens == case["greedy_ids"], case["greedy_text"]


# -- batching and cache operations -----------------------------------------------------------

@pytest.mark.parametrize("batch", [3, ops.GEMV_ROWS + 1])  # 3 rows: blocked matrix-vector products; 8: one GEMM
def test_batched_decode_equals_solo(smollm2: CPUEngine, chat_goldens: list[dict], batch: int) -> None:
    prompts = [case["prompt_ids"][:20 + 7 * i] for i, case in enumerate(chat_goldens[:batch])]
    batched = [smollm2.new_cache(128) for _ in prompts]
    firsts = [int(smollm2.prefill(c, p).argmax()) for c, p in zip(batched, prompts, strict=True)]
    steps = [smollm2.decode(batched, firsts)]
    steps.append(smollm2.decode(batched, steps[-1].argmax(-1).tolist()))
    for i, prompt in enumerate(prompts):
        solo = smollm2.new_cache(128)
        smollm2.prefill(solo, prompt)
        token = firsts[i]
        for step in steps:
            logits = smollm2.decode([solo], [token])[0]
            np.testing.assert_allclose(step[i], logits, rtol=1e-4, atol=1e-3)
            token = int(step[i].argmax())
        assert solo.length == batched[i].length == len(prompt) + 2


def test_a_prompts_passes_keep_a_small_scores_buffer_and_drop_a_large_one(smollm2: CPUEngine,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine keeps the attention scores' buffer from one pass for the next (a served prompt
    is a pass a chunk, and a new buffer's first layer wrote fresh pages), up to KEPT_SCRATCH
    bytes only: a long prompt's scores are not held after it. The logits are the same either way.
    (BLAS's passes: the AMX tiles' keep a row tile's scores in a buffer of each thread's own.)"""
    monkeypatch.setenv("LMSERVE_CPU_TILES", "off")  # amx_kernels.ENV (which imports Numba)
    ids = list(range(100, 400))
    monkeypatch.setattr(engine_module, "FORWARD_CHUNK", 128)  # passes of 100 rows, evened out
    largest = smollm2.config.n_heads * 100 * 300 * 4  # the third pass's scores
    kept = smollm2.prefill(smollm2.new_cache(len(ids)), ids, all_logits=True)
    assert smollm2._scratch.nbytes >= largest
    monkeypatch.setattr(engine_module, "KEPT_SCRATCH", largest - 1)  # each pass's is dropped past it
    dropped = smollm2.prefill(smollm2.new_cache(len(ids)), ids, all_logits=True)
    assert smollm2._scratch.nbytes < largest
    np.testing.assert_array_equal(kept, dropped)


@pytest.mark.parametrize("shape", [(960, 576), (100, 37), (1000, 64)])
@pytest.mark.parametrize("block_bytes", [1 << 30, 4096, 10_000])  # one block; many, the last ragged
def test_linear_in_blocks_matches_one_product(shape: tuple[int, int], block_bytes: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "BLOCK_BYTES", block_bytes)
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape, dtype=np.float32)
    for n in range(1, ops.GEMV_ROWS + 3):
        x = rng.standard_normal((n, shape[1]), dtype=np.float32)
        got = ops.linear(x, w)
        assert got.shape == (n, shape[0]) and got.dtype == np.float32
        np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)
        if n <= ops.GEMV_ROWS:  # each row as the one-row product, up to rounding
            np.testing.assert_allclose(got, np.stack([w @ row for row in x]), rtol=1e-6, atol=1e-5)


def test_truncate_copy_and_save_give_fresh_prefill_logits(smollm2: CPUEngine, chat_goldens: list[dict],
                                                          tmp_path: Path) -> None:
    ids = chat_goldens[0]["prompt_ids"]
    n = 20
    fresh = smollm2.prefill(smollm2.new_cache(64), ids[:n + 1])

    full = smollm2.new_cache(64)
    smollm2.prefill(full, ids)
    copied = smollm2.new_cache(64)
    smollm2.prefill(copied, ids[-5:])  # stale content that copy_prefix must replace
    smollm2.copy_prefix(full, copied, n)
    assert copied.length == n

    smollm2.truncate(full, n)
    assert full.length == n
    path = tmp_path / "kv.bin"
    smollm2.save_cache(full, path)
    # valid positions only: the array headers of its 60 K and V arrays take less than one more
    assert path.stat().st_size < (n + 1) * smollm2.config.kv_bytes_per_token()
    loaded = smollm2.load_cache(path, 64)
    assert loaded.length == n and loaded.capacity == 64

    for cache in (full, copied, loaded):
        np.testing.assert_allclose(smollm2.prefill(cache, [ids[n]]), fresh, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError):
        smollm2.truncate(full, full.length + 1)


def test_cache_grows_in_steps_and_never_past_max_tokens(tiny_engines: dict[str, CPUEngine],
                                                        tmp_path: Path) -> None:
    engine = tiny_engines["qwen3-F32"]
    capacity = GROW_STEP + 44
    cache = engine.new_cache(capacity)
    assert cache.length == 0 and cache.capacity == capacity and cache.nbytes == 0
    per_position = engine.config.kv_bytes_per_token() + TOKEN_BYTES  # keys and values, and the token id
    engine.prefill(cache, [5] * 10)
    assert cache.nbytes == GROW_STEP * per_position
    engine.prefill(cache, [6] * (GROW_STEP - 10))
    assert cache.nbytes == GROW_STEP * per_position
    engine.decode([cache], [7])
    assert cache.nbytes == capacity * per_position  # capped, not 2 steps
    engine.prefill(cache, [8] * (capacity - cache.length))
    assert cache.length == capacity
    with pytest.raises(CacheFullError):
        engine.decode([cache], [9])
    with pytest.raises(CacheFullError):
        engine.prefill(cache, [9])
    assert cache.length == capacity
    with pytest.raises(CacheFullError):
        engine.prefill(engine.new_cache(4), [1] * 5)
    engine.save_cache(cache, tmp_path / "full.kv")
    with pytest.raises(CacheFullError):
        engine.load_cache(tmp_path / "full.kv", capacity - 1)
    with pytest.raises(ValueError):
        tiny_engines["qwen2-F32"].load_cache(tmp_path / "full.kv", capacity)  # other geometry


def test_rejects_bad_token_ids(tiny_engines: dict[str, CPUEngine]) -> None:
    engine = tiny_engines["qwen2-F32"]
    cache = engine.new_cache(8)
    for bad in ([-1], [engine.config.vocab_size]):
        with pytest.raises(ValueError):
            engine.prefill(cache, bad)
        with pytest.raises(ValueError):
            engine.decode([cache], bad)
    assert cache.length == 0


def test_protocol_figures_and_decode_argmax(tiny_engines: dict[str, CPUEngine]) -> None:
    """What the runtime, CLI and scheduler read of an engine; decode_argmax is decode's argmax,
    though the scheduler does not use it here (device_argmax is False: no device to save a copy from)."""
    engine = tiny_engines["qwen2-F32"]
    assert (engine.kv_dtype_bytes, engine.quant_summary, engine.device_argmax) == (4, "", False)
    prompts = [PROMPT[:3], PROMPT]
    host, greedy = [engine.new_cache(32) for _ in prompts], [engine.new_cache(32) for _ in prompts]
    for h, g, ids in zip(host, greedy, prompts, strict=True):
        engine.prefill(h, ids)
        engine.prefill(g, ids)
    ids = engine.decode_argmax(greedy, [5, 6])
    assert ids.dtype == np.int64 and ids.tolist() == engine.decode(host, [5, 6]).argmax(-1).tolist()
    with pytest.raises(TypeError):
        engine.decode([object()], [1])  # a cache of another engine


# -- tiny Qwen2 / Qwen3 fixtures -------------------------------------------------------------

PROMPT = [17, 200, 3, 99, 42, 150, 8, 260, 11, 5, 73]


@pytest.mark.parametrize("name", ["qwen2-F32", "qwen2-F16", "qwen3-F32", "qwen3-F16"])
def test_tiny_qwen_fixtures_load_and_batch(tiny_engines: dict[str, CPUEngine], name: str) -> None:
    engine = tiny_engines[name]
    assert engine.config.architecture == name.split("-")[0]
    logits = engine.prefill(engine.new_cache(32), PROMPT, all_logits=True)
    assert logits.shape == (len(PROMPT), engine.config.vocab_size) and np.isfinite(logits).all()
    assert logits.std(-1).min() > 0.5  # random weights, yet not degenerate

    prompts = [PROMPT[:3], PROMPT, PROMPT[4:9], PROMPT[:6]]
    caches = [engine.new_cache(32) for _ in prompts]
    for cache, prompt in zip(caches, prompts, strict=True):
        engine.prefill(cache, prompt)
    batched = engine.decode(caches, [1, 2, 3, 4])
    for i, prompt in enumerate(prompts):
        solo = engine.new_cache(32)
        engine.prefill(solo, prompt)
        np.testing.assert_allclose(batched[i], engine.decode([solo], [i + 1])[0], rtol=1e-5, atol=1e-5)


def test_prefill_in_pieces_and_chunks_equals_one_pass(tiny_engines: dict[str, CPUEngine],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engines["qwen3-F32"]
    whole = engine.prefill(engine.new_cache(32), PROMPT, all_logits=True)
    pieces = engine.new_cache(32)
    first = engine.prefill(pieces, PROMPT[:4], all_logits=True)
    rest = engine.prefill(pieces, PROMPT[4:], all_logits=True)
    np.testing.assert_allclose(np.concatenate([first, rest]), whole, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(engine_module, "FORWARD_CHUNK", 3)
    chunked = engine.new_cache(32)
    np.testing.assert_allclose(engine.prefill(chunked, PROMPT, all_logits=True), whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(engine.prefill(engine.new_cache(32), PROMPT), whole[-1], rtol=1e-5, atol=1e-5)
    assert chunked.length == len(PROMPT)


def test_f16_fixture_matches_f32(tiny_engines: dict[str, CPUEngine]) -> None:
    for arch in ("qwen2", "qwen3"):
        f32, f16 = (tiny_engines[f"{arch}-{t}"].prefill(tiny_engines[f"{arch}-{t}"].new_cache(32), PROMPT)
                    for t in ("F32", "F16"))
        np.testing.assert_allclose(f16, f32, atol=0.01)


def test_qwen3_uses_q_and_k_norms(tiny_models: dict[str, Path]) -> None:
    engine = load(tiny_models["qwen3-F32"])
    before = engine.prefill(engine.new_cache(32), PROMPT)
    attention = [layer.mixer for layer in engine.weights.layers]
    for a in attention:
        assert isinstance(a, AttentionWeights) and a.q_norm is not None and a.k_norm is not None
        a.q_norm *= 2
    after_q = engine.prefill(engine.new_cache(32), PROMPT)
    for a in attention:
        a.k_norm[::2] = 0.1
    after_k = engine.prefill(engine.new_cache(32), PROMPT)
    assert np.abs(after_q - before).max() > 0.01
    assert np.abs(after_k - after_q).max() > 0.01


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_tiny_qwen_matches_mlx_lm(tiny_models: dict[str, Path], tiny_engines: dict[str, CPUEngine],
                                  arch: str) -> None:
    """An independent implementation of both architectures: mlx-lm's, on MLX's CPU backend."""
    mx = pytest.importorskip("mlx.core")
    models = pytest.importorskip(f"mlx_lm.models.{arch}")
    import gguf
    from mlx.utils import tree_flatten

    file = GGUFFile(tiny_models[f"{arch}-F32"])
    cfg = ModelConfig.from_gguf(file)
    args = dict(model_type=arch, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers,
                intermediate_size=cfg.ffn_size, num_attention_heads=cfg.n_heads, rms_norm_eps=cfg.rms_eps,
                vocab_size=cfg.vocab_size, num_key_value_heads=cfg.n_kv_heads,
                max_position_embeddings=cfg.context_length, rope_theta=cfg.rope_theta,
                tie_word_embeddings=cfg.tied_embeddings)
    if arch == "qwen3":
        args["head_dim"] = cfg.head_dim
    model = models.Model(models.ModelArgs(**args))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.n_layers)
    model.load_weights([(hf, mx.array(file.dequantize(names.get_name(hf, try_suffixes=(".weight", ".bias")))))
                        for hf, _ in tree_flatten(model.parameters())])
    want = np.array(model(mx.array([PROMPT]))[0])

    engine = tiny_engines[f"{arch}-F32"]
    got = engine.prefill(engine.new_cache(32), PROMPT, all_logits=True)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_progress_counts_every_tensor(tiny_models: dict[str, Path]) -> None:
    calls: list[tuple[int, int]] = []
    gguf = GGUFFile(tiny_models["qwen2-F16"])
    CPUEngine(gguf, ModelConfig.from_gguf(gguf), progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, len(gguf.tensors)) for i in range(1, len(gguf.tensors) + 1)]


def test_progress_of_fused_expert_tensors_ends_at_their_count() -> None:
    """A MoE's gate and up experts load as interleaved jobs (expert by expert): each tensor counts
    once, when its last job is done, so the progress never passes 100% (it showed 600%)."""
    calls: list[tuple[int, int]] = []
    gguf = GGUFFile(Fixture("qwen3moe", "Q4_K_M").path)
    CPUEngine(gguf, ModelConfig.from_gguf(gguf), progress=lambda done, total: calls.append((done, total)))
    total = calls[-1][1]
    assert calls == [(i, total) for i in range(1, total + 1)]
