"""KV slot reuse: continuation, donor-preserving copy, disk spill/restore, and exactness.

Exactness runs in-process on the real SmolLM2 NumPy engine: every golden chat's greedy reply must
be the same token for token whether its prefix was prefilled cold, continued in a slot, copied
from a donor slot, or restored from a file written by an earlier pool (a restart).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lmserve.engine_cpu import CPUEngine
from lmserve.model.loader import load_model
from lmserve.serving.kv_disk import DiskTier
from lmserve.serving.kv_slots import SlotPool
from lmserve.serving.ram_guard import MemoryRefusal, default_context, fit_report, plan_slots

CTX = 512


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    model = load_model(smollm2_path)
    return model, CPUEngine(model.gguf, model.config)


def disk_tier(model, engine, directory: Path, max_files: int = 8) -> DiskTier:
    cfg = model.config
    return DiskTier(directory, model.gguf.header_digest(),
                    [engine.name, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim], max_files)


def greedy(engine, pool: SlotPool, prompt: list[int], n: int) -> tuple[list[int], str]:
    adoption = pool.acquire(prompt)
    logits = engine.prefill(adoption.slot.cache, prompt[adoption.reused:])
    out = []
    for _ in range(n):
        token = int(np.argmax(logits))
        out.append(token)
        logits = engine.decode([adoption.slot.cache], [token])[0]
    pool.release(adoption.slot, prompt + out)
    return out, adoption.how


def test_every_golden_reply_is_identical_warm_copied_and_restored(smollm2, chat_goldens, tmp_path):
    model, engine = smollm2
    for golden in chat_goldens:
        prompt, expected = golden["prompt_ids"], golden["greedy_ids"]
        n = len(expected)
        cut = len(prompt) * 2 // 3
        # Continue: a slot already holding the first two thirds of the prompt.
        pool = SlotPool(engine, 2, CTX)
        greedy(engine, pool, prompt[:cut], 1)
        pool.slots[0].tokens = pool.slots[0].tokens[:cut]
        engine.truncate(pool.slots[0].cache, cut)
        assert greedy(engine, pool, prompt, n) == (expected, "continue")
        # Copy: a donor holding the prefix and then another dialogue stays intact.
        donor_tokens = prompt[:cut] + [198, 504, 3575]
        pool = SlotPool(engine, 2, CTX)
        greedy(engine, pool, donor_tokens, 1)
        assert greedy(engine, pool, prompt, n) == (expected, "copy")
        assert pool.slots[0].tokens[:len(donor_tokens)] == donor_tokens
        # Disk: spilled by one pool, restored by a fresh pool over the same directory.
        directory = tmp_path / f"kv{len(prompt)}"
        pool = SlotPool(engine, 1, CTX, disk_tier(model, engine, directory))
        greedy(engine, pool, prompt[:cut], 1)
        pool.acquire([7] * 40)  # unrelated: spills the slot before resetting it
        restarted = SlotPool(engine, 1, CTX, disk_tier(model, engine, directory))
        assert greedy(engine, restarted, prompt, n) == (expected, "disk")


def test_continuation_rewind_and_copy_choices(smollm2):
    _, engine = smollm2
    pool = SlotPool(engine, 2, CTX)
    first = list(range(100, 140))
    adoption = pool.acquire(first, "s1")
    engine.prefill(adoption.slot.cache, first)
    pool.release(adoption.slot, first)
    adoption = pool.acquire(first + [200, 201], "s1")  # the slot is a prefix: continued
    assert (adoption.how, adoption.reused, adoption.slot.index) == ("continue", 40, 0)
    engine.prefill(adoption.slot.cache, [200, 201])
    pool.release(adoption.slot, first + [200, 201])
    edited = first[:30] + [7, 8, 9]  # diverges inside the slot: the same session rewinds in place
    adoption = pool.acquire(edited, "s1")
    assert (adoption.how, adoption.reused, adoption.slot.index) == ("rewind", 30, 0)
    assert adoption.slot.cache.length == 30 and adoption.slot.tokens == first[:30]
    pool.release(adoption.slot, [])
    assert pool.slots[0].tokens == [] and pool.slots[0].cache.length == 0


def test_without_reuse_every_prompt_is_prefilled_whole(smollm2):
    """--no-kv-reuse: even the same session continuing its own slot starts from an empty cache."""
    _, engine = smollm2
    pool = SlotPool(engine, 2, CTX, reuse=False)
    first = list(range(100, 140))
    adoption = pool.acquire(first, "s1")
    engine.prefill(adoption.slot.cache, first)
    pool.release(adoption.slot, first)
    adoption = pool.acquire(first + [200, 201], "s1")
    assert (adoption.how, adoption.reused, adoption.slot.cache.length) == ("reset", 0, 0)


def test_corrupt_and_truncated_files_are_skipped(smollm2, tmp_path, caplog):
    model, engine = smollm2
    tier = disk_tier(model, engine, tmp_path)
    pool = SlotPool(engine, 1, CTX, tier)
    prompt = list(range(300, 360))
    greedy(engine, pool, prompt, 1)
    pool.acquire([5] * 30)
    (path,) = tmp_path.glob("*.lmkv")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])  # truncated
    (tmp_path / "junk.lmkv").write_bytes(b"not a cache at all")
    fresh = disk_tier(model, engine, tmp_path)
    assert len(fresh) == 0
    assert "truncated" in caplog.text and "junk.lmkv" in caplog.text
    # Corrupted after indexing (payload bytes flipped): skipped at restore, served cold instead.
    path.write_bytes(data)
    tier = disk_tier(model, engine, tmp_path)
    assert len(tier) == 1
    header_end = data.index(b"\n", len(b"LMSERVE-KV 1\n")) + 1
    path.write_bytes(data[:header_end] + b"\0" * (len(data) - header_end))
    adoption = SlotPool(engine, 1, CTX, tier).acquire(prompt + [1])
    assert adoption.how == "reset" and adoption.reused == 0
    assert len(tier) == 0


def test_an_edited_token_list_links_and_a_killed_spill_are_never_trusted(smollm2, tmp_path, caplog):
    """A header whose token ids were edited (one id, same length) matches the edited prompt but
    its digest does not: it is skipped and the prompt prefilled cold, never served another
    prompt's KV. A dangling link and a FIFO named like cache files are skipped at startup (a
    FIFO's read would block forever); a working folder that a killed server left is swept."""
    import os
    import time

    from lmserve.serving.kv_disk import STALE_TEMP_S, TEMP_PREFIX

    model, engine = smollm2
    tier = disk_tier(model, engine, tmp_path)
    pool = SlotPool(engine, 1, CTX, tier)
    prompt = list(range(300, 360))
    greedy(engine, pool, prompt, 1)
    pool.acquire([5] * 30)  # spills the slot
    (path,) = tmp_path.glob("*.lmkv")
    data = path.read_bytes()
    edited = prompt.copy()
    edited[40] = 999
    path.write_bytes(data.replace(b", 340,", b", 999,", 1))
    assert b", 999," in path.read_bytes()
    (tmp_path / "gone.lmkv").symlink_to(tmp_path / "nowhere")
    os.mkfifo(tmp_path / "pipe.lmkv")
    stale = tmp_path / f"{TEMP_PREFIX}abc"
    stale.mkdir()
    (stale / "payload").write_bytes(b"half a spill")
    os.utime(stale, (time.time() - STALE_TEMP_S - 1,) * 2)
    restarted = disk_tier(model, engine, tmp_path)  # returns: no read blocked on the FIFO
    assert len(restarted) == 1 and not stale.exists()
    assert "gone.lmkv" in caplog.text and "pipe.lmkv" in caplog.text
    adoption = SlotPool(engine, 1, CTX, restarted).acquire(edited + [1])
    assert adoption.how == "reset" and adoption.reused == 0
    assert "digest does not match" in caplog.text and len(restarted) == 0


def test_ram_guard_warns_clamps_and_can_be_forced():
    gib = 1024**3
    per_token = 46_080  # SmolLM2 on the NumPy engine: 2 x 30 layers x 3 KV heads x 64 x 4 bytes
    ok = plan_slots(4, per_token, 8192, available=16 * gib)
    assert (ok.slots, ok.warning, ok.clamped) == (4, None, False)
    warn = plan_slots(4, per_token, 8192, available=2 * gib)  # 1440 MiB of 2048: above half
    assert warn.slots == 4 and "4 KV slots x 360 MiB (8192 tokens x 46080 bytes)" in warn.warning
    clamp = plan_slots(4, per_token, 8192, available=gib)  # more than all of it: 1 slot fits in half
    assert clamp.clamped and clamp.slots == 1 and "using 1 slot(s)" in clamp.warning
    assert "= 1440 MiB, with 1024 MiB of memory available" in clamp.warning
    forced = plan_slots(4, per_token, 8192, available=gib, force=True)
    assert forced.slots == 4 and not forced.clamped and "kv-slots-force" in forced.warning
    above_half = plan_slots(4, per_token, 8192, available=gib // 2)  # one 360 MiB slot, of 512
    assert above_half.slots == 1 and "which fit in memory, above half of it" in above_half.warning


def test_ram_guard_refuses_a_context_of_which_not_one_slot_fits():
    """`--ctx 99999999` once started with "1 slot, which fits in half": now refused, naming the
    largest context one slot can hold, unless forced."""
    gib = 1024**3
    per_token = 46_080
    with pytest.raises(MemoryRefusal, match=r"not even one slot of 9999999 tokens fits; at most --ctx 23301 does"):
        plan_slots(4, per_token, 9_999_999, available=gib)
    forced = plan_slots(1, per_token, 9_999_999, available=gib, force=True)
    assert forced.slots == 1 and "more than all of it (kept: --kv-slots-force)" in forced.warning


def test_fit_report_is_the_guards_arithmetic():
    gib = 1024**3
    report = fit_report(100 * 2**20, 46_080, 0, 8192, 4, available=gib)
    assert report["bytes_per_slot"] == 46_080 * 8192 and report["kv_bytes"] == 4 * 46_080 * 8192
    assert (report["fits"], report["comfortable"], report["slots_that_fit"]) == (False, False, 2)
    assert report["slots_that_fit_comfortably"] == 1 and report["largest_ctx_one_slot"] == gib // 46_080
    assert report["largest_ctx_all_slots"] == gib // 4 // 46_080


def test_default_context_fits_one_slot_in_half_the_memory():
    gib = 1024**3
    per_token = 131_072  # Llama 3.1 8B on MLX: 2 x 32 layers x 8 KV heads x 128 x 2 bytes
    assert default_context(131_072, per_token, available=64 * gib).tokens == 131_072  # 16 GiB of 32
    small = default_context(131_072, per_token, available=10 * gib)  # 5 GiB: 40,960 tokens
    assert small.tokens == 40_960 and "raise with --ctx" in small.reason
    assert default_context(131_072, per_token, available=gib // 4).tokens == 4096  # never below one step
    assert default_context(256, per_token, available=gib // 1024).tokens == 256  # nor above the trained


def test_a_hybrid_slot_is_priced_with_its_recurrent_states():
    """Qwen3.5-35B-A3B on MLX: 20,480 bytes of attention K/V a position (10 attention layers x 2 KV
    heads x 256 x 2 x 2 bytes) and about 61 MiB of recurrent state, kept 9 times (8 checkpoints
    and the current one): at 32k a slot is 640 MiB of K/V and 549 MiB of states."""
    gib, mib = 1024**3, 1024**2
    per_token, states = 20_480, 9 * 61 * mib
    budget = plan_slots(4, per_token, 32_768, available=8 * gib, state_bytes=states)
    assert budget.per_slot == 32_768 * per_token + states
    assert "4 KV slots x 1189 MiB (32768 tokens x 20480 bytes + 549 MiB recurrent states)" in budget.warning
    assert plan_slots(4, per_token, 32_768, available=4 * gib, state_bytes=states).clamped
    # The default context leaves room for the states: 2 GiB of half of 4 GiB less 549 MiB.
    assert default_context(262_144, per_token, available=4 * gib, state_bytes=states).tokens == 73_728
