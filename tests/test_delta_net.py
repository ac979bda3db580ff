"""The NumPy engine's Gated DeltaNet (engine_cpu/delta_net.py) against the rule written out: the
chunked form a prompt runs equals the step form decode runs, both equal the gated delta rule
token by token in float64, the convolution carries its window across pieces, and no state given
to them is changed in place (the cache keeps them as checkpoints by reference)."""

from __future__ import annotations

import numpy as np
import pytest

from lmserve.engine_cpu import delta_net
from lmserve.model.config import LinearAttention

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

HEADS, K_DIM, V_DIM = 4, 16, 8


def inputs(t: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """q, k (normalized, q scaled), v, g < 0 and beta in (0, 1) for `t` tokens."""
    rng = np.random.default_rng(seed)
    q = delta_net.l2norm(rng.standard_normal((t, HEADS, K_DIM), dtype=np.float32)) * np.float32(K_DIM ** -0.5)
    k = delta_net.l2norm(rng.standard_normal((t, HEADS, K_DIM), dtype=np.float32))
    v = rng.standard_normal((t, HEADS, V_DIM), dtype=np.float32)
    g = -rng.uniform(0.01, 2.0, (t, HEADS)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (t, HEADS)).astype(np.float32)
    return q, k, v, g, beta


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
              state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule one token and one head at a time, in float64:
    S = exp(g) S; S += k (beta (v - S^T k))^T; out = S^T q."""
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape)
    for t in range(len(q)):
        for h in range(HEADS):
            s[h] *= np.exp(g[t, h])
            s[h] += np.outer(k[t, h], beta[t, h] * (v[t, h] - s[h].T @ k[t, h]))
            out[t, h] = s[h].T @ q[t, h]
    return out, s


@pytest.mark.parametrize("t", [2, 7, 64, 65, 130])  # one chunk, a full one, a padded second, three
def test_chunked_form_equals_step_by_step_and_the_rule(t: int) -> None:
    q, k, v, g, beta = inputs(t)
    start = np.random.default_rng(1).standard_normal((HEADS, K_DIM, V_DIM), dtype=np.float32)
    want_out, want_state = reference(q, k, v, g, beta, start)
    got_out, got_state = delta_net.chunked(q, k, v, g, beta, start)
    state, steps = start, []
    for i in range(t):
        out, state = delta_net.step(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], state)
        steps.append(out)
    for out, final in ((got_out, got_state), (np.concatenate(steps), state)):
        assert out.dtype == final.dtype == np.float32
        np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(final, want_state, rtol=1e-4, atol=1e-5)


def test_an_empty_state_is_zeros() -> None:
    q, k, v, g, beta = inputs(9)
    zeros = np.zeros((HEADS, K_DIM, V_DIM), np.float32)
    one = tuple(x[:1] for x in (q, k, v, g, beta))
    for got, want in ((delta_net.chunked(q, k, v, g, beta, None), delta_net.chunked(q, k, v, g, beta, zeros)),
                      (delta_net.step(*one, None), delta_net.step(*one, zeros))):
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_no_state_is_changed_in_place() -> None:
    """A cache keeps states as checkpoints by reference: the rule must make new arrays."""
    q, k, v, g, beta = inputs(5)
    start = np.random.default_rng(2).standard_normal((HEADS, K_DIM, V_DIM), dtype=np.float32)
    kept = start.copy()
    window = np.ones((3, 6), np.float32)
    for _, state in (delta_net.chunked(q, k, v, g, beta, start),
                     delta_net.step(q[:1], k[:1], v[:1], g[:1], beta[:1], start)):
        assert state is not start
    delta_net.conv(np.ones((2, 6), np.float32), window, np.ones((6, 4), np.float32))
    np.testing.assert_array_equal(start, kept)
    np.testing.assert_array_equal(window, 1)


def test_the_convolution_carries_its_window() -> None:
    """Convolving in pieces, each after the window the last one left, gives the whole's outputs;
    the first piece starts from zeros (the sequence's start)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((11, 6), dtype=np.float32)
    weight = rng.standard_normal((6, 4), dtype=np.float32)
    whole, last = delta_net.conv(x, None, weight)
    padded = np.concatenate([np.zeros((3, 6)), x])
    y = sum(padded[j:j + 11] * weight[:, j] for j in range(4))
    np.testing.assert_allclose(whole, y / (1 + np.exp(-y)), rtol=1e-5, atol=1e-6)  # SiLU
    pieces, window = [], None
    for part in (x[:4], x[4:5], x[5:]):
        out, window = delta_net.conv(part, window, weight)
        pieces.append(out)
    np.testing.assert_allclose(np.concatenate(pieces), whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(window, last)
    np.testing.assert_array_equal(last, x[-3:])


def test_key_heads_are_tiled_over_the_value_heads() -> None:
    """GGUF orders value heads so that value head j reads key head j % k_heads (llama.cpp's
    broadcast), and the query is scaled by head_k_dim^-0.5 after its L2 norm."""
    la = LinearAttention(conv_kernel=4, k_heads=2, v_heads=6, head_k_dim=4, head_v_dim=3)
    rng = np.random.default_rng(4)
    convolved = rng.standard_normal((5, la.conv_dim), dtype=np.float32)
    q, k, v = delta_net.split_heads(convolved, la)
    assert q.shape == k.shape == (5, 6, 4) and v.shape == (5, 6, 3)
    raw_q = convolved[:, :8].reshape(5, 2, 4)
    for j in range(6):
        np.testing.assert_allclose(q[:, j], raw_q[:, j % 2] / np.linalg.norm(raw_q[:, j % 2], axis=-1,
                                                                               keepdims=True) / 2, rtol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(k, axis=-1), 1, rtol=1e-5)
    np.testing.assert_array_equal(v, convolved[:, 16:].reshape(5, 6, 3))
