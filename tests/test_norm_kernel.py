"""The compiled RMSNorm (`norm_kernel`) gives exactly the bits of the NumPy form macOS runs: the
fidelity tests' counts were measured with those, and a decode step's norms now run compiled."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from lmserve.engine_cpu import ops

pytestmark = [pytest.mark.fast,
              pytest.mark.skipif(sys.platform == "darwin", reason="numba is not installed on macOS (MLX serves)")]

# Row widths on both sides of NumPy's pairwise-summation cases: under 8 values, one run of up to
# 128, halves of runs (576: SmolLM2's hidden size), and a deep tree of halves.
WIDTHS = (5, 8, 64, 100, 128, 129, 576, 1000, 2880, 100_000)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no weight"])
def test_compiled_norm_has_the_numpy_forms_bits(width: int, weighted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(width)
    x = (rng.standard_normal((3, 2, width)) * rng.uniform(0.01, 100, (3, 2, 1))).astype(np.float32)
    weight = rng.standard_normal(width).astype(np.float32) if weighted else None
    compiled = ops.rms_norm(x, weight, 1e-6)
    monkeypatch.setattr(ops, "_compiled_norm", lambda: None)
    numpy = ops.rms_norm(x, weight, 1e-6)
    assert compiled.shape == x.shape and compiled.dtype == np.float32
    assert np.array_equal(compiled, numpy)


def test_a_row_that_is_not_finite_gives_nan_and_leaves_the_others_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(0).standard_normal((4, 576)).astype(np.float32)
    x[1, 7], x[2, 300] = np.inf, np.nan
    x[3] = 0.0
    weight = np.linspace(0.5, 1.5, 576, dtype=np.float32)
    compiled = ops.rms_norm(x, weight, 1e-5)
    monkeypatch.setattr(ops, "_compiled_norm", lambda: None)
    with np.errstate(invalid="ignore"):  # NumPy says inf / inf is NaN; so does the kernel, silently
        numpy = ops.rms_norm(x, weight, 1e-5)
    assert np.array_equal(compiled, numpy, equal_nan=True)
    assert np.isnan(compiled[1:3]).any(axis=1).all() and np.isfinite(compiled[[0, 3]]).all()


@pytest.mark.parametrize("parts", [2, 3])
def test_a_prompt_passs_norms_and_swiglu_split_between_threads_have_the_bits_of_one(
        parts: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt pass's rows (past THREADED_ROWS values) run a range on each CPU (`ops.in_parts`);
    each row comes out as in one call."""
    rng = np.random.default_rng(parts)
    x = rng.standard_normal((37, 576)).astype(np.float32)
    weight = rng.standard_normal(576).astype(np.float32)
    whole = ops.rms_norm(x, weight, 1e-5), ops.silu_mul(x)
    calls = []
    monkeypatch.setattr(ops, "THREADED_ROWS", 1)
    monkeypatch.setattr(ops, "_cpus", lambda: parts)
    monkeypatch.setattr(ops, "_helpers", lambda f=ops._helpers: calls.append(1) or f())
    split = ops.rms_norm(x, weight, 1e-5), ops.silu_mul(x)
    assert len(calls) == 2 * (parts - 1)
    for one, many in zip(whole, split, strict=True):
        assert np.array_equal(one, many)
