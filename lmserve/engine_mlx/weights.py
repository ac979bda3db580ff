"""GGUF tensors -> MLX arrays, keeping quantized weights quantized and losing no precision.

MLX's affine format stores, per group of 32 (or 64, 128) weights, `w = scale * q + bias` with
`q` packed little-endian at 2..8 bits. Every GGUF type whose blocks are affine on 32 weights maps
onto it exactly: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, and the sub-blocks of Q4_K and Q5_K (`mx.load`
does the first three itself; in float16 the K types' sub-block scales, products of two stored
numbers, round to the nearest float16). The others (Q6_K, Q3_K and Q2_K scale 16-weight
sub-blocks, which MLX cannot; the IQ types use non-uniform grids) are dequantized and
re-quantized with `mx.quantize` at a width whose added error is small against the source's own.
Measured on the tiny-llama fixtures against their F32 originals: re-quantizing at the source's
width plus two adds 25-33% of the source's RMS error, plus four about 6%, at any group size.
The rule: the smallest width of at least source + 2 bits, and the largest group, whose added
error on this tensor is within a third of what a source-width quantizer does to it and within 2%
of the weights' RMS (the second bound binds for 2- and 3-bit sources, whose own error is 15-30%).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from lmserve.model.gguf_file import GGUFFile, TensorInfo

Q = GGMLQuantizationType
FLOAT_TYPES = {Q.F32, Q.F16, Q.BF16}
EXACT_BITS = {Q.Q8_0: 8, Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q4_K: 4, Q.Q5_K: 5}
MX_LOAD_TYPES = {Q.Q8_0, Q.Q4_0, Q.Q4_1} | FLOAT_TYPES  # what `mx.load` reads from a .gguf unconverted
BLOCK = 32  # weights per affine group in every exact type
# Bits of precision per weight of each re-quantized source type (its grid, not its storage cost).
SOURCE_BITS = {Q.Q2_K: 2, Q.Q3_K: 3, Q.Q6_K: 6, Q.IQ4_NL: 4, Q.IQ4_XS: 4, Q.IQ3_XXS: 3, Q.IQ3_S: 3,
               Q.IQ2_XXS: 2, Q.IQ2_XS: 2, Q.IQ2_S: 2, Q.IQ1_S: 2, Q.IQ1_M: 2, Q.TQ1_0: 2, Q.TQ2_0: 2}
UNKNOWN_SOURCE_BITS = 6  # anything else the `gguf` package dequantizes goes to 8 bits
EXTRA_BITS = 2
MLX_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (128, 64, 32)  # largest first: fewer scales per weight
NOISE_SHARE = 1 / 3  # most error re-quantizing may add, relative to a source-width quantizer's
MAX_ADDED_ERROR = 0.02  # and relative to the weights' RMS
SAMPLE_ROWS = 256  # rows the width and group size are measured on
CHUNK_ELEMENTS = 1 << 22  # weights converted at a time: bounds the float32 peak

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Choice:
    """How one GGUF tensor became MLX weights, for the banner."""

    source: str  # GGUF storage type
    bits: int | None  # None: kept as floats
    group_size: int | None
    how: str  # "exact" or "requantized"; "" for floats

    def label(self) -> str:
        if self.bits is None:
            return f"{self.source} as float"
        return f"{self.source} -> {self.bits}-bit g{self.group_size} ({self.how})"


def summarize(choices: dict[str, Choice]) -> str:
    """One banner line: each distinct choice with the number of tensors it was made for."""
    counts: dict[str, int] = {}
    for choice in choices.values():
        counts[choice.label()] = counts.get(choice.label(), 0) + 1
    return "; ".join(f"{n} x {label}" for label, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def mx_loadable(gguf: GGUFFile, names: list[str]) -> bool:
    """True when `mx.load` reads every tensor the model needs without converting any."""
    return all(gguf.tensors[n].qtype in MX_LOAD_TYPES for n in names)


def load_native(gguf: GGUFFile, names: dict[str, str],
                dtype: mx.Dtype) -> tuple[dict[str, mx.array], dict[str, Choice]]:
    """`mx.load` on the .gguf itself. `names` maps MLX parameter names to GGUF tensor names."""
    loaded = mx.load(str(gguf.path))
    arrays: dict[str, mx.array] = {}
    choices: dict[str, Choice] = {}
    for mlx_name, gguf_name in names.items():
        qtype = gguf.tensors[gguf_name].qtype
        if qtype in FLOAT_TYPES:
            arrays[mlx_name] = loaded.pop(gguf_name).astype(dtype)
            choices[mlx_name] = Choice(qtype.name, None, None, "")
            continue
        base, gbase = mlx_name.rsplit(".", 1)[0], gguf_name.rsplit(".", 1)[0]
        arrays[mlx_name] = loaded.pop(gguf_name)
        arrays[base + ".scales"] = loaded.pop(gbase + ".scales").astype(dtype)
        arrays[base + ".biases"] = loaded.pop(gbase + ".biases").astype(dtype)
        choices[mlx_name] = Choice(qtype.name, EXACT_BITS[qtype], BLOCK, "exact")
    mx.eval(arrays)
    return arrays, choices


def convert(gguf: GGUFFile, names: dict[str, str], dtype: mx.Dtype,
            progress: Progress | None = None) -> tuple[dict[str, mx.array], dict[str, Choice]]:
    """Tensor by tensor from the memory map: each is converted and evaluated before the next."""
    arrays: dict[str, mx.array] = {}
    choices: dict[str, Choice] = {}
    for done, (mlx_name, gguf_name) in enumerate(names.items(), 1):
        info = gguf.tensors[gguf_name]
        base = mlx_name.rsplit(".", 1)[0]
        matrix = len(info.shape) == 2 and info.shape[1] % BLOCK == 0
        if info.qtype in FLOAT_TYPES:
            arrays[mlx_name] = _float(gguf, info).astype(dtype)
            choices[mlx_name] = Choice(info.qtype.name, None, None, "")
        elif matrix and info.qtype in EXACT_BITS:
            bits = EXACT_BITS[info.qtype]
            parts = [_exact(raw, info.qtype, bits) for raw in _raw_chunks(gguf, info)]
            arrays.update(_joined(base, parts, dtype))
            choices[mlx_name] = Choice(info.qtype.name, bits, BLOCK, "exact")
        elif matrix:
            bits, group = _choose(gguf, info, dtype)
            parts = [mx.quantize(mx.array(gguf_quants.dequantize(raw, info.qtype)), group_size=group, bits=bits)
                     for raw in _raw_chunks(gguf, info)]
            arrays.update(_joined(base, parts, dtype))
            choices[mlx_name] = Choice(info.qtype.name, bits, group, "requantized")
        else:  # vectors, or rows no MLX group size divides
            arrays[mlx_name] = mx.array(gguf.dequantize(gguf_name)).astype(dtype)
            choices[mlx_name] = Choice(info.qtype.name, None, None, "")
        mx.eval([a for k, a in arrays.items() if k.startswith(base + ".")])
        if progress is not None:
            progress(done, len(names))
    return arrays, choices


def _float(gguf: GGUFFile, info: TensorInfo) -> mx.array:
    raw = gguf.raw(info.name)
    if info.qtype == Q.BF16:
        return mx.array(raw.view(np.uint16).reshape(info.shape)).view(mx.bfloat16)
    return mx.array(raw.view(np.float32 if info.qtype == Q.F32 else np.float16).reshape(info.shape))


def _raw_chunks(gguf: GGUFFile, info: TensorInfo, rows: np.ndarray | None = None) -> Iterator[np.ndarray]:
    """A matrix's stored rows, a bounded number at a time (`rows`: only these)."""
    n_rows, cols = info.shape
    block, type_size = GGML_QUANT_SIZES[info.qtype]
    raw = gguf.raw(info.name).reshape(n_rows, cols // block * type_size)
    if rows is not None:
        raw = raw[rows]
    step = max(1, CHUNK_ELEMENTS // cols)
    for start in range(0, raw.shape[0], step):
        yield raw[start:start + step]


def _joined(base: str, parts: list, dtype: mx.Dtype) -> dict[str, mx.array]:
    w, scales, biases = (mx.concatenate(list(p)) if len(p) > 1 else p[0] for p in zip(*parts, strict=True))
    return {base + ".weight": w, base + ".scales": scales.astype(dtype), base + ".biases": biases.astype(dtype)}


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _affine(blocks: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-weight group `(scale, bias)` such that `w = scale * q + bias`, q unsigned."""
    d = _f16(blocks, 0)
    if qtype in (Q.Q4_K, Q.Q5_K):  # 8 sub-blocks of 32: w = d*sc*q - dmin*m
        sc, m = gguf_quants.Q4_K.get_scale_min(blocks[:, 4:16])
        return d[:, None] * sc.astype(np.float32), -(_f16(blocks, 2)[:, None] * m.astype(np.float32))
    if qtype in (Q.Q4_1, Q.Q5_1):  # w = d*q + m
        return d, _f16(blocks, 2)
    offset = {Q.Q8_0: 128, Q.Q4_0: 8, Q.Q5_0: 16}[qtype]  # w = d*(q - offset), q signed for Q8_0
    return d, -offset * d


def _exact(raw: np.ndarray, qtype: GGMLQuantizationType, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Stored rows of an exact type -> MLX affine arrays holding the same values."""
    rows = raw.shape[0]
    w = gguf_quants.dequantize(raw, qtype).reshape(rows, -1, BLOCK)
    scale, bias = (a.reshape(rows, -1, 1) for a in _affine(raw.reshape(-1, GGML_QUANT_SIZES[qtype][1]), qtype))
    q = np.divide(w - bias, scale, out=np.zeros_like(w), where=scale != 0)
    q = np.rint(q).clip(0, (1 << bits) - 1).astype(np.uint8).reshape(rows, -1)
    return _pack(q, bits), mx.array(scale[..., 0]), mx.array(bias[..., 0])


def _pack(q: np.ndarray, bits: int) -> mx.array:
    """Unsigned `bits`-bit values -> MLX's packing: one little-endian bit stream per row."""
    if bits == 8:
        return mx.array(np.ascontiguousarray(q).view(np.uint32))
    planes = (q[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    return mx.array(np.packbits(planes.reshape(q.shape[0], -1), axis=-1, bitorder="little").view(np.uint32))


def _relative_error(w: mx.array, bits: int, group: int, dtype: mx.Dtype = mx.float32) -> float:
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    back = mx.dequantize(packed, scales.astype(dtype), biases.astype(dtype), group_size=group, bits=bits)
    return (mx.linalg.norm(back.astype(mx.float32) - w) / mx.maximum(mx.linalg.norm(w), 1e-30)).item()


def _choose(gguf: GGUFFile, info: TensorInfo, dtype: mx.Dtype) -> tuple[int, int]:
    """Bits and group size for one re-quantized tensor, measured on a sample of its rows."""
    n_rows, cols = info.shape
    rows = np.unique(np.linspace(0, n_rows - 1, min(n_rows, SAMPLE_ROWS)).astype(np.int64))
    sample = mx.array(np.concatenate([gguf_quants.dequantize(r, info.qtype) for r in _raw_chunks(gguf, info, rows)]))
    src = SOURCE_BITS.get(info.qtype, UNKNOWN_SOURCE_BITS)
    budget = min(NOISE_SHARE * _relative_error(sample, src, BLOCK), MAX_ADDED_ERROR)
    groups = [g for g in GROUP_SIZES if cols % g == 0]
    for bits in (b for b in MLX_BITS if b >= min(src + EXTRA_BITS, 8)):
        for group in groups:
            if _relative_error(sample, bits, group, dtype) <= budget:
                return bits, group
    return MLX_BITS[-1], BLOCK
