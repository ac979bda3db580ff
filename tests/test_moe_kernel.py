"""The compiled MoE routing (`moe_kernel.route`, `router_logits`) against the NumPy forms it
replaced where Numba is: the same experts chosen (ties to the lower index, as a stable argsort)
and the same weights to float32 rounding."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from lmserve.engine_cpu import moe, ops

pytestmark = [pytest.mark.fast,
              pytest.mark.skipif(sys.platform == "darwin", reason="numba is not installed on macOS (MLX serves)")]


@pytest.mark.parametrize("topk_softmax", [False, True])
@pytest.mark.parametrize(("rows", "experts", "k"), [(1, 8, 2), (4, 32, 4), (300, 128, 8)])
def test_the_compiled_route_picks_the_numpy_forms_experts_and_weights(rows: int, experts: int, k: int,
                                                                      topk_softmax: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(rows)
    logits = rng.standard_normal((rows, experts)).astype(np.float32) * 3
    logits[:, 1] = logits[:, 0]  # a tie in every row: the lower index goes first
    chosen, weights = moe._route(logits, k, topk_softmax)
    monkeypatch.setattr(ops, "compiled", lambda _name: None)
    want_chosen, want_weights = moe._route(logits, k, topk_softmax)
    np.testing.assert_array_equal(chosen, want_chosen)
    np.testing.assert_allclose(weights, want_weights, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)


def test_a_decode_steps_router_logits_are_the_product(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    x, router = rng.standard_normal((3, 1024)).astype(np.float32), rng.standard_normal((32, 1024)).astype(np.float32)
    got = moe._router_logits(x, router)
    monkeypatch.setattr(ops, "compiled", lambda _name: None)
    np.testing.assert_allclose(got, moe._router_logits(x, router), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("rows", "experts", "k"), [(1, 8, 2), (5, 32, 4), (300, 128, 8)])
def test_the_compiled_weighted_sum_of_experts_has_the_numpy_passes_bits(rows: int, experts: int, k: int,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row's experts' outputs, scaled by their weights and added in the experts' order, in
    one compiled pass (`moe_kernel.add_weighted`) as in NumPy's scale, gather and sum; the
    300-row case's rows split between the CPUs (`ops.in_parts`) where there are two."""
    rng = np.random.default_rng(rows)
    chosen = np.stack([rng.choice(experts, k, replace=False) for _ in range(rows)])
    weights = rng.dirichlet(np.ones(k), rows).astype(np.float32)
    outputs = (rng.standard_normal((rows * k, 96)) * 10.0 ** rng.integers(-3, 4, (rows * k, 96))).astype(np.float32)
    monkeypatch.setattr(moe, "_expert_outputs", lambda *_args: outputs.copy())
    x = np.zeros((rows, 96), np.float32)
    got = moe._experts(x, None, chosen, weights, None)
    monkeypatch.setattr(ops, "compiled", lambda _name: None)
    want = moe._experts(x, None, chosen, weights, None)
    np.testing.assert_array_equal(got, want)
    order = np.argsort(chosen.ravel(), kind="stable")
    by_hand = np.zeros((rows, 96), np.float64)
    for i, pair in enumerate(order):
        by_hand[pair // k] += outputs[i].astype(np.float64) * weights.ravel()[pair]
    np.testing.assert_allclose(got, by_hand, rtol=1e-5, atol=1e-5 * np.abs(by_hand).max())
