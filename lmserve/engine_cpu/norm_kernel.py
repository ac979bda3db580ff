"""RMSNorm as one compiled pass per row, with the bits of its NumPy form (`ops.rms_norm`).

A decode step runs two to five norms a layer on a row or a few, where NumPy's seven calls a norm
(square, sum, divide, add, square root, divide, multiply) cost more than the arithmetic: about 8
µs a norm against 1.5 compiled (figures: docs/PERFORMANCE.md, measurements behind code choices).
The sum of squares is NumPy's own pairwise summation (`_pairwise`), and every other step one
float32 operation as NumPy's, so a row gets exactly the NumPy form's bits: the fidelity tests'
counts, measured with those, stay where they are.
"""

from __future__ import annotations

import numpy as np
from numba import njit

BLOCK = 128  # NumPy's PW_BLOCKSIZE: runs of up to this many values are summed in eight lanes


@njit(inline="always", nogil=True)
def _run(a, lo, n):  # noqa: ANN001, ANN202
    """`a[lo:lo + n]`, n <= BLOCK, summed as NumPy's `pairwise_sum` does: under 8 values in
    order; else in eight running sums (value i into sum i % 8) added as a tree, then the rest in
    order."""
    if n < 8:
        total = np.float32(0.0)
        for i in range(lo, lo + n):
            total += a[i]
        return total
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = lo + 8
    whole = lo + n - n % 8
    while i < whole:
        r0 += a[i]
        r1 += a[i + 1]
        r2 += a[i + 2]
        r3 += a[i + 3]
        r4 += a[i + 4]
        r5 += a[i + 5]
        r6 += a[i + 6]
        r7 += a[i + 7]
        i += 8
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < lo + n:
        total += a[i]
        i += 1
    return total


@njit(inline="always", nogil=True)
def _pairwise(a, spans, sums):  # noqa: ANN001, ANN202
    """`a` summed as NumPy's `pairwise_sum` does: a run of up to BLOCK values by `_run`, a longer
    one as its two halves (the first a multiple of 8 long) each so, then added. Written as a walk
    with its own stack (`spans` `[depth, 3]`: start, length, halves done; `sums` `[depth]`),
    as Numba's cache cannot load recursive functions."""
    spans[0, 0], spans[0, 1], spans[0, 2] = 0, len(a), 0
    top, done = 0, 0
    while top >= 0:
        lo, n, halves = spans[top, 0], spans[top, 1], spans[top, 2]
        if n <= BLOCK:
            sums[done] = _run(a, lo, n)
            done += 1
            top -= 1
            continue
        half = n // 2 - n // 2 % 8
        if halves == 2:
            sums[done - 2] = sums[done - 2] + sums[done - 1]
            done -= 1
            top -= 1
            continue
        spans[top, 2] = halves + 1
        top += 1
        spans[top, 0], spans[top, 1], spans[top, 2] = (lo, half, 0) if halves == 0 else (lo + half, n - half, 0)
    return sums[0]


@njit(error_model="numpy", cache=True, nogil=True)
def rms_norm(x, weight, eps, out):  # noqa: ANN001, ANN201
    """`out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight` for each row of `x` `[rows, size]`
    (`weight` empty: no weight, Gemma 4's value norm)."""
    rows, size = x.shape
    squares = np.empty(size, np.float32)
    spans, sums = np.empty((64, 3), np.int64), np.empty(64, np.float32)
    count = np.float32(size)
    for r in range(rows):
        row = x[r]
        for c in range(size):
            squares[c] = row[c] * row[c]
        scale = np.sqrt(_pairwise(squares, spans, sums) / count + eps)
        if len(weight):
            for c in range(size):
                out[r, c] = row[c] / scale * weight[c]
        else:
            for c in range(size):
                out[r, c] = row[c] / scale
