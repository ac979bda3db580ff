"""Gated DeltaNet, the linear-attention layers of Qwen3.5 / 3.6, in NumPy.

Each value head keeps a `head_k_dim x head_v_dim` state S. For every token, with its L2-normalized
key k and query q (q scaled by head_k_dim^-0.5), its value v, log-decay g < 0 and learning rate
beta (transformers' torch_recurrent_gated_delta_rule):

    S = exp(g) S;    S += k (beta (v - S^T k))^T;    out = S^T q

A decode step runs that once per sequence (`step`). A prompt runs transformers' chunked form
(`chunked`, torch_chunk_gated_delta_rule): within a chunk of up to 64 tokens the updates are
solved together through one triangular system (the UT transform), so a 256-token chunk is a few
matrix products per 64 tokens rather than 256 Python steps; both give the same outputs and state
up to rounding. Before the rule, a depthwise causal convolution (SiLU after it) runs over the
fused q/k/v projection, its state the last kernel - 1 inputs; after it, a gated RMSNorm
(norm(out) * w * silu(z)) and the output projection.

GGUF conventions (llama.cpp's converter): value heads are tiled when there are fewer key heads
(value head j reads key head j % k_heads), `ssm_a` is -exp(A_log), so g = ssm_a * softplus(alpha +
dt_bias), and beta = sigmoid(b).

Every state this makes is a new array (nothing is updated in place once returned), so the states
a cache keeps as checkpoints are references.
"""

from __future__ import annotations

import numpy as np

from lmserve.engine_cpu import ops
from lmserve.engine_cpu.batch import Batch
from lmserve.engine_cpu.weights import DeltaNetWeights
from lmserve.model.config import LinearAttention

CHUNK = 64  # tokens solved together (transformers' chunk_size)
L2_EPS = 1e-6  # the FLA library's l2norm epsilon, as transformers and llama.cpp use it


def mix(x: np.ndarray, w: DeltaNetWeights, batch: Batch, layer: int, la: LinearAttention, eps: float) -> np.ndarray:
    """The layer's output `[n, hidden]` for the normalized rows `x` `[n, hidden]`. Projections run
    on all rows at once; the convolution and the recurrence per cache, on its kept rows only (a
    verify pass's padding reaches no state, and its rows' outputs are zero), and each cache's
    state for `layer` is replaced by the new one."""
    n = len(x)
    hv, dv = la.v_heads, la.head_v_dim
    proj = ops.linear(x, w.in_proj)
    mixed, z = proj[:, :la.conv_dim], proj[:, la.conv_dim:]
    ba = ops.linear(x, w.ba)
    beta = ops.sigmoid(ba[:, :hv])
    g = w.a * np.logaddexp(np.float32(0), ba[:, hv:] + w.dt_bias)  # a * softplus(alpha + dt_bias)
    out = np.zeros((n, hv, dv), dtype=np.float32)
    for s in batch.spans:
        rows = slice(s.lo, s.lo + s.real)
        window, state = s.cache.state.get(layer, (None, None))
        convolved, window = conv(mixed[rows], window, w.conv)
        q, k, v = split_heads(convolved, la)
        rule = step if s.real == 1 else chunked
        out[rows], state = rule(q, k, v, g[rows], beta[rows], state)
        s.cache.state[layer] = (window, state)
    normed = ops.rms_norm(out, w.norm, eps)
    gate = z.reshape(n, hv, dv)
    normed *= gate * ops.sigmoid(gate)  # silu(z)
    return ops.linear(normed.reshape(n, hv * dv), w.out)


def conv(x: np.ndarray, window: np.ndarray | None, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal convolution of `x` `[t, channels]` after `window` (the previous kernel - 1
    inputs; None: zeros, a sequence's start), then SiLU: (the outputs `[t, channels]`, the new
    window). `weight` `[channels, kernel]`: tap j multiplies the input j - (kernel - 1) steps back."""
    taps = weight.shape[1]
    if window is None:
        window = np.zeros((taps - 1, len(weight)), dtype=np.float32)
    t = len(x)
    padded = np.concatenate([window, x])
    y = padded[:t] * weight[:, 0]
    for j in range(1, taps):
        y += padded[j:j + t] * weight[:, j]
    return y * ops.sigmoid(y), padded[t:].copy()


def l2norm(x: np.ndarray) -> np.ndarray:
    """x / sqrt(sum(x^2) + 1e-6) over the last axis."""
    return x / np.sqrt(np.add.reduce(np.square(x), axis=-1, keepdims=True) + np.float32(L2_EPS))


def split_heads(convolved: np.ndarray, la: LinearAttention) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The convolution's channels as the rule's q and k `[t, v_heads, head_k_dim]` (normalized,
    q scaled, key heads tiled over the value heads) and v `[t, v_heads, head_v_dim]`."""
    t, keys = len(convolved), la.k_heads * la.head_k_dim
    q = l2norm(convolved[:, :keys].reshape(t, la.k_heads, la.head_k_dim)) * np.float32(la.head_k_dim ** -0.5)
    k = l2norm(convolved[:, keys:2 * keys].reshape(t, la.k_heads, la.head_k_dim))
    tiles = (1, la.v_heads // la.k_heads, 1)
    v = convolved[:, 2 * keys:].reshape(t, la.v_heads, la.head_v_dim)
    return np.tile(q, tiles), np.tile(k, tiles), v


def step(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
         state: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """One token (a decode step): q, k `[1, heads, k_dim]`, v `[1, heads, v_dim]`, g and beta
    `[1, heads]`, the state `[heads, k_dim, v_dim]` before it (None: zeros). Returns (the output
    `[1, heads, v_dim]`, the new state)."""
    q, k, v, g, beta = q[0], k[0], v[0], g[0], beta[0]
    if state is None:
        state = np.zeros((len(k), k.shape[1], v.shape[1]), dtype=np.float32)
    state = state * np.exp(g)[:, None, None]  # a new array: the old state is a snapshot
    memory = np.matmul(k[:, None, :], state)[:, 0]  # S^T k: what the state recalls for k
    delta = (v - memory) * beta[:, None]
    state += k[:, :, None] * delta[:, None, :]
    return np.matmul(q[:, None, :], state)[:, 0][None], state


def chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
            state: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """`t` tokens at once, as `step` would run them one by one: q, k `[t, heads, k_dim]`, v
    `[t, heads, v_dim]`, g and beta `[t, heads]`; returns (the outputs `[t, heads, v_dim]`, the
    state after the last token). Chunks of CHUNK tokens (the last padded with tokens of beta 0,
    decay 1, which change nothing), each solved by matrix products, then a scan over the chunks."""
    t, heads, k_dim = k.shape
    v_dim = v.shape[-1]
    size = min(CHUNK, t)
    chunks = -(-t // size)
    pad = ((0, 0), (0, chunks * size - t))

    def by_chunk(x: np.ndarray) -> np.ndarray:  # [t, heads, d] -> [heads, chunks, size, d]
        return np.pad(x.transpose(1, 0, 2), (*pad, (0, 0))).reshape(heads, chunks, size, -1)

    q, k, v = by_chunk(q), by_chunk(k), by_chunk(v)
    g, beta = (np.pad(x.T, pad).reshape(heads, chunks, size) for x in (g, beta))
    decay = np.cumsum(g, axis=-1)  # log of the decay from each chunk's start to each token
    causal = np.tril(np.ones((size, size), dtype=bool))
    pairwise = np.exp(np.where(causal, decay[..., :, None] - decay[..., None, :], -np.inf))  # token j -> i
    k_beta = k * beta[..., None]
    keys_t = k.swapaxes(-1, -2)
    # The UT transform: (I + strictly lower part of (beta k k^T) * decay) solves for the chunk's
    # corrected values and for the decayed keys that read the state from before the chunk.
    system = np.tril((k_beta @ keys_t) * pairwise, -1) + np.eye(size, dtype=np.float32)
    rhs = np.concatenate([v * beta[..., None], k_beta * np.exp(decay)[..., None]], axis=-1)
    solved = np.linalg.solve(system, rhs)
    values, keys_decayed = solved[..., :v_dim], solved[..., v_dim:]
    intra = (q @ keys_t) * pairwise
    queries = q * np.exp(decay)[..., None]
    keys_to_end = (k * np.exp(decay[..., -1:] - decay)[..., None]).swapaxes(-1, -2)
    chunk_decay = np.exp(decay[..., -1])[..., None, None]  # [heads, chunks, 1, 1]
    if state is None:
        state = np.zeros((heads, k_dim, v_dim), dtype=np.float32)
    out = np.empty((heads, chunks, size, v_dim), dtype=np.float32)
    for c in range(chunks):
        new = values[:, c] - keys_decayed[:, c] @ state
        out[:, c] = queries[:, c] @ state + intra[:, c] @ new
        state = state * chunk_decay[:, c] + keys_to_end[:, c] @ new
    return out.reshape(heads, chunks * size, v_dim)[:, :t].transpose(1, 0, 2), state
