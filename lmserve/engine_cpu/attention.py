"""One attention layer over a pass: projections, q/k (and Gemma 4's v) norms, rotary embedding,
each cache's keys and values written and attended to, the output gate and projection.

Q, K and V come from one fused matrix (one product a step). Qwen3.5's q_proj emits each head's
query and then its gate (llama.cpp keeps that layout in `attn_q`); the attention output is times
sigmoid(gate). Gemma 4's global layers have no V projection: their values are the K projection
before its norm and rotation, RMS-normalized without a weight, as all of Gemma 4's values are.
"""

from __future__ import annotations

import numpy as np

from lmserve.engine_cpu import ops
from lmserve.engine_cpu.batch import Batch, Span
from lmserve.engine_cpu.weights import AttentionWeights


def attend(x: np.ndarray, a: AttentionWeights, batch: Batch, layer: int,
           rope: tuple[np.ndarray, np.ndarray], scale: float, eps: float) -> np.ndarray:
    """The layer's output `[n, hidden]` for the normalized rows `x` `[n, hidden]`; appends the
    rows' keys and values to each cache (room is reserved already). `rope`: the cos and sin
    tables of the rows' positions."""
    n = len(x)
    nq, nkv, hd = a.heads
    qkv = ops.linear(x, a.qkv)
    if a.qkv_bias is not None:
        qkv += a.qkv_bias
    heads = qkv.reshape(n, -1, hd)
    gate = None
    if a.output_gate:  # each query head's rows: its query, then its gate
        gate = heads[:, 1:2 * nq:2].reshape(n, nq * hd)
        heads = np.concatenate([heads[:, 0:2 * nq:2], heads[:, 2 * nq:]], axis=1)
    # Values are taken before the keys are normalized in place: Gemma 4's K rows are its values,
    # which its value norm then makes a new array of.
    v = heads[:, nq:nq + nkv] if a.values_from_keys else heads[:, nq + nkv:]
    if a.value_norm:
        v = ops.rms_norm(v, None, eps)
    if a.q_norm is not None and a.k_norm is not None:
        heads[:, :nq] = ops.rms_norm(heads[:, :nq], a.q_norm, eps)
        heads[:, nq:nq + nkv] = ops.rms_norm(heads[:, nq:nq + nkv], a.k_norm, eps)
    out = np.empty((n, nq * hd), dtype=np.float32)
    if _in_one_call(batch, nq // nkv):
        blocks = stored_blocks(batch)
        for s in batch.spans:
            ops.attend_rows(heads[s.lo:s.hi, :nq + nkv], v[s.lo:s.hi], rope[0][s.lo:s.hi], rope[1][s.lo:s.hi],
                            s.cache.k[layer], s.cache.v[layer], s.start, scale, a.window, a.sinks,
                            out[s.lo:s.hi].reshape(-1, nq, hd), blocks)
    elif _rotates_in_one_pass(batch):
        for s in batch.spans:
            _attend_float_cache(heads[s.lo:s.hi], v[s.lo:s.hi], a, s, layer, (rope[0][s.lo:s.hi], rope[1][s.lo:s.hi]),
                                scale, batch.scratch, out[s.lo:s.hi])
    else:
        _attend_spans(heads, v, a, batch, layer, rope, scale, out)
    if gate is not None:
        out *= ops.sigmoid(gate)
    out = ops.linear(out, a.o)
    if a.o_bias is not None:
        out += a.o_bias
    return out


def stored_blocks(batch: Batch) -> str | None:
    """The `--kv-type` of the pass's caches where `ops.attend_rows` reads their stored rows as
    `blocks` (q8_0, q4_0, f16), None for float32 ones (a pass's caches are all the engine's type)."""
    codec = batch.spans[0].cache.codec
    return None if codec.dtype == np.float32 else codec.type.name


def _in_one_call(batch: Batch, group: int) -> bool:
    """Whether `ops.attends_in_one_call` takes the pass."""
    positions = max(s.start for s in batch.spans) + batch.width
    return ops.attends_in_one_call(batch.width * group, positions, stored_blocks(batch))


def _rotates_in_one_pass(batch: Batch) -> bool:
    """Whether every cache of the pass is float32 and `row_attention_kernel` is compiled here."""
    return (all(s.cache.codec.dtype == np.float32 for s in batch.spans)
            and ops.compiled("row_attention_kernel") is not None)


def _attend_float_cache(heads: np.ndarray, v: np.ndarray, a: AttentionWeights, s: Span, layer: int,
                        rope: tuple[np.ndarray, np.ndarray], scale: float, scratch: ops.Scratch,
                        out: np.ndarray) -> None:
    """One float32 cache's rows (`heads` `[n, heads, head_dim]`, `v`) attended into `out` `[n,
    heads * head_dim]`: rotated, written into the cache and laid out for the products in one
    compiled pass (`rope_rows`, a prompt pass's rows split between the CPUs), where NumPy took
    four passes for the rotation, two for the cache's writes and one more for the layout."""
    nq, nkv, hd = a.heads
    n, group = len(heads), nq // nkv
    keys, values = s.cache.k[layer], s.cache.v[layer]
    qg = np.empty((nkv, n, group, hd), np.float32)
    rotate, qk, (cos, sin) = ops.compiled("row_attention_kernel").rope_rows, heads[:, :nq + nkv], rope
    ops.in_parts(lambda lo, hi: rotate(qk[lo:hi], v[lo:hi], cos[lo:hi], sin[lo:hi], keys, values, s.start + lo,
                                       qg[:, lo:hi], True), n, qk.size, ops.THREADED_ROWS)
    end = s.start + n
    first = max(0, s.start - a.window + 1) if a.window else 0  # only the positions some row sees
    mixed = ops.grouped_attention(qg.reshape(nkv, n * group, hd), n, keys[:, first:end], values[:, first:end],
                                  s.start - first, scale, a.window, a.sinks, scratch)
    out.reshape(n, nkv, group, hd)[:] = mixed.reshape(nkv, n, group, hd).transpose(1, 0, 2, 3)


def _attend_spans(heads: np.ndarray, v: np.ndarray, a: AttentionWeights, batch: Batch, layer: int,
                  rope: tuple[np.ndarray, np.ndarray], scale: float, out: np.ndarray) -> None:
    """Each cache's rows rotated, written and attended in NumPy (a quantized cache's read back
    into float32), into `out` `[n, heads * head_dim]`."""
    nq, nkv, hd = a.heads
    qk = ops.rope(heads[:, :nq + nkv], *rope)  # Q and K in one pass
    q, k = qk[:, :nq], qk[:, nq:]
    for s in batch.spans:
        end = s.start + batch.width
        keys, values, codec = s.cache.k[layer], s.cache.v[layer], s.cache.codec
        keys[:, s.start:end] = codec.encode(k[s.lo:s.hi].transpose(1, 0, 2))
        values[:, s.start:end] = codec.encode(v[s.lo:s.hi].transpose(1, 0, 2))
        # Only the positions some row of the pass can see are read back (a sliding window's).
        # A quantized cache holds them in a turned basis: the query turns the same way, the output back.
        first = max(0, s.start - a.window + 1) if a.window else 0
        keys, values = codec.decode(keys[:, first:end]), codec.decode(values[:, first:end])
        mixed = ops.attention(codec.turn(q[s.lo:s.hi]), keys, values, s.start - first, scale, a.window, a.sinks,
                              batch.scratch)
        out[s.lo:s.hi] = codec.unturn(mixed.reshape(-1, nq, hd)).reshape(-1, nq * hd)
