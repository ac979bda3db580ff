"""The NumPy building blocks of the forward pass, all in float32."""

from __future__ import annotations

import numpy as np

from lmserve.model.families import GELU_TANH, SILU, SWIGLU_OAI

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


def gelu_tanh_mul(gate_up: np.ndarray) -> np.ndarray:
    """GeGLU (Gemma): gelu(gate) * up with GELU's tanh approximation (`gelu_pytorch_tanh`)."""
    gate, up = np.split(gate_up, 2, axis=-1)
    inner = gate * (np.float32(1) + np.float32(0.044715) * gate * gate) * np.float32(np.sqrt(2 / np.pi))
    return gate * (np.tanh(inner) + np.float32(1)) * np.float32(0.5) * up


OAI_ALPHA, OAI_LIMIT = np.float32(1.702), np.float32(7.0)  # gpt-oss's swiglu_alpha and swiglu_limit


def swiglu_oai_mul(gate_up: np.ndarray) -> np.ndarray:
    """gpt-oss's clamped SwiGLU (Hugging Face's GptOssExperts): gate = min(gate, 7),
    up = clip(up, -7, 7), gate * sigmoid(1.702 * gate) * (up + 1)."""
    gate, up = np.split(gate_up, 2, axis=-1)
    gate = np.minimum(gate, OAI_LIMIT)
    up = np.clip(up, -OAI_LIMIT, OAI_LIMIT)
    sigmoid = (np.tanh(gate * (OAI_ALPHA * np.float32(0.5))) + np.float32(1)) * np.float32(0.5)
    return gate * sigmoid * (up + np.float32(1))


GATED_ACTIVATIONS = {SILU: silu_mul, GELU_TANH: gelu_tanh_mul, SWIGLU_OAI: swiglu_oai_mul}


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin `[n, 1, rotary_dims // 2]` for each row's position (computed in float64),
    times `scale` (YaRN's attention factor)."""
    angles = np.outer(positions, inv_freq)[:, None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.astype(np.float32), sin.astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate `[n, heads, head_dim]` by pairing dimension i with i + rotary_dims/2 (NeoX style);
    with partial rotary (tables shorter than half a head) the remaining dimensions pass through."""
    rotary = 2 * cos.shape[-1]
    if rotary < x.shape[-1]:
        return np.concatenate([rope(x[..., :rotary], cos, sin), x[..., rotary:]], axis=-1)
    first, second = np.split(x, 2, axis=-1)
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, scale: float,
              window: int = 0, sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal attention of `n` new queries at positions `start..start+n-1`.

    q: `[n, heads, head_dim]`; keys, values: `[kv_heads, start + n, head_dim]`, with the new
    positions already written. Query head h reads KV head h // (heads // kv_heads). Scores are
    scaled by `scale`. `window`: a query at position p sees keys in (p - window, p] only (sliding
    window; 0: all). `sinks` `[heads]`: one logit per head that joins the softmax's denominator
    and nothing else (gpt-oss). Returns `[n, heads * head_dim]`.
    """
    n, n_heads, head_dim = q.shape
    kv_heads, total, _ = keys.shape
    first = max(0, start - window + 1) if window else 0  # no query here sees a key before it
    if first:
        keys, values = keys[:, first:], values[:, first:]
    seen = total - first
    group = n_heads // kv_heads
    # [kv_heads, group * n, head_dim]: each KV head's query rows in one matrix product.
    qg = q.reshape(n, kv_heads, group, head_dim).transpose(1, 2, 0, 3).reshape(kv_heads, group * n, head_dim)
    scores = qg @ keys.transpose(0, 2, 1)
    scores *= np.float32(scale)
    if n > 1:
        key_pos, query_pos = np.arange(first, total)[None, :], np.arange(start, start + n)[:, None]
        hidden = key_pos > query_pos
        if window:
            hidden |= key_pos <= query_pos - window
        scores.reshape(kv_heads, group, n, seen)[:, :, hidden] = -np.inf
    peak = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = np.repeat(sinks.reshape(kv_heads, group, 1), n, axis=2).reshape(kv_heads, group * n, 1)
        peak = np.maximum(peak, sink)
    scores -= peak
    np.exp(scores, out=scores)
    denominator = scores.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denominator += np.exp(sink - peak)
    scores /= denominator
    out = scores @ values  # [kv_heads, group * n, head_dim]
    return out.reshape(kv_heads, group, n, head_dim).transpose(2, 0, 1, 3).reshape(n, n_heads * head_dim)
