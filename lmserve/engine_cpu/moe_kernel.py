"""A mixture-of-experts FFN's routing, compiled, and a decode step's whole MoE FFN half as one call.

In Python a MoE layer's FFN is about thirty NumPy calls a step (the router product, an argsort,
the softmax's passes, the grouping's argsorts and gathers, two grouped products, the weighted
sum), each a few microseconds: at a decode step's few rows, more than the router's arithmetic and
a good part of a step (figures: docs/PERFORMANCE.md). `route` picks each row's experts and their
weights; `moe.mixture` runs it for every pass, and the router product of a decode step's rows
(`router_logits`), so a row gets the same bits from `moe_half` and from the Python path. The
experts' products are `int8_kernels._grouped_times`, the call the Python path makes.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from lmserve.engine_cpu.decode_layer_kernel import silu_mul
from lmserve.engine_cpu.int8_kernels import _grouped_times
from lmserve.engine_cpu.norm_kernel import rms_norm
from lmserve.engine_cpu.softmax_kernel import _FAST, _exp


@njit(fastmath=_FAST, error_model="numpy", cache=True, nogil=True)
def router_logits(x, router, out):  # noqa: ANN001, ANN201
    """`out` `[n, experts]` = `x` `[n, hidden]` times the float32 `router` `[experts, hidden]` transposed."""
    for r in range(x.shape[0]):
        row = x[r]
        for e in range(router.shape[0]):
            weights = router[e]
            total = np.float32(0.0)
            for i in range(row.shape[0]):
                total += row[i] * weights[i]
            out[r, e] = total


@njit(fastmath=_FAST, error_model="numpy", cache=True, nogil=True)
def route(logits, topk_softmax, chosen, weights):  # noqa: ANN001, ANN201
    """Each row's `k` = `chosen.shape[1]` experts of the highest `logits` `[n, experts]` (ties: the
    lower index first, as a stable argsort), best first, into `chosen`, and their weights into
    `weights`: the softmax over all experts, kept for the chosen and renormalized, or with
    `topk_softmax` (gpt-oss) the softmax over the chosen logits alone."""
    n, experts = logits.shape
    k = chosen.shape[1]
    for r in range(n):
        row = logits[r]
        taken = np.zeros(experts, np.bool_)
        for slot in range(k):
            best = -1
            for e in range(experts):
                if not taken[e] and (best < 0 or row[e] > row[best]):
                    best = e
            taken[best] = True
            chosen[r, slot] = best
        peak = row[chosen[r, 0]]
        if topk_softmax:
            total = np.float32(0.0)
            for slot in range(k):
                weights[r, slot] = _exp(row[chosen[r, slot]] - peak)
                total += weights[r, slot]
        else:
            every = np.float32(0.0)
            for e in range(experts):
                every += _exp(row[e] - peak)
            total = np.float32(0.0)
            for slot in range(k):
                weights[r, slot] = _exp(row[chosen[r, slot]] - peak) / every
                total += weights[r, slot]
        for slot in range(k):
            weights[r, slot] /= total


@njit(cache=True, nogil=True)
def moe_half(h, norm, eps, router, topk_softmax, k, gate_up, down):  # noqa: ANN001, ANN201
    """`h` `[n, hidden]` += its mixture of experts: RMSNorm, the router, each row's `k` experts'
    SwiGLU FFNs (`gate_up` and `down`: `_grouped_times`' matrix arguments of the expert stacks),
    weighted and summed in the experts' order, as `moe._experts` adds them."""
    n = h.shape[0]
    x = np.empty_like(h)
    rms_norm(h, norm, eps, x)
    logits = np.empty((n, router.shape[0]), np.float32)
    router_logits(x, router, logits)
    chosen = np.empty((n, k), np.int64)
    weights = np.empty((n, k), np.float32)
    route(logits, topk_softmax, chosen, weights)
    pairs, pair_weights = chosen.ravel(), weights.ravel()  # (row, slot) pairs, row-major
    order = np.argsort(pairs, kind="mergesort")  # the pairs grouped by expert
    experts = pairs[order]
    bounds = [0]
    for i in range(1, len(experts)):
        if experts[i] != experts[i - 1]:
            bounds.append(i)
    bounds.append(len(experts))
    firsts = np.array(bounds, np.int64)
    groups = experts[firsts[:-1]]
    xs = np.empty((len(order), h.shape[1]), np.float32)
    for i in range(len(order)):
        xs[i] = x[order[i] // k]
    both = _grouped_times(xs, *gate_up, groups, firsts)
    hidden = np.empty((len(order), both.shape[1] // 2), np.float32)
    silu_mul(both, hidden)
    y = _grouped_times(hidden, *down, groups, firsts)
    out = np.empty_like(h)
    add_weighted(y, pair_weights, order, k, out, 0, n)
    h += out


@njit(cache=True, nogil=True)
def add_weighted(y, weights, order, k, out, lo, hi):  # noqa: ANN001, ANN201, PLR0913
    """`out[r]` = row r's k experts' outputs times `weights[pair]` (pair = r * k + slot), added to
    zeros in the experts' order, for rows `lo:hi`. Row i of `y` is pair `order[i]`'s output (the
    pairs grouped by expert), so a row's outputs are found where its pairs went, and a range of
    rows needs no other's: a prompt pass splits them between the CPUs (`moe._experts`). One pass
    over `y`, where scaling it, gathering it by row and summing took three."""
    places = np.empty_like(order)  # where each pair's output is in `y`
    for i in range(len(order)):
        places[order[i]] = i
    pairs = np.empty(k, np.int64)
    for r in range(lo, hi):
        for slot in range(k):  # row r's pairs by place: an insertion sort of k
            pair, at = r * k + slot, slot
            while at > 0 and places[pairs[at - 1]] > places[pair]:
                pairs[at] = pairs[at - 1]
                at -= 1
            pairs[at] = pair
        row = out[r]
        row[:] = 0.0
        for slot in range(k):
            i, weight = places[pairs[slot]], weights[pairs[slot]]
            for c in range(y.shape[1]):
                row[c] += y[i, c] * weight
