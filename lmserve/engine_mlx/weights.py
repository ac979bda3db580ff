"""GGUF tensors -> MLX arrays, keeping quantized weights quantized and losing no precision.

MLX's affine format stores, per group of 32 (or 64, 128) weights, `w = scale * q + bias` with
`q` packed little-endian at 2..8 bits. Every GGUF type whose blocks are affine on 32 weights maps
onto it exactly: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, and the sub-blocks of Q4_K and Q5_K (`mx.load`
does the first three itself; in float16 the K types' sub-block scales, products of two stored
numbers, round to the nearest float16). The others (Q6_K, Q3_K and Q2_K scale 16-weight
sub-blocks, which MLX cannot; the IQ types use non-uniform grids) are dequantized and
re-quantized with `mx.quantize` at a width whose added error is small against the source's own.
Re-quantizing at the source's width plus two adds a modest share of the source's own RMS error,
plus four much less, at any group size (figures: docs/PERFORMANCE.md, measurements behind code
choices). The rule: the smallest width of at least source + 2 bits, and the largest group, whose
added error on this tensor is within a third of what a source-width quantizer does to it and
within 2% of the weights' RMS (the second bound binds for 2- and 3-bit sources, whose own error
is large).
MXFP4 (gpt-oss's experts) is MLX's own `mxfp4` mode with the nibbles reordered.
An expert stack (`[experts, out, in]`) gets one width for all its experts (MLX stores it as one
array) and is converted one expert slice at a time.

Memory: loading holds the converted model and one chunk of rows in flight, nothing more. Tensor
bytes come from plain file reads (a memory map's pages would stay resident beside the copy), each
chunk is converted and evaluated before the next is read, and each tensor is assembled in place in
its final array, so loading adds little more than the converted weights themselves to the process
(float32 scales and biases on the CPU backend make those somewhat larger than the file, a GPU's
float16 ones less so), where reading through `mx.load` and a memory map added over twice the
file (figures: docs/PERFORMANCE.md, measurements behind code choices; scripts/bench_load_memory.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from lmserve.model.gguf_file import GGUFFile, TensorInfo

Q = GGMLQuantizationType
FLOAT_TYPES = {Q.F32, Q.F16, Q.BF16}
EXACT_BITS = {Q.Q8_0: 8, Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q4_K: 4, Q.Q5_K: 5, Q.MXFP4: 4}
MX_LOAD_TYPES = {Q.Q8_0, Q.Q4_0, Q.Q4_1} | FLOAT_TYPES  # what `mx.load` reads from a .gguf itself
# MLX's own formats with the bits rearranged: Q8_0/Q4_0/Q4_1 affine, MXFP4 (gpt-oss experts) mxfp4.
MOVED_BITS = {Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.MXFP4}
NATIVE_TYPES = MOVED_BITS | FLOAT_TYPES
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
CHUNK_ELEMENTS = 1 << 20  # weights converted at a time: bounds the float32 temporaries (~30 MB)

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Choice:
    """How one GGUF tensor became MLX weights, for the banner."""

    source: str  # GGUF storage type
    bits: int | None  # None: kept as floats
    group_size: int | None
    how: str  # "exact" or "requantized"; "" for floats
    mode: str = "affine"  # MLX's quantization mode: "affine" (scales and biases) or "mxfp4"

    def label(self) -> str:
        if self.bits is None:
            return f"{self.source} as float"
        mode = "" if self.mode == "affine" else f" {self.mode}"
        return f"{self.source} -> {self.bits}-bit g{self.group_size}{mode} ({self.how})"


def summarize(choices: dict[str, Choice]) -> str:
    """One banner line: each distinct choice with the number of tensors it was made for."""
    counts: dict[str, int] = {}
    for choice in choices.values():
        counts[choice.label()] = counts.get(choice.label(), 0) + 1
    return "; ".join(f"{n} x {label}" for label, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def reads_natively(gguf: GGUFFile, names: list[str]) -> bool:
    """True when every tensor the model needs is a type MLX computes on as stored (floats, and the
    block types whose bits only move): nothing worth caching converted."""
    return all(gguf.tensors[n].qtype in NATIVE_TYPES for n in names)


def load_native(gguf: GGUFFile, names: dict[str, str],
                dtype: mx.Dtype) -> tuple[dict[str, mx.array], dict[str, Choice]]:
    """`mx.load` on the .gguf itself: MLX's own reader, the reference `convert`'s repacking is
    checked against. The engine does not use it: it holds the whole file read in and its copy at
    once, far more memory than converting tensor by tensor (figures: docs/PERFORMANCE.md,
    measurements behind code choices)."""
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


class TensorReader:
    """A GGUF's tensor bytes by plain reads of the file, a bounded number of rows at a time. Pages
    of a memory map stay resident, counted as the process's own memory, until it is unmapped: a
    loader reading a whole model through one holds the file on top of what it builds from it."""

    def __init__(self, gguf: GGUFFile) -> None:
        self._fds = {path: os.open(path, os.O_RDONLY) for path in {t.file for t in gguf.tensors.values()}}

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds.values():
            os.close(fd)

    def rows(self, info: TensorInfo, start: int, stop: int) -> np.ndarray:
        """Stored rows `start:stop` (over all but the last dimension) as bytes `[rows, row_bytes]`,
        from the file that holds the tensor (one part of a split model)."""
        row_bytes = info.nbytes // _n_rows(info)
        out = np.empty((stop - start, row_bytes), np.uint8)
        view, done, at = memoryview(out).cast("B"), 0, info.offset + start * row_bytes
        while done < len(view):
            n = os.preadv(self._fds[info.file], [view[done:]], at + done)
            if n <= 0:
                raise OSError(f"{info.file}: the file ends inside tensor {info.name}")
            done += n
        return out

    def pick(self, info: TensorInfo, rows: np.ndarray) -> np.ndarray:
        return np.concatenate([self.rows(info, int(r), int(r) + 1) for r in rows])


def convert(gguf: GGUFFile, names: dict[str, str], dtype: mx.Dtype,
            progress: Progress | None = None) -> tuple[dict[str, mx.array], dict[str, Choice]]:
    """Tensor by tensor, each a bounded number of rows at a time (an expert stack one expert at a
    time): each chunk is converted and evaluated before the next is read, so the only float copy
    is of one chunk, and what is held is the converted model plus one tensor being assembled."""
    arrays: dict[str, mx.array] = {}
    choices: dict[str, Choice] = {}
    with TensorReader(gguf) as reader:
        for done, (mlx_name, gguf_name) in enumerate(names.items(), 1):
            converted, choices[mlx_name] = _convert(reader, gguf.tensors[gguf_name], mlx_name, dtype)
            arrays.update(converted)
            if progress is not None:
                progress(done, len(names))
    mx.clear_cache()  # the chunks' buffers, kept by MLX for reuse
    return arrays, choices


def _convert(reader: TensorReader, info: TensorInfo, name: str,
             dtype: mx.Dtype) -> tuple[dict[str, mx.array], Choice]:
    qtype, base, lead, cols = info.qtype, name.rsplit(".", 1)[0], tuple(info.shape[:-1]), info.shape[-1]
    if qtype in FLOAT_TYPES:
        (array,) = _assembled(reader, info, [((_n_rows(info), cols), dtype)],
                              lambda raw: (_float(raw, info.qtype).reshape(-1, cols).astype(dtype),))
        return {name: array.reshape(info.shape)}, Choice(qtype.name, None, None, "")
    if len(info.shape) not in (2, 3) or cols % BLOCK:  # vectors, or rows no group size divides
        raw = reader.rows(info, 0, _n_rows(info))
        array = mx.array(gguf_quants.dequantize(raw, qtype).reshape(info.shape)).astype(dtype)
        mx.eval(array)
        return {name: array}, Choice(qtype.name, None, None, "")
    if qtype in EXACT_BITS:
        bits, group, how = EXACT_BITS[qtype], BLOCK, "exact"

        def chunk(raw: np.ndarray) -> tuple[mx.array, ...]:
            return _exact(raw, qtype, bits)
    else:
        (bits, group), how = _choose(reader, info, dtype), "requantized"

        def chunk(raw: np.ndarray) -> tuple[mx.array, ...]:
            return tuple(mx.quantize(mx.array(gguf_quants.dequantize(raw, qtype)), group_size=group, bits=bits))
    rows, mode = _n_rows(info), "mxfp4" if qtype == Q.MXFP4 else "affine"
    shapes = [((rows, cols * bits // 32), mx.uint32)] + (
        [((rows, cols // group), mx.uint8)] if mode == "mxfp4" else [((rows, cols // group), dtype)] * 2)
    arrays = _assembled(reader, info, shapes, lambda raw: tuple(
        a.astype(dt) for a, (_, dt) in zip(chunk(raw), shapes, strict=True)))
    named = zip((base + ".weight", base + ".scales", base + ".biases"), arrays, strict=False)
    return {k: v.reshape(*lead, -1) for k, v in named}, Choice(qtype.name, bits, group, how, mode)


def _assembled(reader: TensorReader, info: TensorInfo, shapes: list[tuple[tuple[int, int], mx.Dtype]],
               chunk: Callable[[np.ndarray], tuple[mx.array, ...]]) -> list[mx.array]:
    """The arrays of one tensor, allocated once and filled a chunk of rows at a time: MLX updates
    a slice in place when nothing else holds the array, so no second copy of the tensor exists."""
    outs = [mx.zeros(shape, dt) for shape, dt in shapes]
    mx.eval(outs)
    for start, stop in _spans(info):
        parts = chunk(reader.rows(info, start, stop))
        for i, part in enumerate(parts):
            outs[i][start:stop] = part
        del parts
        mx.eval(outs)
    return outs


def _n_rows(info: TensorInfo) -> int:
    return int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1


def _spans(info: TensorInfo) -> Iterator[tuple[int, int]]:
    """Row ranges of at most CHUNK_ELEMENTS weights, none across two experts of a stack."""
    rows, cols = (info.shape[-2] if len(info.shape) > 1 else 1), info.shape[-1]
    step = max(1, CHUNK_ELEMENTS // cols)
    for first in range(0, _n_rows(info), rows):
        for start in range(first, first + rows, step):
            yield start, min(start + step, first + rows)


def _float(raw: np.ndarray, qtype: GGMLQuantizationType) -> mx.array:
    if qtype == Q.BF16:
        return mx.array(raw.view(np.uint16)).view(mx.bfloat16)
    return mx.array(raw.view(np.float32 if qtype == Q.F32 else np.float16))


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
    if qtype in MOVED_BITS:
        return _moved(raw, qtype)
    rows = raw.shape[0]
    w = gguf_quants.dequantize(raw, qtype).reshape(rows, -1, BLOCK)
    scale, bias = (a.reshape(rows, -1, 1) for a in _affine(raw.reshape(-1, GGML_QUANT_SIZES[qtype][1]), qtype))
    q = np.divide(w - bias, scale, out=np.zeros_like(w), where=scale != 0)
    q = np.rint(q).clip(0, (1 << bits) - 1).astype(np.uint8).reshape(rows, -1)
    return _pack(q, bits), mx.array(scale[..., 0]), mx.array(bias[..., 0])


def _moved(raw: np.ndarray, qtype: GGMLQuantizationType) -> tuple[mx.array, ...]:
    """Q8_0, Q4_0, Q4_1, MXFP4 rows -> MLX's arrays by moving bits, as `mx.load` does: Q8_0's
    signed bytes become unsigned (q + 128, bias -128 d); Q4_0/Q4_1/MXFP4 store weight j and j + 16
    of a block in one byte, MLX stores neighbours together. MXFP4 is MLX's mxfp4 as is otherwise:
    the same e2m1 codes (ggml's table holds their doubles, and its e8m0 scale halves them back) and
    the same e8m0 scale byte, so no biases."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])
    if qtype == Q.MXFP4:
        return mx.array(_nibbles_in_order(blocks[..., 1:]).reshape(rows, -1).view(np.uint32)), \
            mx.array(np.ascontiguousarray(blocks[..., 0]))
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == Q.Q8_0:
        return mx.array((blocks[..., 2:] ^ np.uint8(0x80)).reshape(rows, -1).view(np.uint32)), mx.array(d), \
            mx.array(-128 * d)
    packed = _nibbles_in_order(blocks[..., 4:] if qtype == Q.Q4_1 else blocks[..., 2:]).reshape(rows, -1).view(np.uint32)
    bias = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if qtype == Q.Q4_1 else -8 * d
    return mx.array(packed), mx.array(d), mx.array(bias)


def _nibbles_in_order(qs: np.ndarray) -> np.ndarray:
    """ggml's 16 bytes of a 32-weight block (weight j low, j + 16 high) -> MLX's (2k low, 2k + 1 high)."""
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    return q[..., 0::2] | (q[..., 1::2] << 4)


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


def _choose(reader: TensorReader, info: TensorInfo, dtype: mx.Dtype) -> tuple[int, int]:
    """Bits and group size for one re-quantized tensor (one for a whole expert stack, which MLX
    stores as one array), measured on a sample of its rows."""
    n_rows, cols = _n_rows(info), info.shape[-1]
    rows = np.unique(np.linspace(0, n_rows - 1, min(n_rows, SAMPLE_ROWS)).astype(np.int64))
    sample = mx.array(gguf_quants.dequantize(reader.pick(info, rows), info.qtype))
    src = SOURCE_BITS.get(info.qtype, UNKNOWN_SOURCE_BITS)
    budget = min(NOISE_SHARE * _relative_error(sample, src, BLOCK), MAX_ADDED_ERROR)
    groups = [g for g in GROUP_SIZES if cols % g == 0]
    for bits in (b for b in MLX_BITS if b >= min(src + EXTRA_BITS, 8)):
        for group in groups:
            if _relative_error(sample, bits, group, dtype) <= budget:
                return bits, group
    return MLX_BITS[-1], BLOCK
