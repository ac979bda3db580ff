"""`kernel_ir.Builder.horizontal_sums`: several vectors summed together give each the bits of
summing it alone, the halving order the kernels' results depend on."""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.fast,
              pytest.mark.skipif(sys.platform == "darwin", reason="numba is not installed on macOS (MLX serves)")]


def _summed(count: int, width: int):  # noqa: ANN202  (a Numba function)
    """A compiled function: `out[i]` = `horizontal_sums` of rows `i * width` on of `values`."""
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    from lmserve.engine_cpu.kernel_ir import F32, I64, Builder

    @intrinsic
    def sums(typingctx, values, out):  # noqa: ANN001, ANN202, ARG001
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202, ARG001
            k = Builder(context, builder, signature, args)
            vectors = [k.load_vector(k.data(0), ir.Constant(I64, i * width), ir.VectorType(F32, width))
                       for i in range(count)]
            for i, total in enumerate(k.horizontal_sums(vectors)):
                builder.store(total, k.at(k.data(1), i))
            return context.get_dummy_value()
        return types.void(values, out), codegen

    @njit
    def run(values, out):  # noqa: ANN001, ANN202
        sums(values, out)
    return run


def _halving(lanes: np.ndarray) -> np.float32:
    """Lane i plus lane i + half, until one is left: the order `horizontal_sum` always had."""
    while len(lanes) > 1:
        lanes = lanes[:len(lanes) // 2] + lanes[len(lanes) // 2:]
    return lanes[0]


@pytest.mark.parametrize("count", [1, 2, 4, 8])
@pytest.mark.parametrize("width", [1, 4, 8, 16])
def test_each_vector_gets_the_bits_of_its_own_halving_sum(count: int, width: int) -> None:
    rng = np.random.default_rng(count * 100 + width)
    # Magnitudes far apart, so another order of the additions rounds differently.
    values = (rng.standard_normal(count * width) * 10.0 ** rng.integers(-6, 7, count * width)).astype(np.float32)
    out = np.full(count, np.nan, np.float32)
    _summed(count, width)(values, out)
    expected = np.array([_halving(values[i * width:(i + 1) * width]) for i in range(count)], np.float32)
    assert out.tobytes() == expected.tobytes()
