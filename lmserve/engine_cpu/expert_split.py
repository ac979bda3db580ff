"""How a grouped (expert) product's iterations split between the kernels' threads.

A grouped product runs group g's rows `firsts[g]:firsts[g + 1]` through matrix `experts[g]`, as
`per_group` iterations a group (a tile or a row of the matrix each). Split evenly by count, the
iterations gave each thread the same number of experts, not the same work: a prompt chunk routes
unevenly (one expert of the synthetic MoE took 498 of a chunk's 2,048 rows, others one), and two
threads ran the chunk's expert products 1.65x faster than one (figures: docs/PERFORMANCE.md).
These bounds give each part about the same rows times iterations, in the same order, so a part's
experts and their rows of x stay together; each output is computed as before, whatever the split.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Runs the iterations are split into. OpenMP's static schedule gives each thread a run of
# consecutive parts, so the threads get about equal work at any count up to this.
PARTS = 256


@njit(cache=True, nogil=True)
def even_work(firsts, per_group, parts):  # noqa: ANN001, ANN201
    """`parts + 1` bounds of runs of the iterations `g * per_group + i` whose work (each of
    group g's costs its row count) is about equal: part p runs `bounds[p]:bounds[p + 1]`."""
    groups = len(firsts) - 1
    total = (firsts[groups] - firsts[0]) * per_group
    bounds = np.empty(parts + 1, np.int64)
    bounds[0], bounds[parts] = 0, groups * per_group
    g, done = 0, 0  # the group the next bound falls in, and the work of the groups before it
    for p in range(1, parts):
        target = total * p // parts
        while g < groups and done + (firsts[g + 1] - firsts[g]) * per_group <= target:
            done += (firsts[g + 1] - firsts[g]) * per_group
            g += 1
        # Past the last group's work only where every group is empty (target 0, done 0).
        bounds[p] = groups * per_group if g == groups else g * per_group + (target - done) // (firsts[g + 1] - firsts[g])
    return bounds
