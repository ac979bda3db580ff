"""The NumPy building blocks of the forward pass, all in float32."""

from __future__ import annotations

import numpy as np

# Up to this many rows, one matrix-vector product per row beats one matrix product: OpenBLAS's
# GEMM reads the weights markedly slower for 2-3 rows (measured on SmolLM2 shapes, 2 cores).
GEMV_ROWS = 3


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """`x [n, in]` times `w [out, in]` transposed, in the order measured fastest for `n`."""
    if len(x) == 1:
        return (w @ x[0])[None]
    if len(x) <= GEMV_ROWS:
        return np.stack([w @ row for row in x])
    return (w @ x.T).T


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis."""
    scale = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    scale += np.float32(eps)
    return x / np.sqrt(scale) * weight


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """SwiGLU: silu(gate) * up for `[n, 2 * ffn]` rows of gate then up. The tanh form of the
    sigmoid never overflows, so large negative gates raise no warnings."""
    gate, up = np.split(gate_up, 2, axis=-1)
    return gate * (np.tanh(gate * np.float32(0.5)) + np.float32(1)) * np.float32(0.5) * up


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin `[n, 1, head_dim // 2]` for each row's position (computed in float64)."""
    angles = np.outer(positions, inv_freq)[:, None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate `[n, heads, head_dim]` by pairing dimension i with i + head_dim/2 (NeoX style)."""
    first, second = np.split(x, 2, axis=-1)
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int) -> np.ndarray:
    """Causal attention of `n` new queries at positions `start..start+n-1`.

    q: `[n, heads, head_dim]`; keys, values: `[kv_heads, start + n, head_dim]`, with the new
    positions already written. Query head h reads KV head h // (heads // kv_heads).
    Returns `[n, heads * head_dim]`.
    """
    n, n_heads, head_dim = q.shape
    kv_heads, total, _ = keys.shape
    group = n_heads // kv_heads
    # [kv_heads, group * n, head_dim]: each KV head's query rows in one matrix product.
    qg = q.reshape(n, kv_heads, group, head_dim).transpose(1, 2, 0, 3).reshape(kv_heads, group * n, head_dim)
    scores = qg @ keys.transpose(0, 2, 1)
    scores *= np.float32(1 / np.sqrt(head_dim))
    if n > 1:
        future = np.arange(total)[None, :] > np.arange(start, start + n)[:, None]
        scores.reshape(kv_heads, group, n, total)[:, :, future] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores @ values  # [kv_heads, group * n, head_dim]
    return out.reshape(kv_heads, group, n, head_dim).transpose(2, 0, 1, 3).reshape(n, n_heads * head_dim)
