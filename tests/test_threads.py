"""The NumPy engine's thread tuner (engine_cpu/threads.py) on a scripted machine: one core taken
by another process makes two-thread passes wait a time slice each; the tuner must find one thread
within a few passes, go back to two when the core is free again, and pay for few trials meanwhile."""

from __future__ import annotations

import pytest

from lmserve.engine_cpu.threads import FIRST_TRIAL, LAST_TRIAL, ThreadTuner

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

IDLE = {1: 0.026, 2: 0.017}  # seconds a SmolLM2 decode pass took, measured on this 2-core machine
BUSY = {1: 0.026, 2: 0.35}  # with `yes > /dev/null` on one core


def run(tuner: ThreadTuner, machine: dict[int, float], passes: int, rows: int = 1) -> list[int]:
    counts = []
    for _ in range(passes):
        count = tuner.choose(rows)
        tuner.record(rows, count, machine[count])
        counts.append(count)
    return counts


def test_a_busy_core_is_found_out_and_a_free_one_taken_back() -> None:
    applied: list[int] = []
    tuner = ThreadTuner(2, lambda n, wide: applied.append(n), 24)
    assert run(tuner, IDLE, 200).count(1) <= 8  # idle: two threads, a trial of one now and then
    busy = run(tuner, BUSY, 400)
    assert busy.index(1) < 20 and busy[20:].count(2) <= 8  # loaded: one thread within a few passes
    idle_again = run(tuner, IDLE, 2 * LAST_TRIAL)
    assert idle_again[-100:] == [2] * 100  # the free core is taken back
    assert applied[0] == 2 and all(a != b for a, b in zip(applied, applied[1:], strict=False))  # set only on change


def test_each_pass_shape_is_tuned_on_its_own() -> None:
    """A four-row pass may favour another count than a one-row pass: they do not share times."""
    tuner = ThreadTuner(2, lambda n, wide: None, 24)
    run(tuner, BUSY, 100, rows=1)
    assert run(tuner, IDLE, 100, rows=4)[-50:].count(2) >= 45
    assert run(tuner, BUSY, 10, rows=1)[-5:] == [1] * 5


def test_one_core_has_nothing_to_tune() -> None:
    applied: list[int] = []
    tuner = ThreadTuner(1, lambda n, wide: applied.append(n), 24)
    assert set(run(tuner, BUSY, 50)) == {1} and applied == [1]


def test_a_prompt_chunk_runs_with_every_thread() -> None:
    """Wide passes are not tuned: they get every thread back (BLAS's too), and their times are
    not kept; the next tuned pass gets its own count again."""
    applied: list[tuple[int, bool]] = []
    tuner = ThreadTuner(2, lambda n, wide: applied.append((n, wide)), 24)
    run(tuner, BUSY, 50)
    assert applied[-1] == (1, False)
    assert tuner.choose(256) == 0 and applied[-1] == (2, True)
    tuner.record(256, 0, 9.0)
    assert tuner.choose(1) == 1 and applied[-1] == (1, False)


def test_one_slow_pass_does_not_hand_two_threads_over_to_one() -> None:
    """A served SmolLM2 reply: one two-thread pass took 17.8 ms among 5 ms ones (a burst of another
    thread); a moving average let one thread (7 ms) win the trial that followed."""
    machine = {1: 0.007, 2: 0.005}
    for before in range(100, 108):  # wherever the slow pass falls between trials
        tuner = ThreadTuner(2, lambda n, wide: None, 24)
        run(tuner, machine, before)
        tuner.record(1, tuner.choose(1), 0.0178)
        assert run(tuner, machine, 100).count(1) <= 4


def test_passes_that_slow_down_for_both_counts_do_not_keep_trying_the_slower_one() -> None:
    """Four served MoE streams: two-thread passes of 7 ms early on, then 12-13 ms (one thread 19)
    for the rest of the replies. The slowdown sets off a trial, which two threads win; later
    passes are held against their new pace, not the 7 ms, so trials back off again (each trial
    at once, two passes of every three ran on one thread)."""
    tuner = ThreadTuner(2, lambda n, wide: None, 24)
    run(tuner, {1: 0.012, 2: 0.007}, 10, rows=4)
    assert run(tuner, {1: 0.019, 2: 0.0125}, 300, rows=4).count(1) <= 12


def test_a_trial_is_not_lost_to_waking_the_other_count_s_threads() -> None:
    """The first pass after a switch of count ran 1.3-1.5 ms slower: once the core is free again,
    the first trial of two threads must win, not lose to that pass."""
    last: list[int] = []

    def switching(count: int, machine: dict[int, float]) -> float:
        seconds = machine[count] + (0.0015 if last and last[-1] != count else 0.0)
        last.append(count)
        return seconds

    tuner = ThreadTuner(2, lambda n, wide: None, 24)
    for machine, passes in (({1: 0.007, 2: 0.35}, 20), ({1: 0.007, 2: 0.005}, 2 * FIRST_TRIAL + 4)):
        for _ in range(passes):
            count = tuner.choose(1)
            tuner.record(1, count, switching(count, machine))
    assert last[10:19] == [1] * 9 and last[-4:] == [2] * 4


def test_without_trials_every_pass_keeps_every_thread() -> None:
    """A benchmark's sides of several-fold different pass times set off no trial of one thread."""
    tuner = ThreadTuner(2, lambda n, wide: None, 24, trials=False)
    assert run(tuner, IDLE, 50) + run(tuner, BUSY, 50) + run(tuner, IDLE, 50) == [2] * 150


def test_a_new_pass_shape_starts_from_what_the_decode_steps_learned() -> None:
    """With a core busy, a prompt or verify pass of a row count not seen before runs its first
    pass with the count of the shape with the most passes (one thread), not every thread."""
    tuner = ThreadTuner(2, lambda n, wide: None, 24)
    run(tuner, IDLE, 1, rows=16)
    run(tuner, BUSY, 50, rows=1)
    assert tuner.choose(15) == 1 and tuner.choose(20) == 1
    idle = ThreadTuner(2, lambda n, wide: None, 24)
    run(idle, IDLE, 50, rows=1)
    assert idle.choose(20) == 2


def test_passes_past_the_narrow_rows_are_tuned_and_told_they_are_wide() -> None:
    """A 64-row verify pass of four streams is tuned as a decode step is, and applied as wide
    (the engine's BLAS keeps every thread there, one in a decode step)."""
    applied: list[tuple[int, bool]] = []
    tuner = ThreadTuner(2, lambda n, wide: applied.append((n, wide)), 24, 128)
    passes = run(tuner, BUSY, 30, rows=64)
    assert passes.index(1) < 5 and passes[5:].count(2) <= 2  # a trial of two now and then
    assert (1, True) in applied
    run(tuner, BUSY, 1, rows=1)
    assert applied[-1] == (1, False)
    assert tuner.choose(256) == 0 and applied[-1] == (2, True)


def test_one_thread_far_behind_is_not_tried_again_and_again_on_an_idle_machine() -> None:
    """Idle, a served MoE's one-thread trials (10.5 ms against two threads' 6) only cost passes:
    after the first trial lost by that much, the next waits the longest, and load arriving still
    sets one off at once (the passes slowing); a count that lost narrowly is tried again sooner."""
    far = ThreadTuner(2, lambda n, wide: None, 24)
    assert run(far, {1: 0.0105, 2: 0.006}, LAST_TRIAL).count(1) == 2  # the first trial's two passes
    assert run(far, BUSY, 20)[-10:] == [1] * 10
    near = ThreadTuner(2, lambda n, wide: None, 24)
    assert run(near, {1: 0.0062, 2: 0.006}, LAST_TRIAL).count(1) > 2


def test_a_new_pass_shape_skips_its_early_trial_where_the_decode_steps_settled() -> None:
    """Idle, the decode steps' trials of one thread lost: a rarer shape (the last streams' 3-row
    steps) keeps two threads rather than pay an early trial of one; where the decode steps have not
    settled yet, a new shape tries the other count early."""
    settled = ThreadTuner(2, lambda n, wide: None, 24)
    run(settled, {1: 0.0105, 2: 0.006}, 200)
    assert run(settled, {1: 0.019, 2: 0.012}, 100, rows=3) == [2] * 100
    fresh = ThreadTuner(2, lambda n, wide: None, 24)
    run(fresh, {1: 0.0105, 2: 0.006}, 2)
    assert 1 in run(fresh, {1: 0.019, 2: 0.012}, 10, rows=3)
