"""`--kv-type` on the NumPy engine: a quantized KV cache takes the memory its type says, and every
cache operation (cutting back, copying a prefix, batching, speculation's verify pass, the disk
tier) keeps working in it (how well it keeps the top token: test_kv_fidelity)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from lmserve.engine.kv_types import KV_TYPES, check_head_sizes
from lmserve.engine_cpu import CPUEngine, kv_codec
from lmserve.engine_cpu.kv_codec import KVCodec, q8_0_blocks
from lmserve.model.config import ModelConfig
from lmserve.model.default_model import default_model_path
from lmserve.model.gguf_file import GGUFFile, ModelLoadError
from tests.kv_checks import check_batch_and_verify, close, prefix_three_ways

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`


@cache
def engine(path: Path, kv_type: str) -> CPUEngine:
    gguf = GGUFFile(path)
    return CPUEngine(gguf, ModelConfig.from_gguf(gguf), kv_type=kv_type)


def test_a_position_costs_what_its_type_says() -> None:
    """SmolLM2 (30 layers, 3 KV heads of 64): 46,080 bytes a position in float32, half in f16,
    34 bytes per 32 values in q8_0 and 18 in q4_0; the RAM guard's price is what a cache holds."""
    prices = {}
    for name in KV_TYPES:
        e = engine(default_model_path(), name)
        kv = e.new_cache(512)
        e.prefill(kv, list(range(1, 257)))  # one growth step: 256 positions allocated
        prices[name] = e.kv_bytes_per_token()
        assert kv.nbytes == 256 * (prices[name] + 4), name  # and each position's token id
    assert prices == {"f32": 46_080, "f16": 23_040, "q8_0": 12_240, "q4_0": 6_480}


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0", "f16"])
def test_cutting_copying_saving_and_batching_keep_the_type(kv_type: str, chat_goldens: list[dict],
                                                          tmp_path: Path) -> None:
    """A cache cut back, a prefix copied and a saved-and-loaded cache hold the same rows and give
    the same logits, exactly, and those of a fresh prefill of the prefix; a batched step and a
    verify pass (speculation), which read the stored rows in the compiled kernels, give each row
    its solo logits."""
    e = engine(default_model_path(), kv_type)
    ids, n = chat_goldens[0]["prompt_ids"], 20
    fresh, (full, copied, loaded) = prefix_three_ways(e, ids, n, tmp_path / "kv.npz")
    for kv in (copied, loaded):
        assert kv.k[0].dtype == (np.float16 if kv_type == "f16" else np.uint8) and kv.length == n
        assert all(np.array_equal(a[:, :n], b[:, :n]) for a, b in zip(kv.k + kv.v, full.k + full.v, strict=True))
    after = [e.prefill(kv, [ids[n]]) for kv in (full, copied, loaded)]
    assert np.array_equal(after[0], after[1]) and np.array_equal(after[0], after[2])
    close(after[0], fresh, kv_type)
    check_batch_and_verify(e, ids, kv_type)


def test_a_saved_cache_of_another_type_is_converted_never_misread(chat_goldens: list[dict], tmp_path: Path) -> None:
    """A disk-tier file records its type: a q8_0 engine reading float32 keys and values stores
    them as its own prefill would have (quantized), and a float32 engine reading q8_0 blocks gets
    their values, not their bytes taken for floats; either way the next token is the one the
    saving engine predicts."""
    f32, q8 = engine(default_model_path(), "f32"), engine(default_model_path(), "q8_0")
    ids = chat_goldens[0]["prompt_ids"][:24]
    for source, target in ((f32, q8), (q8, f32)):
        kv = source.new_cache(64)
        source.prefill(kv, ids[:-1])
        path = tmp_path / f"{source.kv_type}.npz"
        source.save_cache(kv, path)
        loaded = target.load_cache(path, 64)
        for got, saved in zip(loaded.k + loaded.v, kv.k + kv.v, strict=True):
            want = target.new_cache(1).codec.encode(source.new_cache(1).codec.values(saved[:, :kv.length]))
            assert got.dtype == want.dtype and np.array_equal(got[:, :kv.length], want)
        close(target.prefill(loaded, ids[-1:]), source.prefill(kv, ids[-1:]))


def test_a_block_type_needs_whole_blocks_per_head() -> None:
    check_head_sizes(KV_TYPES["q8_0"], [64, 128, 256])
    with pytest.raises(ModelLoadError, match="--kv-type q4_0 .* 80: choose f16 or f32"):
        check_head_sizes(KV_TYPES["q4_0"], [64, 80])


def blocks_of_every_scale() -> np.ndarray:
    """600 blocks of 32 values from 1e-6 to 1e4, a block of zeros, and one whose q8_0 scale is 1,
    so that every other value is half way between two levels."""
    rng = np.random.default_rng(5)
    blocks = rng.standard_normal((600, 32)).astype(np.float32) * np.logspace(-6, 4, 600, dtype=np.float32)[:, None]
    blocks[7] = 0
    blocks[8] = np.arange(-15.5, 16.5, dtype=np.float32)
    blocks[8, 0] = -127  # q8_0's d = 1
    return blocks


def test_q8_0_blocks_are_the_bytes_of_gguf_s_quantizer() -> None:
    """The compiled q8_0 writer (`kv_encode_kernel`, beside every decode step) gives the bytes of
    `gguf`'s quantizer, ggml's reference, halves rounded away from zero."""
    blocks = blocks_of_every_scale()
    codec = KVCodec(KV_TYPES["q8_0"])
    heads = blocks.reshape(3, 100, 64)
    assert np.array_equal(codec.encode(heads), quantize(codec.turn(heads), GGMLQuantizationType.Q8_0))
    if q8_0_blocks is not None:
        out = np.empty((600, 34), np.uint8)
        q8_0_blocks(blocks, out)
        assert np.array_equal(out, quantize(blocks, GGMLQuantizationType.Q8_0))


@pytest.mark.skipif(kv_codec.q4_0_blocks is None, reason="numba is not installed (macOS: MLX serves)")
def test_compiled_q4_0_blocks_and_turn_are_the_numpy_ones() -> None:
    """The compiled q4_0 writer picks each block's scale as `kv_codec`'s NumPy search does, to
    the byte (its error sums in NumPy's order); the compiled turn (a decode step's, in
    `block_attention_kernel`) is the Hadamard matrix product to float32 rounding, and its own
    inverse."""
    from lmserve.engine_cpu.kv_encode_kernel import turn_blocks

    blocks = blocks_of_every_scale()
    out = np.empty((600, 18), np.uint8)
    kv_codec.q4_0_blocks(blocks, out, kv_codec.Q4_FACTORS)
    assert np.array_equal(out, kv_codec._q4_0(blocks))
    turned = blocks.copy()
    turn_blocks(turned)
    peak = np.abs(blocks).max(-1, keepdims=True)
    assert (np.abs(turned - blocks @ kv_codec._TURN) <= 1e-6 * peak).all()
    turn_blocks(turned)
    assert (np.abs(turned - blocks) <= 1e-6 * peak).all()
