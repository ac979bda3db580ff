"""The MLX engine: parity with the NumPy engine on every fixture, SmolLM2's goldens, weight
conversion and its disk cache, KV cache round trips, batching, and engine selection.

On Linux this runs on MLX's CPU backend, which is slow: models are tiny except SmolLM2, whose
golden prompts share their prefixes through `copy_prefix`.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants

mx = pytest.importorskip("mlx.core")

from lmserve.engine.select import load_engine, mlx_gpu_available, select_engine  # noqa: E402
from lmserve.engine_cpu import CacheFullError, CPUEngine  # noqa: E402
from lmserve.engine_mlx import MLXEngine  # noqa: E402
from lmserve.engine_mlx import engine as mlx_engine_module  # noqa: E402
from lmserve.engine_mlx.model import build_model, gguf_names  # noqa: E402
from lmserve.engine_mlx.weights import convert, load_native  # noqa: E402
from lmserve.model.config import ModelConfig  # noqa: E402
from lmserve.model.gguf_file import GGUFFile  # noqa: E402
from tests.conftest import TINY_LLAMA  # noqa: E402
from tests.fixture_models import write_all  # noqa: E402

FLOAT_LLAMA = ["F32", "F16"]
QUANT_LLAMA = ["Q8_0", "Q4_0", "IQ4_NL", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K"]
REFERENCE_IDS = json.loads((TINY_LLAMA / "reference_f32_logits.json").read_text())["token_ids"]
POSITIONS = 128  # a random model has many near-tied top-1s: enough positions to measure a rate
GREEDY_STEPS = 8


def llama(kind: str) -> Path:
    return TINY_LLAMA / f"tiny-llama-{kind}.gguf"


def open_model(path: Path) -> tuple[GGUFFile, ModelConfig]:
    gguf = GGUFFile(path)
    return gguf, ModelConfig.from_gguf(gguf)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlx-weights")


@pytest.fixture(scope="module")
def qwen_fixtures(tmp_path_factory) -> dict[str, Path]:
    return write_all(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def tiny(cache_dir) -> MLXEngine:
    """The F32 tiny llama: exact enough that round trips compare at float32 precision."""
    return MLXEngine(*open_model(llama("F32")), cache_dir=cache_dir)


def assert_parity(path: Path, quantized: bool, cache_dir: Path) -> None:
    gguf, config = open_model(path)
    mlx_engine, cpu_engine = MLXEngine(gguf, config, cache_dir=cache_dir), CPUEngine(gguf, config)
    ids = [(REFERENCE_IDS + [(i * 37 + 11) for i in range(POSITIONS)])[i] % config.vocab_size
           for i in range(POSITIONS)]
    ours = mlx_engine.prefill(mlx_engine.new_cache(POSITIONS + GREEDY_STEPS), ids, all_logits=True)
    theirs = cpu_engine.prefill(cpu_engine.new_cache(POSITIONS), ids, all_logits=True)
    assert ours.shape == theirs.shape == (POSITIONS, config.vocab_size)
    assert ours.dtype == np.float32
    assert cosine(ours[-1], theirs[-1]) >= (0.99 if quantized else 0.999)
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.9
    if quantized:
        return
    greedy = []
    for engine in (mlx_engine, cpu_engine):
        cache = engine.new_cache(len(ids) + GREEDY_STEPS)
        token, out = int(engine.prefill(cache, ids[:16]).argmax()), []
        for _ in range(GREEDY_STEPS):
            out.append(token)
            token = int(engine.decode([cache], [token])[0].argmax())
        greedy.append(out)
    assert greedy[0] == greedy[1]


@pytest.mark.parametrize("kind", FLOAT_LLAMA + QUANT_LLAMA)
def test_parity_tiny_llama(kind, cache_dir):
    assert_parity(llama(kind), kind not in FLOAT_LLAMA, cache_dir)


@pytest.mark.parametrize("key", ["qwen2-F32", "qwen2-F16", "qwen3-F32", "qwen3-F16"])
def test_parity_tiny_qwen(key, qwen_fixtures, cache_dir):
    assert_parity(qwen_fixtures[key], False, cache_dir)


def test_smollm2_goldens_top1(smollm2_path, chat_goldens):
    """Top-1 at each golden chat's last prompt position; shared prompt prefixes are copied."""
    engine = MLXEngine(*open_model(smollm2_path))
    assert engine.weights_from.endswith("(native)")  # Q4_1 loads through mx.load, no conversion
    done: list[tuple[list[int], object]] = []
    for golden in chat_goldens:
        ids = golden["prompt_ids"]
        cache = engine.new_cache(len(ids))
        shared, src = max(((_common(ids, seen), c) for seen, c in done), default=(0, None), key=lambda x: x[0])
        shared = min(shared, len(ids) - 1)
        if src is not None and shared:
            engine.copy_prefix(src, cache, shared)
        logits = engine.prefill(cache, ids[shared:])
        last = golden["last_positions"][-1]
        assert last["position"] == len(ids) - 1
        assert int(logits.argmax()) == last["top_ids"][0]
        done.append((ids, cache))


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# -- weight conversion ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_repacked_blocks_equal_mx_load(kind):
    """The converter's Q8_0/Q4_0 repacking is bit for bit what MLX's own GGUF loader makes."""
    gguf, config = open_model(llama(kind))
    names = {k: v for k, v in gguf_names(build_model(config), config, gguf.tensors).items()
             if gguf.tensors[v].qtype.name == kind}
    ours, _ = convert(gguf, names, mx.float16)
    native, _ = load_native(gguf, names, mx.float16)
    assert ours.keys() == native.keys()
    for name in ours:
        assert mx.array_equal(ours[name], native[name]).item(), name


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q5_K_M"])
def test_k_quants_convert_exactly(kind):
    """Q4_K and Q5_K become 4- and 5-bit MLX weights holding the very same values."""
    gguf, config = open_model(llama(kind))
    names = gguf_names(build_model(config), config, gguf.tensors)
    arrays, choices = convert(gguf, names, mx.float32)
    exact = [n for n, c in choices.items() if c.how == "exact"]
    assert exact and all(choices[n].bits in (4, 5) for n in exact)
    for name in exact:
        base, bits = name.rsplit(".", 1)[0], choices[name].bits
        back = mx.dequantize(arrays[name], arrays[base + ".scales"], arrays[base + ".biases"],
                             group_size=32, bits=bits)
        source = gguf.dequantize(names[name])
        assert np.abs(np.array(back) - source).max() <= 1e-6 * np.abs(source).max()


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_block_types_convert_exactly(kind, tmp_path):
    """The 32-weight block types the fixtures lack, through a one-tensor GGUF."""
    qtype = GGMLQuantizationType[kind]
    values = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    writer = GGUFWriter(tmp_path / "one.gguf", "llama")
    writer.add_tensor("w.weight", gguf_quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gguf = GGUFFile(tmp_path / "one.gguf")
    arrays, choices = convert(gguf, {"w.weight": "w.weight"}, mx.float32)
    bits = choices["w.weight"].bits
    assert (bits, choices["w.weight"].how) == (int(kind[1]), "exact")
    back = mx.dequantize(arrays["w.weight"], arrays["w.scales"], arrays["w.biases"], group_size=32, bits=bits)
    source = gguf.dequantize("w.weight")
    assert np.abs(np.array(back) - source).max() <= 1e-6 * np.abs(source).max()


def test_disk_cache_cold_then_warm(tmp_path):
    model = tmp_path / "model.gguf"
    shutil.copy(llama("Q4_K_M"), model)
    weights = tmp_path / "cache"
    calls: list[tuple[int, int]] = []
    cold = MLXEngine(*open_model(model), progress=lambda done, total: calls.append((done, total)),
                     cache_dir=weights)
    assert "converted" in cold.weights_from
    assert calls and calls[-1][0] == calls[-1][1]
    assert "4-bit g32 (exact)" in cold.quant_summary and "Q6_K -> 8-bit" in cold.quant_summary
    entries = list((weights / "mlx").iterdir())
    assert len(entries) == 1  # one folder: the part outside the layers, then one file per layer
    assert sorted(p.name for p in entries[0].iterdir()) == [
        "base.safetensors", *(f"layer-{i}.safetensors" for i in range(cold.config.n_layers))]
    warm = MLXEngine(*open_model(model), cache_dir=weights)
    assert warm.weights_from.startswith("cache")
    assert warm.quant_summary == cold.quant_summary
    ids = REFERENCE_IDS
    assert np.array_equal(warm.prefill(warm.new_cache(16), ids), cold.prefill(cold.new_cache(16), ids))
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file changed: convert again
    again = MLXEngine(*open_model(model), cache_dir=weights)
    assert "converted" in again.weights_from
    assert [p.name for p in (weights / "mlx").iterdir()] != [e.name for e in entries]
    assert len(list((weights / "mlx").iterdir())) == 1  # the stale folder went


# -- KV caches ------------------------------------------------------------------------------

PROMPT = [1, 70, 71, 72, 100, 200, 300, 400, 500, 3, 4, 5, 6, 250, 251, 252, 17, 18, 19, 20]
TAIL = [33, 44, 55]


def fresh(engine: MLXEngine, ids: list[int]) -> np.ndarray:
    return engine.prefill(engine.new_cache(64), ids)


def test_chunked_prefill(tiny, monkeypatch):
    whole = tiny.prefill(tiny.new_cache(64), PROMPT, all_logits=True)
    monkeypatch.setattr(mlx_engine_module, "FORWARD_CHUNK", 7)
    np.testing.assert_allclose(tiny.prefill(tiny.new_cache(64), PROMPT, all_logits=True), whole, atol=1e-4)
    np.testing.assert_allclose(tiny.prefill(tiny.new_cache(64), PROMPT), whole[-1], atol=1e-4)


def test_truncate_round_trip(tiny):
    cache = tiny.new_cache(64)
    tiny.prefill(cache, PROMPT)
    tiny.truncate(cache, 12)
    assert cache.length == 12
    np.testing.assert_allclose(tiny.prefill(cache, TAIL), fresh(tiny, PROMPT[:12] + TAIL), atol=1e-4)


def test_copy_prefix_round_trip(tiny):
    src, dst = tiny.new_cache(64), tiny.new_cache(64)
    tiny.prefill(src, PROMPT)
    tiny.copy_prefix(src, dst, 12)
    assert (src.length, dst.length) == (len(PROMPT), 12)
    np.testing.assert_allclose(tiny.prefill(dst, TAIL), fresh(tiny, PROMPT[:12] + TAIL), atol=1e-4)
    np.testing.assert_allclose(tiny.decode([src], [TAIL[0]])[0], fresh(tiny, PROMPT + TAIL[:1]), atol=1e-4)


def test_save_load_round_trip(tiny, tmp_path):
    cache = tiny.new_cache(64)
    tiny.prefill(cache, PROMPT)
    path = tmp_path / "slot.kv"  # saved exactly here, whatever the suffix
    tiny.save_cache(cache, path)
    assert path.is_file()
    loaded = tiny.load_cache(path, 64)
    assert (loaded.length, loaded.capacity) == (len(PROMPT), 64)
    np.testing.assert_allclose(tiny.prefill(loaded, TAIL), fresh(tiny, PROMPT + TAIL), atol=1e-4)
    with pytest.raises(ValueError):
        tiny.load_cache(path, 8)


def test_saved_cache_is_an_mlx_lm_prompt_cache(tiny, tmp_path):
    """The file is mlx-lm's own format (its loader reads it back) with our geometry in its metadata;
    an empty cache round-trips too."""
    from mlx_lm.models.cache import load_prompt_cache

    cache = tiny.new_cache(64)
    tiny.prefill(cache, PROMPT)
    tiny.save_cache(cache, tmp_path / "slot.safetensors")
    layers, metadata = load_prompt_cache(str(tmp_path / "slot.safetensors"), return_metadata=True)
    assert len(layers) == tiny.config.n_layers and {layer.offset for layer in layers} == {len(PROMPT)}
    assert layers[0].keys.shape[2] == len(PROMPT)  # the valid positions only, no preallocated slack
    assert metadata["length"] == str(len(PROMPT)) and metadata["geometry"].startswith(f"{tiny.config.n_layers}x")
    tiny.save_cache(tiny.new_cache(8), tmp_path / "empty")
    empty = tiny.load_cache(tmp_path / "empty", 8)
    assert empty.length == 0
    np.testing.assert_allclose(tiny.prefill(empty, PROMPT[:8]), fresh(tiny, PROMPT[:8]), atol=1e-4)


def test_load_cache_refuses_other_models_and_engines(tiny, qwen_fixtures, cache_dir, tmp_path):
    cpu = CPUEngine(*open_model(llama("F32")))
    cpu_cache = cpu.new_cache(64)
    cpu.prefill(cpu_cache, PROMPT)
    cpu.save_cache(cpu_cache, tmp_path / "cpu.kv")
    (tmp_path / "junk.kv").write_bytes(b"not a cache at all")
    plain = tmp_path / "plain.safetensors"
    mx.save_safetensors(str(plain), {"0.keys": mx.zeros((1, 1, 1, 1))}, {"format": "lmserve-mlx-kv-1"})
    for path in (tmp_path / "cpu.kv", tmp_path / "junk.kv", plain):
        with pytest.raises(ValueError, match="not a KV cache of this model"):
            tiny.load_cache(path, 64)
    cache = tiny.new_cache(64)
    tiny.prefill(cache, PROMPT)
    tiny.save_cache(cache, tmp_path / "mlx.kv")
    with pytest.raises(ValueError):
        cpu.load_cache(tmp_path / "mlx.kv", 64)
    other = MLXEngine(*open_model(qwen_fixtures["qwen3-F32"]), cache_dir=cache_dir)
    assert (other.config.n_layers, other.config.n_kv_heads, other.config.head_dim) != (
        tiny.config.n_layers, tiny.config.n_kv_heads, tiny.config.head_dim)
    with pytest.raises(ValueError, match="not a KV cache of this model"):
        other.load_cache(tmp_path / "mlx.kv", 64)
    with pytest.raises(FileNotFoundError):
        tiny.load_cache(tmp_path / "missing.kv", 64)


def test_disk_tier_spills_and_restores_an_mlx_cache(tiny, tmp_path):
    """serving/kv_disk.py wraps the engine's file in its own header and hands the engine a
    suffix-less payload path both ways."""
    from lmserve.serving.kv_disk import DiskTier

    cfg = tiny.config
    tier = DiskTier(tmp_path, "fingerprint", [tiny.name, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim])
    cache = tiny.new_cache(64)
    tiny.prefill(cache, PROMPT)
    tier.spill(cache, PROMPT, tiny)
    restarted = DiskTier(tmp_path, "fingerprint", tier.geometry)
    entry = restarted.best_match(PROMPT + TAIL)
    assert entry is not None and entry.shared == len(PROMPT)
    restored = restarted.load(entry, tiny, 64)
    assert restored is not None and restored.length == len(PROMPT)
    np.testing.assert_allclose(tiny.prefill(restored, TAIL), fresh(tiny, PROMPT + TAIL), atol=1e-4)


def test_cache_capacity(tiny):
    cache = tiny.new_cache(4)
    with pytest.raises(CacheFullError):
        tiny.prefill(cache, PROMPT[:5])
    tiny.prefill(cache, PROMPT[:4])
    assert cache.nbytes > 0
    with pytest.raises(CacheFullError):
        tiny.decode([cache], [1])


def test_batched_decode_matches_single_sequences(tiny):
    """Rows of different lengths decode together; members leave, join, reorder and get
    truncated between steps; every row always equals a fresh prefill of its sequence."""
    caches = [tiny.new_cache(64) for _ in range(3)]
    seqs = [ids + [int(tiny.prefill(c, ids).argmax())] for c, ids in zip(caches, [PROMPT[:5], PROMPT[:2], PROMPT], strict=True)]
    for step in range(5):
        logits = tiny.decode(caches, [s[-1] for s in seqs])
        for row, ids in zip(logits, seqs, strict=True):
            np.testing.assert_allclose(row, fresh(tiny, ids), atol=1e-4)
        seqs = [s + [int(t)] for s, t in zip(seqs, logits.argmax(-1), strict=True)]
        if step == 1:  # the middle sequence leaves
            del caches[1], seqs[1]
        elif step == 2:  # a new one joins, the order changes
            new = tiny.new_cache(64)
            joined = [1, 100, 200]
            caches, seqs = [caches[1], new, caches[0]], [seqs[1], joined + [int(tiny.prefill(new, joined).argmax())],
                                                         seqs[0]]
        elif step == 3:  # a member is truncated while merged
            tiny.truncate(caches[0], len(seqs[0]) - 3)
            seqs[0] = seqs[0][:-2]
    assert [c.length for c in caches] == [len(s) - 1 for s in seqs]


def test_decode_argmax_equals_host_argmax(cache_dir):
    """Also when the caller does not continue with the returned ids (a stop, an override), so
    the step the engine queued ahead on them must be undone."""
    engine = MLXEngine(*open_model(llama("Q4_K_M")), cache_dir=cache_dir)
    prompts = [PROMPT[:3], PROMPT, PROMPT[5:12]]
    host = [engine.new_cache(64) for _ in prompts]
    device = [engine.new_cache(64) for _ in prompts]
    tokens = []
    for h, d, ids in zip(host, device, prompts, strict=True):
        tokens.append(int(engine.prefill(h, ids).argmax()))
        engine.copy_prefix(h, d, h.length)
    for step in range(6):
        expected = engine.decode(host, tokens).argmax(-1)
        got = engine.decode_argmax(device, tokens)
        assert got.dtype.kind == "i" and got.tolist() == expected.tolist()
        assert [c.length for c in device] == [c.length for c in host]
        tokens = got.tolist()
        if step == 2:
            tokens[1] = (tokens[1] + 1) % engine.config.vocab_size
        elif step == 4:  # one sequence ends; the other two go on alone
            del host[0], device[0], tokens[0]
    np.testing.assert_allclose(engine.decode(device[:1], tokens[:1]), engine.decode(host[:1], tokens[:1]), atol=1e-4)


def test_engine_runs_on_another_thread(tiny):
    """The scheduler builds the engine on the main thread and drives it from its worker."""
    out = {}
    worker = threading.Thread(target=lambda: out.update(logits=fresh(tiny, PROMPT)))
    worker.start()
    worker.join()
    np.testing.assert_array_equal(out["logits"], fresh(tiny, PROMPT))


# -- engine selection -----------------------------------------------------------------------


def test_select_engine():
    assert select_engine("cpu") == "cpu"
    assert select_engine("mlx") == "mlx"
    assert select_engine("auto") == ("mlx" if mlx_gpu_available() else "cpu")
    with pytest.raises(ValueError):
        select_engine("gpu")


def test_load_engine_builds_the_named_engine():
    gguf, config = open_model(llama("F16"))
    mlx_engine = load_engine("mlx", gguf, config)
    assert isinstance(mlx_engine, MLXEngine) and mlx_engine.name == "mlx"
    assert mlx_engine.device in ("cpu (MLX CPU backend)", "gpu (Metal)", "gpu (CUDA)")
    assert mlx_engine.weight_bytes > 0 and mlx_engine.config is config
    assert mlx_engine.kv_dtype_bytes == mlx_engine.dtype.size
    assert isinstance(load_engine("cpu", gguf, config), CPUEngine)


def test_http_mlx_engine_greedy_tokens_equal_the_numpy_engine(smollm2_server):
    """`--engine mlx` (MLX's CPU backend here) serves the same first 8 greedy tokens as NumPy."""
    import httpx

    from tests.server_util import start_server

    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
            "max_tokens": 8, "logprobs": True}

    def tokens(server) -> list[str]:
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
        return [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]]

    with start_server("--engine", "mlx", "--ctx", "512") as mlx_server:
        assert "mlx" in httpx.get(mlx_server.base_url + "/health").json()["engine"]
        assert tokens(mlx_server) == tokens(smollm2_server)
