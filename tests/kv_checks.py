"""What the KV-type tests of both engines share: the long context the fidelity tests read, and the
checks that cache operations keep a quantized cache's logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lmserve.model.default_model import default_model_path
from lmserve.model.loader import load_model
from tests.conftest import DATA
from tests.families import cosine

PASSAGE = DATA / "text" / "passage.md"
CONTEXT = 1000  # tokens prefilled; the top tokens at 64 positions spread over them are compared
POSITIONS = np.linspace(0, CONTEXT - 1, 64).astype(int)


def context_ids(path: Path, vocab_size: int) -> list[int]:
    """1,000 token ids: for SmolLM2 a real passage (of this repository's design doc), for the random
    fixtures a seeded draw over the vocabulary (text means nothing to them)."""
    if path == default_model_path():
        return load_model(path, None, None, embedded=True).tokenizer.encode(PASSAGE.read_text())[:CONTEXT]
    return np.random.default_rng(7).integers(0, vocab_size, CONTEXT).tolist()


def top_tokens(engine, path: Path) -> np.ndarray:
    """The top token at every position of the context, prefilled in 100-token passes."""
    ids, kv = context_ids(path, engine.config.vocab_size), engine.new_cache(CONTEXT)
    return np.concatenate([engine.prefill(kv, ids[i:i + 100], all_logits=True).argmax(-1)
                           for i in range(0, CONTEXT, 100)])


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
