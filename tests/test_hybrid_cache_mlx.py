"""The MLX engine's hybrid cache on the tiny Qwen3.5 model (tests/data/fixtures/arch/qwen35: 8
layers, 6 of them Gated DeltaNet, mlx-lm's `ArraysCache`): cut back to a checkpoint, between
checkpoints, into a verify pass (alone and merged in a batch), past the greedy step
`decode_argmax` queues ahead, copied, saved and loaded, every cache is the one fed its prefix at
once (attention K/V, recurrent states, next logits). On Linux this is MLX's CPU backend.

"The one fed" is up to float32 rounding: a recomputed stretch is run in other chunks than the
first time."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_lm.models.cache import ArraysCache  # noqa: E402

from lmserve.engine_mlx import MLXEngine, MLXKVCache  # noqa: E402
from lmserve.engine_mlx import engine as engine_module  # noqa: E402
from lmserve.model.config import ModelConfig  # noqa: E402
from lmserve.model.gguf_file import GGUFFile  # noqa: E402
from tests.conftest import TINY_LLAMA  # noqa: E402
from tests.families import Fixture, references  # noqa: E402

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

TOL = {"rtol": 1e-4, "atol": 1e-4}


def open_engine(path: Path) -> MLXEngine:
    gguf = GGUFFile(path)
    return MLXEngine(gguf, ModelConfig.from_gguf(gguf))


@cache
def engine(family: str = "qwen35") -> MLXEngine:
    return open_engine(Fixture(family, "F16").path)


def ids(n: int = 64) -> list[int]:
    return references("qwen35")["token_ids"][:n]


def fed(n: int) -> MLXKVCache:
    c = engine().new_cache(64)
    engine().prefill(c, ids(n))
    return c


def checkpointed(*stops: int) -> MLXKVCache:
    """A cache fed the ids up to each stop in turn, checkpointed at every stop."""
    c = engine().new_cache(64)
    for stop in stops:
        engine().prefill(c, ids()[c.length:stop])
        engine().checkpoint(c)
    return c


def assert_fed(got: MLXKVCache, n: int) -> None:
    """`got` holds exactly the first `n` ids: as a cache fed them in one prefill, layer by layer,
    and for the next token's logits (which also checks the remembered ids)."""
    want = fed(n)
    assert got.length == n and got.hybrid is not None and got.hybrid.tokens == ids(n)
    for mine, theirs in zip(got.own(), want.own(), strict=True):
        if isinstance(mine, ArraysCache):
            for a, b in zip(mine.cache, theirs.cache, strict=True):
                np.testing.assert_allclose(np.array(a), np.array(b), **TOL)
        else:
            assert mine.offset == theirs.offset == n
            np.testing.assert_allclose(np.array(mine.keys[..., :n, :]), np.array(theirs.keys[..., :n, :]), **TOL)
            np.testing.assert_allclose(np.array(mine.values[..., :n, :]), np.array(theirs.values[..., :n, :]), **TOL)
    probe, copy = [ids()[n]], engine().new_cache(64)
    engine().copy_prefix(got, copy, n)  # the whole cache: its state shared, nothing recomputed
    np.testing.assert_allclose(engine().prefill(copy, probe), engine().prefill(want, probe), **TOL)


def counting_feeds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every token id the engine runs again from a cache's remembered ids."""
    again: list[int] = []
    real = engine_module.MLXEngine._feed

    def feed(self: MLXEngine, c: MLXKVCache, tokens: np.ndarray, last: bool) -> np.ndarray | None:
        if not last:
            again.extend(tokens.tolist())
        return real(self, c, tokens, last)

    monkeypatch.setattr(engine_module.MLXEngine, "_feed", feed)
    return again


def test_the_fixture_is_hybrid_with_tiled_value_heads() -> None:
    config = engine().config
    la = config.linear_attention
    assert config.attention_layers == [3, 7] and la is not None and la.k_heads < la.v_heads
    c = engine().new_cache(8)
    assert [isinstance(layer, ArraysCache) for layer in c.layers] == list(config.recurrent_layers)
    assert engine().state_bytes() == config.recurrent_state_bytes(4) > 0


def test_rows_leave_join_and_reorder_with_their_own_states() -> None:
    """Merged recurrent layers are filtered, extracted and merged again with the attention layers
    (rows at different positions): every row decodes as it would alone."""
    e = engine()
    starts = [3, 17, 9]
    caches = [fed(n) for n in starts]
    seqs = [ids(n) for n in starts]
    whole = e.prefill(e.new_cache(64), ids(40), all_logits=True)
    for step in range(5):
        logits = e.decode(caches, [ids()[len(s)] for s in seqs])
        np.testing.assert_allclose(logits, whole[[len(s) for s in seqs]], **TOL)
        seqs = [ids(len(s) + 1) for s in seqs]
        if step == 1:  # the middle row leaves the batch
            del caches[1], seqs[1]
        elif step == 2:  # a new one joins
            caches, seqs = [*caches, fed(30)], [*seqs, ids(30)]
        elif step == 3:  # the same rows in another order
            caches, seqs = caches[::-1], seqs[::-1]
    for c, s in zip(caches, seqs, strict=True):
        assert_fed(c, len(s))


def test_truncate_restores_the_latest_checkpoint_and_recomputes_from_it(monkeypatch: pytest.MonkeyPatch) -> None:
    e, again, c = engine(), counting_feeds(monkeypatch), checkpointed(12, 30, 41)
    assert c.hybrid.checkpoints.positions == [12, 30, 41]
    assert [e.resume_point(c, n) for n in (5, 12, 29, 40, 41)] == [0, 12, 12, 30, 41]
    e.truncate(c, 33)  # between checkpoints: back to 30, three ids run again
    assert again == ids()[30:33] and c.hybrid.checkpoints.positions == [12, 30]
    assert_fed(c, 33)
    again.clear()
    e.truncate(c, 30)  # onto a checkpoint: nothing recomputed
    assert again == []
    assert_fed(c, 30)
    e.truncate(c, 7)  # below every checkpoint: from the start
    assert again == ids(7) and c.hybrid.checkpoints.positions == []
    assert_fed(c, 7)
    with pytest.raises(ValueError):
        e.truncate(c, 8)


def test_cutting_into_a_verify_pass_recomputes_only_the_accepted_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rows merged in one pass, the shorter padded: the padding never reaches its recurrent
    state (it is masked), and the longer row cut back inside its draft restores the state from
    before the pass, taking its row out of the batch, then the rows decode on together."""
    e, again = engine(), counting_feeds(monkeypatch)
    long, short = fed(20), e.new_cache(64)
    e.checkpoint(long)
    e.prefill(short, ids()[:9])
    e.decode([long, short], [ids()[20], ids()[9]])  # merged: 21 and 10 positions
    draft = ids()[21:27]
    logits = e.verify([long, short], [draft, ids()[10:12]])
    assert [x.shape[0] for x in logits] == [6, 2] and (long.length, short.length) == (27, 12)
    whole = e.prefill(e.new_cache(64), ids(27), all_logits=True)
    np.testing.assert_allclose(logits[0], whole[21:27], **TOL)
    np.testing.assert_allclose(logits[1], whole[10:12], **TOL)
    assert e.resume_point(long, 24) == 21  # the state from before the pass, later than the checkpoint
    e.truncate(long, 24)  # three draft tokens accepted
    assert again == draft[:3] and long.batch is None
    together = e.decode([long, short], [ids()[24], ids()[12]])
    np.testing.assert_allclose(together, whole[[24, 12]], **TOL)
    assert_fed(long, 25)
    assert_fed(short, 13)


def test_the_queued_greedy_step_is_undone_when_not_taken() -> None:
    """decode_argmax queues the next step on its own picks; feeding something else (or cutting
    the cache) must leave the recurrent states as if it never ran, merged or alone."""
    e = engine()
    host = [fed(14), fed(6)]
    device = [fed(14), fed(6)]
    tokens = [ids()[14], ids()[6]]
    for step in range(4):
        expected = e.decode(host, tokens).argmax(-1)
        got = e.decode_argmax(device, tokens)
        assert got.tolist() == expected.tolist()
        tokens = [(t + 1 + step) % e.config.vocab_size for t in got.tolist()]  # never what was queued
    e.truncate(device[0], device[0].length)  # a cut to the length: only the queued step goes
    np.testing.assert_allclose(e.decode(device, tokens), e.decode(host, tokens), **TOL)
    for a, b in zip(device, host, strict=True):
        assert a.hybrid.tokens == b.hybrid.tokens
        for mine, theirs in zip(a.own(), b.own(), strict=True):
            if isinstance(mine, ArraysCache):
                np.testing.assert_allclose(np.array(mine[1]), np.array(theirs[1]), **TOL)


def test_copy_prefix_shares_the_checkpoints_below_and_leaves_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    e, again, src = engine(), counting_feeds(monkeypatch), checkpointed(10, 25, 40)
    dst = fed(5)  # stale content the copy replaces
    again.clear()
    e.copy_prefix(src, dst, 31)
    assert again == ids()[25:31] and dst.hybrid.checkpoints.positions == [10, 25]
    assert src.hybrid.checkpoints.positions == [10, 25, 40] and src.length == 40
    assert_fed(dst, 31)
    assert_fed(src, 40)
    whole = e.new_cache(64)
    again.clear()
    e.copy_prefix(src, whole, 40)  # all of it: the state itself is shared, nothing recomputed
    assert again == [] and all(a is b for a, b in zip(whole.own()[0].cache, src.own()[0].cache, strict=True))


def test_save_and_load_keep_the_state_checkpoints_and_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    e, c = engine(), checkpointed(9, 22, 35)
    e.decode([c], [ids()[35]])
    path = tmp_path / "hybrid.kv"
    e.save_cache(c, path)
    loaded = e.load_cache(path, 64)
    assert loaded.hybrid.checkpoints.positions == [9, 22, 35]
    assert_fed(loaded, 36)
    again = counting_feeds(monkeypatch)
    e.truncate(loaded, 25)  # its checkpoints are real states: back to 22
    assert again == ids()[22:25]
    assert_fed(loaded, 25)
    e.save_cache(e.new_cache(8), tmp_path / "empty")
    assert e.load_cache(tmp_path / "empty", 8).length == 0
    for other in (engine("gemma4"), open_engine(TINY_LLAMA / "tiny-llama-F32.gguf")):
        with pytest.raises(ValueError, match="not a KV cache of this model"):
            other.load_cache(path, 64)


def test_nbytes_counts_the_state_and_each_checkpoint_once() -> None:
    e = engine()
    c = fed(10)
    before = c.nbytes
    e.checkpoint(c)
    assert c.nbytes == before  # the checkpoint is the current state itself
    e.decode([c], [ids()[10]])  # new state arrays; the checkpoint keeps the old ones
    assert c.nbytes == before + e.state_bytes()
    e.checkpoints_per_cache = 2
    try:
        assert len(checkpointed(*range(4, 20, 4)).hybrid.checkpoints) == 2
    finally:
        e.checkpoints_per_cache = 8


def test_attention_only_caches_keep_no_state() -> None:
    """Gemma 4's sliding layers keep every position: any prefix is a resume point, and a
    checkpoint is nothing."""
    e = engine("gemma4")
    c = e.new_cache(64)
    e.prefill(c, references("gemma4")["token_ids"][:30])
    e.checkpoint(c)
    assert c.hybrid is None and e.resume_point(c, 7) == 7 and e.state_bytes() == 0
