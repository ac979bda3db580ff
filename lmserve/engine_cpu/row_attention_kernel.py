"""A decode step's attention over one float32 cache in one compiled call: the new rows' rotary
embedding, their keys and values written into the cache, then each query's scores, masked softmax
and mix of the values.

In NumPy a layer's attention for one new row is some 30 calls (rope's halves, the cache writes, the
query heads' reshapes, the scores' product, the softmax, the values' product, the output's
reshapes), each a microsecond or more of Python and dispatch around a few thousand multiply-adds: a
third of SmolLM2's decode step was that, not arithmetic (figures: docs/PERFORMANCE.md, measurements
behind code choices). Here a row's scores are dot products along the head dimension, which Numba
vectorizes with reassociated sums; the softmax is `softmax_kernel.softmax_row` (its `_exp`, the
division by the sum). The query heads that share a KV head (grouped-query attention) run together,
each block of keys and values read once for all of them rather than once a head: the synthetic
MoE's 16 heads over 4 KV heads ran 1.25x faster at 1,024 positions, 1.5x from 2,048 (figures:
docs/PERFORMANCE.md). The (row, KV head) units run on the calling thread up to PARALLEL_SCORES
scores, where a thread launch costs more than it splits, and on the kernels' threads past them
(`ops.ONE_CALL_POSITIONS` bounds the positions a pass may read here).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from lmserve.engine_cpu.softmax_kernel import _FAST, softmax_row

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
    q = np.empty((n, heads, head_dim), np.float32)
    rope_rows(qk, v, cos, sin, keys, values, start, q.reshape(n, kv_heads, heads // kv_heads, head_dim), False)
    if (start + n) * heads < PARALLEL_SCORES:  # a short context's: a thread launch costs more
        attend_serial(q, keys, values, start, scale, window, sinks, out)
    else:
        attend_threaded(q, keys, values, start, scale, window, sinks, out)


@njit(fastmath=_FAST, error_model="numpy", cache=True, nogil=True)
def rope_rows(qk, v, cos, sin, keys, values, start, q, by_kv_head):  # noqa: ANN001, ANN201
    """`attend_rows`' first part, which a prompt pass over a float32 cache runs too: rows `qk` and
    `v` rotated (NeoX pairs, dimensions past the tables' `rotary` unrotated), the keys and values
    written into the cache at `start + r`, and query head h's rotated row r into `q[r, h //
    group, h % group]` (`q` `[n, kv_heads, group, head_dim]`), or with `by_kv_head` into `q[h //
    group, r, h % group]` (`[kv_heads, n, group, head_dim]`: `ops.grouped_attention`'s layout,
    which NumPy would make with another copy)."""
    n, qk_heads, head_dim = qk.shape
    kv_heads = keys.shape[0]
    group = q.shape[2]
    heads = qk_heads - kv_heads
    rotary = cos.shape[-1]
    half = rotary // 2
    for r in range(n):
        at = start + r
        c, s = cos[r, 0], sin[r, 0]
        for h in range(qk_heads):
            source = qk[r, h]
            if h >= heads:
                target = keys[h - heads, at]
            elif by_kv_head:
                target = q[h // group, r, h % group]
            else:
                target = q[r, h // group, h % group]
            for d in range(half):
                target[d] = source[d] * c[d] + source[d + half] * s[d]
            for d in range(half, rotary):
                target[d] = source[d] * c[d] + source[d - half] * s[d]
            for d in range(rotary, head_dim):
                target[d] = source[d]
        for h in range(kv_heads):
            values[h, at] = v[r, h]


@njit(fastmath=_FAST, error_model="numpy", cache=True, nogil=True)
def attend_serial(q, keys, values, start, scale, window, sinks, out):  # noqa: ANN001, ANN201
    """`out` `[n, heads, head_dim]`: each rotated query `q` (at `start + r`) over the cache's
    `keys` and `values` it sees, (row, KV head) after another on the calling thread."""
    n, heads, head_dim = q.shape
    kv_heads = keys.shape[0]
    weights = np.empty((heads // kv_heads, start + n), np.float32)
    mixed = np.empty((heads // kv_heads, head_dim), np.float32)
    for t in range(n * kv_heads):
        _attend_group(q, keys, values, start, scale, window, sinks, t // kv_heads, t % kv_heads, weights, mixed, out)


@njit(fastmath=_FAST, error_model="numpy", parallel=True, cache=True, nogil=True)
def attend_threaded(q, keys, values, start, scale, window, sinks, out):  # noqa: ANN001, ANN201
    """`attend_serial`, each (row, KV head) on the kernels' threads."""
    n, heads, head_dim = q.shape
    kv_heads = keys.shape[0]
    for t in prange(n * kv_heads):
        weights = np.empty((heads // kv_heads, start + n), np.float32)
        mixed = np.empty((heads // kv_heads, head_dim), np.float32)
        _attend_group(q, keys, values, start, scale, window, sinks, t // kv_heads, t % kv_heads, weights, mixed, out)


@njit(fastmath=_FAST, error_model="numpy", nogil=True)
def _attend_group(q, keys, values, start, scale, window, sinks, r, kv, weights, mixed, out):  # noqa: ANN001, ANN202
    """`out[r, h]` for the query heads h that read KV head `kv`: row r (at position `start + r`)
    over the keys it sees, with `weights` `[group, positions]` and `mixed` `[group, head_dim]` as
    scratch. The group's queries share each key and value they read, once from memory."""
    at = start + r
    begin = max(0, at - window + 1) if window else 0
    count = at + 1 - begin
    group = q.shape[1] // keys.shape[0]
    first = kv * group
    queries = q[r, first:first + group]
    _scores(queries, keys[kv, begin:at + 1], weights)
    for g in range(group):
        softmax_row(weights[g, :count], scale, sinks[first + g] if len(sinks) else np.float32(-np.inf), len(sinks) > 0)
    _mix(weights, values[kv, begin:at + 1], mixed)
    out[r, first:first + group] = mixed


@njit(fastmath=_FAST, inline="always", nogil=True)
def _scores(queries, keys, weights):  # noqa: ANN001, ANN202
    """`weights[g, j] = queries[g] . keys[j]`: four keys at a time, each block read once
    for every query of the group (and each query's values once for the block's four dot products)."""
    count, head_dim = keys.shape
    j = 0
    while j + 4 <= count:
        k0, k1, k2, k3 = keys[j], keys[j + 1], keys[j + 2], keys[j + 3]
        for g in range(len(queries)):
            query = queries[g]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for d in range(head_dim):
                a0 += query[d] * k0[d]
                a1 += query[d] * k1[d]
                a2 += query[d] * k2[d]
                a3 += query[d] * k3[d]
            weights[g, j], weights[g, j + 1], weights[g, j + 2], weights[g, j + 3] = a0, a1, a2, a3
        j += 4
    while j < count:
        key = keys[j]
        for g in range(len(queries)):
            query = queries[g]
            dot = np.float32(0.0)
            for d in range(head_dim):
                dot += query[d] * key[d]
            weights[g, j] = dot
        j += 1


@njit(fastmath=_FAST, inline="always", nogil=True)
def _mix(weights, values, mixed):  # noqa: ANN001, ANN202
    """`mixed[g] = sum_j weights[g, j] * values[j]`, four values a pass over each `mixed[g]` (its
    loads and stores, which the compiler keeps in memory, are a quarter as many), each block of
    values read once for the group."""
    count = values.shape[0]
    mixed[:] = 0.0
    j = 0
    while j + 4 <= count:
        v0, v1, v2, v3 = values[j], values[j + 1], values[j + 2], values[j + 3]
        for g in range(len(mixed)):
            w0, w1, w2, w3 = weights[g, j], weights[g, j + 1], weights[g, j + 2], weights[g, j + 3]
            m = mixed[g]
            for d in range(len(m)):
                m[d] += (w0 * v0[d] + w1 * v1[d]) + (w2 * v2[d] + w3 * v3[d])
        j += 4
    while j < count:
        value = values[j]
        for g in range(len(mixed)):
            weight, m = weights[g, j], mixed[g]
            for d in range(len(m)):
                m[d] += weight * value[d]
        j += 1
