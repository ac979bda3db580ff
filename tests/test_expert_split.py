"""`expert_split.even_work`: a grouped product's iterations split into runs of about equal work,
so a prompt chunk whose router sends most rows to one expert keeps both threads busy."""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.fast,
              pytest.mark.skipif(sys.platform == "darwin", reason="numba is not installed on macOS (MLX serves)")]


def _works(firsts: np.ndarray, per_group: int, bounds: np.ndarray) -> list[int]:
    """Each run's work: every iteration of group g costs its row count."""
    cost = np.repeat(np.diff(firsts), per_group)
    return [int(cost[lo:hi].sum()) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


@pytest.mark.parametrize("counts", [(498, 1, 3, 40, 2, 1), (1, 1, 1, 1), (0, 7, 0, 300), (64,) * 32])
@pytest.mark.parametrize("parts", [2, 3, 256])
def test_runs_cover_every_iteration_once_with_about_equal_work(counts: tuple[int, ...], parts: int) -> None:
    from lmserve.engine_cpu.expert_split import even_work

    firsts, per_group = np.cumsum([0, *counts]).astype(np.int64), 512
    bounds = even_work(firsts, per_group, parts)
    assert bounds[0] == 0 and bounds[-1] == len(counts) * per_group
    assert np.all(np.diff(bounds) >= 0)  # consecutive runs: every iteration in exactly one
    works, most_rows = _works(firsts, per_group, bounds), max(counts)
    assert sum(works) == sum(counts) * per_group
    # Equal to within one iteration of the largest group, wherever the bounds fall.
    assert max(works) - min(works) <= 2 * most_rows


def test_a_static_split_of_an_uneven_route_is_what_it_replaces() -> None:
    """The case it was made for: one expert of most rows first. Half the iterations each (the
    split it replaced) gives one run nearly all the work; even_work's two runs are within 1%."""
    from lmserve.engine_cpu.expert_split import even_work

    firsts, per_group = np.cumsum([0, 498, 1, 3, 40, 2, 1, 5, 2]).astype(np.int64), 256
    halves = np.array([0, 4 * per_group, 8 * per_group])
    by_count = _works(firsts, per_group, halves)
    assert max(by_count) > 0.9 * sum(by_count)
    works = _works(firsts, per_group, even_work(firsts, per_group, 2))
    assert abs(works[0] - works[1]) <= 0.01 * sum(works)
