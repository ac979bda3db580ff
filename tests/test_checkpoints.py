"""The checkpoint bookkeeping a hybrid cache keeps (engine/checkpoints.py): which prefixes stay
reachable as a long session grows past the limit."""

from __future__ import annotations

import pytest

from lmserve.engine.checkpoints import Checkpoints

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`


def test_latest_finds_the_checkpoint_at_or_below():
    points: Checkpoints[str] = Checkpoints(8)
    for p in (256, 512, 700):
        points.add(p, f"s{p}")
    assert points.latest(600) == (512, "s512")
    assert points.latest(512) == (512, "s512")
    assert points.latest(255) == (0, None)  # before the first: the empty state
    assert points.latest(10_000) == (700, "s700")


def test_adding_a_position_again_replaces_its_state():
    points: Checkpoints[str] = Checkpoints(4)
    points.add(10, "old")
    points.add(10, "new")
    assert len(points) == 1 and points.latest(10) == (10, "new")


def test_position_zero_is_never_kept():
    points: Checkpoints[str] = Checkpoints(4)
    points.add(0, "empty")
    assert len(points) == 0


def test_a_growing_session_keeps_the_newest_and_a_spread_of_older_prefixes():
    """A 40-chunk prompt with the limit at 8: the prompt's last two positions survive, and the
    older prefixes are spread out rather than all from the end."""
    points: Checkpoints[int] = Checkpoints(8)
    for p in range(256, 256 * 41, 256):
        points.add(p, p)
    points.add(256 * 40 + 1, 0)  # the prompt's last token, prefilled alone
    kept = points.positions
    assert len(kept) == 8
    assert kept[-2:] == [256 * 40, 256 * 40 + 1]
    assert kept[0] <= 256 * 10, f"no early prefix kept: {kept}"
    gaps = [b - a for a, b in zip([0, *kept[:-3]], kept[:-2], strict=True)]
    assert max(gaps) <= 3 * min(gaps), f"uneven spread: {kept}"


def test_drop_above_and_up_to():
    points: Checkpoints[int] = Checkpoints(8)
    for p in (100, 200, 300):
        points.add(p, p)
    prefix = points.up_to(250)
    assert prefix.positions == [100, 200]
    points.drop_above(200)
    assert points.positions == [100, 200]
    prefix.add(150, 150)  # copies are independent
    assert points.positions == [100, 200]


def test_the_limit_must_allow_one_checkpoint():
    with pytest.raises(ValueError):
        Checkpoints(0)
