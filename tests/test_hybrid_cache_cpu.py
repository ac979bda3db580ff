"""The NumPy engine's hybrid cache on the tiny Qwen3.5 model (tests/data/fixtures/arch/qwen35: 8
layers, 2 of them attention): its recurrent states, checkpoints and remembered token ids make
truncate, copy_prefix and save/load give exactly the cache that was fed the prefix, and a verify
pass can be cut back into and pads nothing into a state (batched decode: test_families_cpu.py).

"Exactly" is up to float32 rounding: a recomputed stretch is chunked differently from the first
time it was fed."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest

from lmserve.engine_cpu import CPUCache, CPUEngine
from lmserve.engine_cpu import delta_net as delta_net_module
from lmserve.engine_cpu import engine as engine_module
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile
from tests.families import Fixture, references

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

TOL = {"rtol": 1e-4, "atol": 1e-4}


@cache
def engine(family: str = "qwen35") -> CPUEngine:
    gguf = GGUFFile(Fixture(family, "F16").path)
    return CPUEngine(gguf, ModelConfig.from_gguf(gguf))


def ids(n: int = 64) -> list[int]:
    return references("qwen35")["token_ids"][:n]


def fed(n: int, max_tokens: int = 64) -> CPUCache:
    """A fresh cache fed the first `n` token ids in one prefill."""
    e = engine()
    c = e.new_cache(max_tokens)
    e.prefill(c, ids(n))
    return c


def checkpointed(*stops: int) -> CPUCache:
    """A cache fed the token ids up to each of `stops` in turn, checkpointed at each."""
    e = engine()
    c = e.new_cache(64)
    for stop in stops:
        e.prefill(c, ids()[c.length:stop])
        e.checkpoint(c)
    return c


def assert_same_cache(got: CPUCache, want: CPUCache) -> None:
    """Same length, tokens, keys and values of every attention layer, and recurrent states; and
    the same logits for the next token."""
    e = engine()
    n = want.length
    assert got.length == n
    np.testing.assert_array_equal(got.tokens[:n], want.tokens[:n])
    for li in got.layout.attention:
        np.testing.assert_allclose(got.k[li][:, :n], want.k[li][:, :n], **TOL)
        np.testing.assert_allclose(got.v[li][:, :n], want.v[li][:, :n], **TOL)
    assert set(got.state) == set(want.state) == set(got.layout.recurrent)
    for li in got.layout.recurrent:
        for a, b in zip(got.state[li], want.state[li], strict=True):
            np.testing.assert_allclose(a, b, **TOL)
    probe = [ids()[n]]
    np.testing.assert_allclose(e.prefill(got, probe), e.prefill(want, probe), **TOL)


def test_the_fixture_is_hybrid() -> None:
    cfg = engine().config
    assert cfg.is_hybrid and cfg.attention_layers == [3, 7] and cfg.linear_attention is not None
    la = cfg.linear_attention
    assert la.k_heads < la.v_heads  # the tiled value heads are exercised
    c = engine().new_cache(8)
    assert c.layout.recurrent == [0, 1, 2, 4, 5, 6] and c.nbytes == 0
    assert engine().state_bytes() == cfg.recurrent_state_bytes(4) > 0


@pytest.mark.parametrize(("prefill_chunk", "rule_chunk"), [(256, 64), (10, 64), (256, 16)])
def test_chunked_prefill_equals_step_decode(prefill_chunk: int, rule_chunk: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill runs the chunked rule (in passes of `prefill_chunk` tokens, solved `rule_chunk` at
    a time), decode the step form one token at a time: the same logits at every position."""
    e = engine()
    stepped = e.new_cache(64)
    logits = [e.prefill(stepped, ids(1))]
    logits += [e.decode([stepped], [token])[0] for token in ids()[1:]]
    monkeypatch.setattr(engine_module, "FORWARD_CHUNK", prefill_chunk)
    monkeypatch.setattr(delta_net_module, "CHUNK", rule_chunk)
    whole = e.new_cache(64)
    np.testing.assert_allclose(e.prefill(whole, ids(), all_logits=True), np.stack(logits), **TOL)
    assert whole.length == stepped.length == 64


def test_truncate_restores_the_latest_checkpoint_and_recomputes_from_it() -> None:
    e = engine()
    c = checkpointed(16, 32, 40)
    assert c.checkpoints.positions == [16, 32, 40]
    assert [e.resume_point(c, n) for n in (10, 16, 20, 39, 40)] == [0, 16, 16, 32, 40]
    kept = {li: tuple(a.copy() for a in pair) for li, pair in c.checkpoints.latest(16)[1].items()}
    e.truncate(c, 20)  # between checkpoints: back to 16, then 4 tokens fed again
    assert c.checkpoints.positions == [16]
    assert_same_cache(c, fed(20))
    for li, pair in c.checkpoints.latest(16)[1].items():  # the forward pass made new arrays
        for a, b in zip(pair, kept[li], strict=True):
            np.testing.assert_array_equal(a, b)
    e.truncate(c, 16)  # onto a checkpoint
    assert_same_cache(c, fed(16))
    e.truncate(c, 9)  # below every checkpoint: from the start
    assert c.checkpoints.positions == [] and e.resume_point(c, 9) == 9
    assert_same_cache(c, fed(9))
    with pytest.raises(ValueError):
        e.truncate(c, c.length + 1)


def test_truncating_into_a_verify_pass_recomputes_only_the_kept_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler cuts a rejected draft away: the state from before the pass is kept, so only
    the accepted tokens are fed again. The shorter list is padded inside the pass: nothing of
    the padding reaches its state."""
    e = engine()
    long, short = checkpointed(30), e.new_cache(64)
    e.decode([long], [ids()[30]])  # 31 positions, the latest checkpoint at 30
    e.prefill(short, ids()[40:45])
    draft = ids()[31:37]
    logits = e.verify([long, short], [draft, ids()[45:47]])
    assert [len(x) for x in logits] == [6, 2] and (long.length, short.length) == (37, 7)
    assert e.resume_point(long, 34) == 31  # the state from before the pass, not the checkpoint
    fresh = e.new_cache(64)
    np.testing.assert_allclose(e.prefill(fresh, ids(37), all_logits=True)[31:], logits[0], **TOL)
    alone = e.new_cache(64)
    e.prefill(alone, ids()[40:45])
    np.testing.assert_allclose(e.prefill(alone, ids()[45:47], all_logits=True), logits[1], **TOL)
    assert_same_cache(short, alone)

    fed_again: list[int] = []
    real = engine_module.CPUEngine._feed
    monkeypatch.setattr(engine_module.CPUEngine, "_feed",
                        lambda self, c, tokens: fed_again.extend(tokens.tolist()) or real(self, c, tokens))
    e.truncate(long, 34)  # three draft tokens accepted
    assert fed_again == draft[:3]
    assert_same_cache(long, fed(34))


def test_copy_prefix_gives_the_prefix_and_leaves_the_source() -> None:
    e = engine()
    src = checkpointed(12, 24, 48)
    before = e.prefill(fed(48), [ids()[48]])
    dst = e.new_cache(64)
    e.prefill(dst, ids()[50:60])  # stale content the copy replaces
    e.copy_prefix(src, dst, 30)
    assert dst.checkpoints.positions == [12, 24] and src.checkpoints.positions == [12, 24, 48]
    assert_same_cache(dst, fed(30))
    np.testing.assert_allclose(e.prefill(src, [ids()[48]]), before, **TOL)  # the source is intact
    whole = e.new_cache(64)
    e.copy_prefix(src, whole, src.length)  # all of it: the state itself, nothing recomputed
    assert all(whole.state[li] is src.state[li] for li in src.layout.recurrent)
    e.copy_prefix(whole, whole, 5)  # onto itself: a truncate
    assert_same_cache(whole, fed(5))


def test_save_and_load_keep_the_state_checkpoints_and_tokens(tmp_path: Path) -> None:
    e = engine()
    c = checkpointed(8, 20, 33)
    e.decode([c], [ids()[33]])
    path = tmp_path / "hybrid.kv"
    e.save_cache(c, path)
    loaded = e.load_cache(path, 64)
    assert loaded.length == c.length == 34 and loaded.capacity == 64
    assert loaded.checkpoints.positions == c.checkpoints.positions == [8, 20, 33]
    assert_same_cache(loaded, c)
    e.truncate(loaded, 25)  # its checkpoints work: back to 20, five tokens fed again
    assert_same_cache(loaded, fed(25))
    e.save_cache(e.new_cache(8), tmp_path / "empty.kv")
    empty = e.load_cache(tmp_path / "empty.kv", 8)
    assert empty.length == 0
    np.testing.assert_allclose(e.prefill(empty, ids(5)), e.prefill(e.new_cache(8), ids(5)), **TOL)

    with pytest.raises(ValueError, match="layout"):
        engine("qwen35moe").load_cache(path, 64)  # another model's geometry
    other = tmp_path / "other.npz"
    np.savez(other, format=np.array("lmserve-cpu-kv-1"))
    with pytest.raises(ValueError, match="format"):
        e.load_cache(other, 64)


def test_nbytes_counts_the_state_and_each_checkpoint_once() -> None:
    e = engine()
    c = e.new_cache(64)
    e.prefill(c, ids(10))
    kv = c.nbytes - e.state_bytes()  # keys, values and tokens for one grow step
    e.checkpoint(c)
    assert c.nbytes == kv + e.state_bytes()  # the checkpoint is the current state itself
    e.decode([c], [ids()[10]])
    e.checkpoint(c)
    assert c.nbytes == kv + 2 * e.state_bytes()  # the current state, and the older checkpoint


def test_attention_only_caches_keep_no_state() -> None:
    """Gemma 4 has per-layer geometries but no recurrent layers: checkpoints cost nothing and
    every prefix is a resume point."""
    e = engine("gemma4")
    c = e.new_cache(64)
    e.prefill(c, references("gemma4")["token_ids"][:20])
    e.checkpoint(c)
    assert len(c.checkpoints) == 0 and e.resume_point(c, 7) == 7 and e.state_bytes() == 0
    shapes = [c.k[li].shape for li in range(e.config.n_layers)]
    assert shapes == [(e.config.kv_heads(i), c.allocated, e.config.head_size(i)) for i in range(e.config.n_layers)]
    assert len(set(shapes)) > 1
