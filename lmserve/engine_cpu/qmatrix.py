"""A weight matrix kept as its GGUF quants: int8 values, a float32 scale and offset per block.

Every value is `scale * q + offset` of its block, the value the file's own dequantizer gives, so
the model is the file's, not a re-quantization of it; only the products' rounding differs from
float32 BLAS. Decode-sized products (up to KERNEL_ROWS rows) run the compiled kernels, which read
about a third of the float32 bytes; wider ones (prompt chunks) dequantize a tile of rows at a
time into float32 and hand it to BLAS, whose matrix product then costs more than the conversion.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Up to this many rows the kernels beat dequantizing tiles for BLAS; a little past it BLAS catches
# up, and it gains from there on (figures: docs/PERFORMANCE.md, measurements behind code choices).
KERNEL_ROWS = 24
# Float32 values dequantized per BLAS product: 16 MiB, reused from the heap (glibc keeps it, see
# weights._retain_freed_heap), so a layer's matrices are one product each; smaller tiles cost BLAS
# more than they save (figures: docs/PERFORMANCE.md, measurements behind code choices).
TILE_VALUES = 1 << 22


@dataclass(frozen=True)
class QuantMatrix:
    """`[out, in]` weights: `q` int8 `[out, in]`, `scale` and `offset` float32 `[out, in // block]`."""

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray

    @classmethod
    def empty(cls, rows: int, columns: int, block: int) -> QuantMatrix:
        blocks = columns // block
        return cls(np.empty((rows, columns), np.int8), np.empty((rows, blocks), np.float32),
                   np.empty((rows, blocks), np.float32))

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def block(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + self.offset.nbytes

    def __len__(self) -> int:
        return len(self.q)

    def rows(self, start: int, stop: int) -> QuantMatrix:
        """Rows `start:stop` as views (loading fills fused matrices a tensor at a time)."""
        return QuantMatrix(self.q[start:stop], self.scale[start:stop], self.offset[start:stop])

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` in float32: the embedding lookup."""
        n, block = len(ids), self.block
        values = self.q[ids].reshape(n, -1, block) * self.scale[ids][:, :, None] + self.offset[ids][:, :, None]
        return values.reshape(n, -1)

    def times(self, x: np.ndarray) -> np.ndarray:
        """`x [n, in]` times this matrix transposed: `[n, out]` float32."""
        from lmserve.engine_cpu import kernels  # numba: only once a QuantMatrix exists (not on macOS)

        x = np.ascontiguousarray(x, dtype=np.float32)
        if len(x) <= KERNEL_ROWS:
            return kernels.times(x, self.q, self.scale, self.offset)
        step = max(1, TILE_VALUES // self.shape[1])
        tile = np.empty((min(step, len(self)), self.shape[1]), np.float32)
        if step >= len(self):  # one tile: BLAS writes the result itself
            kernels.dequantize(self.q, self.scale, self.offset, tile)
            return x @ tile.T
        out = np.empty((len(x), len(self)), np.float32)
        for start in range(0, len(self), step):
            part = self.rows(start, start + step)
            kernels.dequantize(part.q, part.scale, part.offset, tile[:len(part)])
            out[:, start:start + len(part)] = x @ tile[:len(part)].T
        return out
