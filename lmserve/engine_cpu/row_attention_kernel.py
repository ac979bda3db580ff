"""A decode step's attention over one float32 cache in one compiled call: the new rows' rotary
embedding, their keys and values written into the cache, then each query's scores, masked softmax
and mix of the values.

In NumPy a layer's attention for one new row is some 30 calls (rope's halves, the cache writes, the
query heads' reshapes, the scores' product, the softmax, the values' product, the output's
reshapes), each a microsecond or more of Python and dispatch around a few thousand multiply-adds: a
third of SmolLM2's decode step was that, not arithmetic (figures: docs/PERFORMANCE.md, measurements
behind code choices). Here a row's scores are dot products along the head dimension, which Numba
vectorizes with reassociated sums; the softmax is `softmax_kernel`'s (its `_exp`, the division by
the sum). The (row, query head) pairs run on the calling thread up to PARALLEL_SCORES scores, where
a thread launch costs more than it splits, and on the kernels' threads past them (`ops.ONE_CALL_POSITIONS`
bounds the positions a pass may read here).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from lmserve.engine_cpu.softmax_kernel import _FAST, _exp

# Scores (positions times query heads) from which a pass's heads run on the kernels' threads: below,
# a short context's, the launch cost about what the split saved (figures: docs/PERFORMANCE.md, a
# decode step's attention on threads).
PARALLEL_SCORES = 1024


@njit(fastmath=_FAST, error_model="numpy", cache=True, nogil=True)
def attend_rows(qk, v, cos, sin, keys, values, start, scale, window, sinks, out):  # noqa: ANN001, ANN201
    """Rows `qk` `[n, heads + kv_heads, head_dim]` (queries, then keys, before rotation) and `v`
    `[n, kv_heads, head_dim]` at positions `start..start+n-1`: their rotated keys and their values
    are written into `keys` and `values` `[kv_heads, positions, head_dim]` there, and `out` `[n,
    heads, head_dim]` gets each query's attention over the positions at or before its own (and
    within `window` of it when nonzero). `cos`, `sin` `[n, 1, rotary]`: `ops.rope_tables`' (NeoX
    pairs, dimensions past `rotary` unrotated). Query head h reads KV head h // (heads //
    kv_heads); `sinks` `[heads]` (empty: none) join each of its rows' denominators."""
    n, qk_heads, head_dim = qk.shape
    kv_heads = keys.shape[0]
    heads = qk_heads - kv_heads
    rotary = cos.shape[-1]
    half = rotary // 2
    q = np.empty((n, heads, head_dim), np.float32)
    for r in range(n):
        at = start + r
        c, s = cos[r, 0], sin[r, 0]
        for h in range(qk_heads):
            source = qk[r, h]
            target = q[r, h] if h < heads else keys[h - heads, at]
            for d in range(half):
                target[d] = source[d] * c[d] + source[d + half] * s[d]
            for d in range(half, rotary):
                target[d] = source[d] * c[d] + source[d - half] * s[d]
            for d in range(rotary, head_dim):
                target[d] = source[d]
        for h in range(kv_heads):
            values[h, at] = v[r, h]
    if (start + n) * heads < PARALLEL_SCORES:  # a short context's: a thread launch costs more
        attend_serial(q, keys, values, start, scale, window, sinks, out)
    else:
        attend_threaded(q, keys, values, start, scale, window, sinks, out)


@njit(fastmath=_FAST, error_model="numpy", cache=True, nogil=True)
def attend_serial(q, keys, values, start, scale, window, sinks, out):  # noqa: ANN001, ANN201
    """`out` `[n, heads, head_dim]`: each rotated query `q` (at `start + r`) over the cache's
    `keys` and `values` it sees, (row, query head) after another on the calling thread."""
    n, heads, head_dim = q.shape
    weights = np.empty(start + n, np.float32)
    mixed = np.empty(head_dim, np.float32)
    for t in range(n * heads):
        _attend_one(q, keys, values, start, scale, window, sinks, t // heads, t % heads, weights, mixed, out)


@njit(fastmath=_FAST, error_model="numpy", parallel=True, cache=True, nogil=True)
def attend_threaded(q, keys, values, start, scale, window, sinks, out):  # noqa: ANN001, ANN201
    """`attend_serial`, each (row, query head) on the kernels' threads."""
    n, heads, head_dim = q.shape
    for t in prange(n * heads):
        weights = np.empty(start + n, np.float32)
        mixed = np.empty(head_dim, np.float32)
        _attend_one(q, keys, values, start, scale, window, sinks, t // heads, t % heads, weights, mixed, out)


@njit(fastmath=_FAST, error_model="numpy", nogil=True)
def _attend_one(q, keys, values, start, scale, window, sinks, r, h, weights, mixed, out):  # noqa: ANN001, ANN202
    """`out[r, h]`: query head h of row r (at position `start + r`) over the keys it sees, with
    `weights` and `mixed` as scratch."""
    at = start + r
    begin = max(0, at - window + 1) if window else 0
    count = at + 1 - begin
    kv = h // (q.shape[1] // keys.shape[0])
    _scores(q[r, h], keys[kv, begin:at + 1], scale, weights)
    peak = np.float32(-np.inf)
    for j in range(count):
        peak = max(peak, weights[j])
    sink = sinks[h] if len(sinks) else np.float32(-np.inf)
    peak = max(peak, sink)
    total = _exp(sink - peak) if len(sinks) else np.float32(0.0)
    for j in range(count):
        e = _exp(weights[j] - peak)
        weights[j] = e
        total += e
    for j in range(count):
        weights[j] /= total
    _mix(weights, values[kv, begin:at + 1], mixed)
    out[r, h] = mixed


@njit(fastmath=_FAST, inline="always", nogil=True)
def _scores(query, keys, scale, weights):  # noqa: ANN001, ANN202
    """`weights[j] = scale * (query . keys[j])`, four keys a pass over the query (each of its
    values loaded once for four dot products)."""
    count, head_dim = keys.shape
    j = 0
    while j + 4 <= count:
        k0, k1, k2, k3 = keys[j], keys[j + 1], keys[j + 2], keys[j + 3]
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for d in range(head_dim):
            a0 += query[d] * k0[d]
            a1 += query[d] * k1[d]
            a2 += query[d] * k2[d]
            a3 += query[d] * k3[d]
        weights[j], weights[j + 1], weights[j + 2], weights[j + 3] = a0 * scale, a1 * scale, a2 * scale, a3 * scale
        j += 4
    while j < count:
        key = keys[j]
        dot = np.float32(0.0)
        for d in range(head_dim):
            dot += query[d] * key[d]
        weights[j] = dot * scale
        j += 1


@njit(fastmath=_FAST, inline="always", nogil=True)
def _mix(weights, values, mixed):  # noqa: ANN001, ANN202
    """`mixed = sum_j weights[j] * values[j]`, four values a pass over `mixed` (its loads and
    stores, which the compiler keeps in memory, are a quarter as many)."""
    count = values.shape[0]
    mixed[:] = 0.0
    j = 0
    while j + 4 <= count:
        w0, w1, w2, w3 = weights[j], weights[j + 1], weights[j + 2], weights[j + 3]
        v0, v1, v2, v3 = values[j], values[j + 1], values[j + 2], values[j + 3]
        for d in range(len(mixed)):
            mixed[d] += (w0 * v0[d] + w1 * v1[d]) + (w2 * v2[d] + w3 * v3[d])
        j += 4
    while j < count:
        weight, value = weights[j], values[j]
        for d in range(len(mixed)):
            mixed[d] += weight * value[d]
        j += 1
