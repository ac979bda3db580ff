"""Mixture-of-experts FFNs: route each row to its top-k experts and sum their weighted outputs.

Rows are grouped by expert, so each selected expert's matrices are read once per step and the
others not at all. Routing by family: softmax over every expert, keep the top k, renormalize
(Qwen3 MoE, Qwen3.5 MoE, and Gemma 4, which scales each chosen weight by its expert's own scale and
routes on the residual stream RMS-normalized and scaled per channel); or softmax over the top k
logits (gpt-oss). Qwen3.5 MoE adds a shared expert every row runs, gated by sigmoid(x . gate).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lmserve.engine_cpu import ops
from lmserve.engine_cpu.qmatrix import KERNEL_ROWS, ExpertStack, Matrix
from lmserve.engine_cpu.weights import Experts, ExpertWeights
from lmserve.model.families import ROUTE_TOPK_SOFTMAX

Activation = Callable[[np.ndarray], np.ndarray]


def mixture(x: np.ndarray, residual: np.ndarray, m: ExpertWeights, k: int, router: str,
            activation: Activation, eps: float) -> np.ndarray:
    """The experts' output for their input rows `x` `[n, hidden]`; `residual` is the layer's
    residual stream, which Gemma 4's router reads instead of `x`."""
    if m.router_scale is not None:
        routed = ops.rms_norm(residual, m.router_scale, eps) * np.float32(residual.shape[-1] ** -0.5)
    else:
        routed = x
    logits = _router_logits(routed, m.router)
    if m.router_bias is not None:
        logits += m.router_bias
    chosen, weights = _route(logits, k, router == ROUTE_TOPK_SOFTMAX)
    if m.expert_scale is not None:
        weights *= m.expert_scale[chosen]
    out = _experts(x, m, chosen, weights, activation)
    if m.shared is not None:
        shared = ops.gated_ffn(x, m.shared.gate_up, m.shared.down, activation)
        out += shared * ops.sigmoid(x @ m.shared.gate)[:, None]
    return out


def _router_logits(x: np.ndarray, router: Matrix) -> np.ndarray:
    """The router's logits `[n, experts]`: a decode step's rows of a float32 router by
    `moe_kernel.router_logits`, which the compiled MoE half runs too (the same bits), others as
    any product."""
    kernel = ops.compiled("moe_kernel")
    if kernel is None or len(x) > KERNEL_ROWS or not (isinstance(router, np.ndarray) and router.dtype == np.float32):
        return ops.linear(x, router)
    out = np.empty((len(x), len(router)), np.float32)
    kernel.router_logits(np.ascontiguousarray(x, np.float32), router, out)
    return out


def _route(logits: np.ndarray, k: int, topk_softmax: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k chosen experts `[n, k]` (highest logit first) and their weights: the softmax
    over every expert, kept for the chosen and renormalized, or (`topk_softmax`, gpt-oss) over the
    k chosen logits. By `moe_kernel.route` where Numba is (the compiled MoE half's too), else NumPy."""
    kernel = ops.compiled("moe_kernel")
    if kernel is not None:
        chosen, weights = np.empty((len(logits), k), np.int64), np.empty((len(logits), k), np.float32)
        kernel.route(np.ascontiguousarray(logits, np.float32), topk_softmax, chosen, weights)
        return chosen, weights
    chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :k]  # [n, k]
    picked = np.arange(len(chosen))[:, None], chosen  # indexes [n, k] (take_along_axis cost 7x more)
    if topk_softmax:
        return chosen, ops.softmax(logits[picked])
    weights = ops.softmax(logits)[picked]
    weights /= weights.sum(axis=-1, keepdims=True)
    return chosen, weights


def _experts(x: np.ndarray, m: ExpertWeights, chosen: np.ndarray, weights: np.ndarray,
             activation: Activation) -> np.ndarray:
    """Each row's chosen experts `[n, k]`, run and summed by `weights` `[n, k]`; each selected
    expert runs once, on the rows routed to it. Each row's sum has the bits of adding its experts'
    outputs to zeros in the experts' order, whatever path computed them (`moe_kernel.add_weighted`
    where Numba is, NumPy's passes where not)."""
    n, k = chosen.shape
    order = np.argsort(chosen.ravel(), kind="stable")  # (row, slot) pairs grouped by expert
    experts, rows = chosen.ravel()[order], order // k  # a row picks an expert at most once
    bounds = np.flatnonzero(experts[1:] != experts[:-1]) + 1
    firsts = np.concatenate(([0], bounds, [len(experts)]))
    y = _expert_outputs(x, rows, m, experts, firsts, activation)
    kernel = ops.compiled("moe_kernel")
    if kernel is not None:
        out = np.empty((n, y.shape[1]), np.float32)
        pair_weights = np.ascontiguousarray(weights, np.float32).ravel()
        ops.in_parts(lambda lo, hi: kernel.add_weighted(y, pair_weights, order, k, out, lo, hi), n, y.size,
                     ops.THREADED_ROWS)
        return out
    y *= weights.ravel()[order, None]
    by_row = y[np.argsort(rows, kind="stable").reshape(n, k)]  # [n, k, hidden], experts in order
    return by_row.sum(axis=1)  # adds the k outputs in turn, as a loop over them would


def _expert_outputs(x: np.ndarray, rows: np.ndarray, m: ExpertWeights, experts: np.ndarray, firsts: np.ndarray,
                    activation: Activation) -> np.ndarray:
    """Rows `rows` of `x` (one for each row's expert) through their experts (`experts`, sorted;
    group g is `rows[firsts[g]:firsts[g + 1]]`), one matrix at a time (`_grouped_product`)."""
    gate_up = _grouped_product(x, m.gate_up, experts, firsts, rows)
    if m.gate_up_bias is not None:
        gate_up += m.gate_up_bias[experts]
    y = _grouped_product(activation(gate_up), m.down, experts, firsts)
    if m.down_bias is not None:
        y += m.down_bias[experts]
    return y


def _grouped_product(x: np.ndarray, matrices: Experts, experts: np.ndarray, firsts: np.ndarray,
                     rows: np.ndarray | None = None) -> np.ndarray:
    """Each group's rows times its expert's matrix transposed, group g's rows being x's rows
    `rows[firsts[g]:firsts[g + 1]]` (None: x's rows in order). The groups a stacked matrix's
    kernels take (`ExpertStack.kernel_rows`: every group of a decode step, and of a prompt chunk
    where int8 activations take the stack) run in one grouped kernel call, which reads the rows
    where they are on AMX tiles; larger ones (and unstacked experts) one expert at a time,
    dequantized for BLAS as `QuantMatrix.times` would. Either way a row gets the bits of its
    expert's own product (on the kernels, one row's)."""
    sizes = firsts[1:] - firsts[:-1]
    groups = experts[firsts[:-1]]
    most = 0
    if isinstance(matrices, ExpertStack):
        if sizes.max() <= KERNEL_ROWS:  # a decode step's groups: the kernels take them all
            return matrices.times_grouped(x, groups, firsts, rows)
        most = matrices.kernel_rows
    in_kernel = sizes <= most
    if in_kernel.all():
        return matrices.times_grouped(x, groups, firsts, rows)
    xs = x if rows is None else x[rows]
    out = np.empty((len(xs), len(matrices[0])), np.float32)
    if in_kernel.any():
        taken = np.repeat(in_kernel, sizes)
        ends = np.cumsum(sizes[in_kernel])
        out[taken] = matrices.times_grouped(xs[taken], groups[in_kernel], np.concatenate(([0], ends)))
    for group in np.flatnonzero(~in_kernel).tolist():
        span = slice(firsts[group], firsts[group + 1])
        out[span] = ops.linear(xs[span], matrices[int(groups[group])])
    return out
