"""A decode step's plain layer halves as compiled calls: the attention half (RMSNorm, the fused QKV
product, Qwen3's q/k norms, the attention over one cache (`row_attention_kernel`'s over float32,
`block_attention_kernel`'s over a q8_0 / q4_0 / f16 cache's rows), the output
projection, the residual add) and the FFN half (RMSNorm, the fused gate/up product, SiLU times up, the down
product, the residual add), their products on `int8_kernels`.

In Python each half is a dozen calls, each product's through three wrappers and Numba's dispatch
(about 5 us), the norm's, SwiGLU's six NumPy passes and the adds: at a decode step's one row that
Python costs more than the arithmetic between the products (figures: docs/PERFORMANCE.md,
measurements behind code choices). A product's matrix is a tuple of parts, each its
`int8_kernels._times` arguments `(q, scale, offset, supers, nibbles, superblocks)`: one part for a
`QuantMatrix`, one a part for a `MatrixStack` (Q4_K_M's Q/K/V: Q4_K and Q6_K). The products, norms
and attention are the same compiled functions the Python path calls (SwiGLU too: `ops.silu_mul`
runs this module's `silu_mul`), in the same order, so a row gets the same bits either way.
"""

from __future__ import annotations

import numpy as np
from numba import literal_unroll, njit, types
from numba.extending import overload

from lmserve.engine_cpu import block_attention_kernel, row_attention_kernel
from lmserve.engine_cpu.int8_kernels import _times
from lmserve.engine_cpu.norm_kernel import rms_norm
from lmserve.engine_cpu.softmax_kernel import _FAST, _exp


@njit(cache=True, nogil=True)
def attention_half(h, norm, eps, qkv, o, heads, q_norm, k_norm, cos, sin, keys, values, start, scale, window,  # noqa: ANN001, ANN201, PLR0913
                   sinks, kind, factors):
    """`h` `[n, hidden]` += the attention of its rows at positions `start..start+n-1` (one cache's
    `keys` and `values`, the rows' written there: float32, or bytes of `block_attention_kernel`'s
    `kind` with q4_0's `factors`): `heads` is (query heads, KV heads, head size); `q_norm` and
    `k_norm` each head's RMSNorm weights (Qwen3), empty where the model has none."""
    n = h.shape[0]
    query_heads, kv_heads, head_dim = heads
    x = np.empty_like(h)
    rms_norm(h, norm, eps, x)
    projected = _stacked_times(x, qkv).reshape(n, query_heads + 2 * kv_heads, head_dim)
    if len(q_norm):
        _head_norm(projected[:, :query_heads], q_norm, eps)
        _head_norm(projected[:, query_heads:query_heads + kv_heads], k_norm, eps)
    mixed = np.empty((n, query_heads, head_dim), np.float32)
    _attend(projected[:, :query_heads + kv_heads], projected[:, query_heads + kv_heads:], cos, sin, keys, values,
            start, scale, window, sinks, kind, factors, mixed)
    h += _stacked_times(mixed.reshape(n, query_heads * head_dim), o)


def _attend(qk, v, cos, sin, keys, values, start, scale, window, sinks, kind, factors, out):  # noqa: ANN001, ANN202
    """The cache's `attend_rows`: `row_attention_kernel`'s for float32 `keys`, else
    `block_attention_kernel`'s (chosen when Numba types the call: `_attend_for`)."""
    raise NotImplementedError("compiled code only")


@overload(_attend)
def _attend_for(qk, v, cos, sin, keys, values, start, scale, window, sinks, kind, factors, out):  # noqa: ANN001, ANN202
    if keys.dtype == types.float32:
        def attend(qk, v, cos, sin, keys, values, start, scale, window, sinks, kind, factors, out):  # noqa: ANN001, ANN202, ARG001
            row_attention_kernel.attend_rows(qk, v, cos, sin, keys, values, start, scale, window, sinks, out)
        return attend

    def attend_blocks(qk, v, cos, sin, keys, values, start, scale, window, sinks, kind, factors, out):  # noqa: ANN001, ANN202
        block_attention_kernel.attend_rows(qk, v, cos, sin, keys, values, start, scale, window, sinks, kind, factors,
                                           out)
    return attend_blocks


@njit(cache=True, nogil=True)
def _stacked_times(x, parts):  # noqa: ANN001, ANN202
    """x times a matrix kept as a stack of `parts` (each `int8_kernels._times`' arguments), their
    outputs side by side, as `MatrixStack.times` does."""
    width = 0
    for part in literal_unroll(parts):
        width += part[0].shape[0]
    out = np.empty((x.shape[0], width), np.float32)
    column = 0
    for part in literal_unroll(parts):
        rows = part[0].shape[0]
        out[:, column:column + rows] = _times(x, *part)
        column += rows
    return out


@njit(cache=True, nogil=True)
def _head_norm(heads, weight, eps):  # noqa: ANN001, ANN202
    """RMSNorm of each head `[n, heads, head_dim]` in place, as `ops.rms_norm` computes it."""
    rows = np.ascontiguousarray(heads).reshape(-1, heads.shape[2])
    out = np.empty_like(rows)
    rms_norm(rows, weight, eps, out)
    heads[:] = out.reshape(heads.shape)


@njit(cache=True, nogil=True)
def ffn_half(h, norm, eps, gate_up, down):  # noqa: ANN001, ANN201
    """`h` `[n, hidden]` += its SwiGLU FFN."""
    x = np.empty_like(h)
    rms_norm(h, norm, eps, x)
    both = _stacked_times(x, gate_up)
    hidden = np.empty((h.shape[0], both.shape[1] // 2), np.float32)
    silu_mul(both, hidden)
    h += _stacked_times(hidden, down)


@njit(fastmath=_FAST, error_model="numpy", cache=True, nogil=True)
def silu_mul(both, out):  # noqa: ANN001, ANN201
    """`out` = silu(gate) * up for rows of gate then up: `gate * sigmoid(gate) * up`, the sigmoid
    from `softmax_kernel._exp` of `-|gate|`, which never overflows. It vectorizes (NumPy's error
    model: Python's checks each division for zero, which kept the loop scalar): 0.4 ns an element
    where libm's `tanhf` took 10 and NumPy's six passes 1.2. `ops.silu_mul` runs it for every row
    count, so a row gets the same bits in a decode step, a verify pass or a prompt chunk."""
    half = out.shape[1]
    for r in range(out.shape[0]):
        gates, ups, row = both[r, :half], both[r, half:], out[r]
        for i in range(half):
            gate = gates[i]
            e = _exp(-abs(gate))
            sigmoid = np.float32(1.0) / (np.float32(1.0) + e)
            row[i] = gate * (sigmoid if gate >= 0 else e * sigmoid) * ups[i]
