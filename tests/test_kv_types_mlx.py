"""`--kv-type q8_0 / q4_0` on the MLX engine: keys and values packed quantized cost what the RAM
guard prices, and every cache operation (cutting back, copying a prefix, batching sequences,
speculation's verify pass, saving and loading) keeps them packed, on sliding-window and hybrid
layers too (how well they keep the top token: test_kv_fidelity). On Linux this is MLX's CPU
backend, slow to load even SmolLM2: tiny fixtures only."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from lmserve.engine_mlx import MLXEngine  # noqa: E402
from lmserve.engine_mlx.kv_quant import Quantized  # noqa: E402
from lmserve.model.config import ModelConfig  # noqa: E402
from lmserve.model.gguf_file import GGUFFile, ModelLoadError  # noqa: E402
from tests.families import Fixture  # noqa: E402
from tests.kv_checks import check_batch_and_verify, close, prefix_three_ways  # noqa: E402

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

MODEL = Fixture("llama3", "F16").path


@cache
def engine(path: Path, kv_type: str) -> MLXEngine:
    gguf = GGUFFile(path)
    return MLXEngine(gguf, ModelConfig.from_gguf(gguf), kv_type=kv_type)


def test_a_position_costs_what_the_guard_prices() -> None:
    """On MLX's CPU backend (float32 compute: a float32 scale and bias per 32 values) a cached
    value's 4 bytes become 1.25 in q8_0 and 0.75 in q4_0; a cache holds what the guard prices."""
    path = MODEL
    values = engine(path, "auto").config.kv_bytes_per_token(1)  # keys and values a position
    for kv_type, price in (("auto", 4 * values), ("q8_0", 1.25 * values), ("q4_0", 0.75 * values)):
        e = engine(path, kv_type)
        assert e.kv_bytes_per_token() == price
        kv = e.new_cache(512)
        e.prefill(kv, list(range(1, 257)))  # one growth step: 256 positions allocated
        assert kv.nbytes == 256 * price, kv_type


@pytest.mark.parametrize("family", ["gemma3", "qwen35"])  # sliding-window layers; a hybrid's attention layers
def test_cache_operations_keep_the_rows_packed(family: str, tmp_path: Path) -> None:
    """A cut-back cache, a copied prefix and a loaded one give a fresh prefill's logits; a batch of
    three (merged packed rows) and a verify pass give each row its solo logits; every attention
    layer stays quantized through all of it."""
    e = engine(Fixture(family, "F16").path, "q8_0")
    ids = np.random.default_rng(3).integers(0, e.config.vocab_size, 40).tolist()
    n = 24
    fresh, prefixes = prefix_three_ways(e, ids, n, tmp_path / "kv.safetensors")
    for kv in prefixes:
        close(e.prefill(kv, [ids[n]]), fresh, "q8_0")
    for kv in (*check_batch_and_verify(e, ids, "q8_0"), *prefixes):
        layers = kv.own()
        attention = [layer for i, layer in enumerate(layers) if not kv.recurrent[i]]
        assert attention and all(isinstance(layer, Quantized) for layer in attention)


def test_a_file_of_another_kv_type_is_refused(tmp_path: Path) -> None:
    """A disk-tier file records its type: another type's engine refuses it (the disk tier then
    prefills cold) rather than reading packed words as floats."""
    q8, plain = engine(MODEL, "q8_0"), engine(MODEL, "auto")
    kv = q8.new_cache(32)
    q8.prefill(kv, [1, 2, 3, 4])
    q8.save_cache(kv, tmp_path / "q8.safetensors")
    with pytest.raises(ValueError, match="not a KV cache of this model on this engine"):
        plain.load_cache(tmp_path / "q8.safetensors", 32)
    assert q8.load_cache(tmp_path / "q8.safetensors", 32).length == 4


def test_an_unquantized_type_other_than_the_compute_dtype_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="--kv-type f16: the MLX engine caches unquantized"):
        engine(MODEL, "f16")
