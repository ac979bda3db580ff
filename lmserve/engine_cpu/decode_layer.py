"""Which of a layer's halves a decode step runs as one compiled call (`decode_layer_kernel`), with
their arguments made once at load, and when a pass can take them.

A plain half qualifies: attention with no biases, no value norm, no output gate and no norm after
it (Llama, Mistral, SmolLM2, Qwen3 with its q/k norms; sliding windows and sinks are fine), a dense
SwiGLU FFN with no norm after it, or a plain SwiGLU mixture of experts (`moe_kernel.moe_half`,
Qwen3 MoE); each of its matrices (or each part of a stack of them, as Q4_K_M's Q/K/V) kept on the
int8 kernels. A pass takes the attention half when
it extends one cache by a few rows (a one-stream decode step or verify pass, where
`ops.attends_in_one_call`: a float32 cache's or a q8_0 / q4_0 / f16 one's), the FFN half for any
decode-sized pass (KERNEL_ROWS rows). Anything
else runs the Python path, which gives each row the same values up to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lmserve.engine_cpu import ops
from lmserve.engine_cpu.attention import stored_blocks
from lmserve.engine_cpu.batch import Batch
from lmserve.engine_cpu.qmatrix import KERNEL_ROWS, ExpertStack, Matrix, MatrixStack, QuantMatrix
from lmserve.engine_cpu.weights import AttentionWeights, Experts, LayerWeights
from lmserve.model.config import ModelConfig
from lmserve.model.families import ROUTE_TOPK_SOFTMAX, SILU

Product = tuple  # a matrix's parts, each as `int8_kernels._times` takes it: (q, scale, offset, supers, layout, superblocks)


@dataclass(frozen=True)
class CompiledHalves:
    """A layer's arguments for the compiled halves; None where a half is not plain."""

    attention: tuple[np.ndarray, Product, Product, tuple[int, int, int], np.ndarray, np.ndarray, int, np.ndarray] | None
    ffn: tuple[np.ndarray, Product, Product] | None
    moe: tuple[np.ndarray, np.ndarray, bool, int, Product, Product] | None = None  # `moe_kernel.moe_half`'s


NONE = CompiledHalves(None, None)


def compiled_halves(layer: LayerWeights, config: ModelConfig) -> CompiledHalves:
    """The layer's halves that qualify."""
    kernel = ops.compiled("decode_layer_kernel")
    if kernel is None:
        return NONE
    silu = config.activation == SILU
    a = layer.mixer
    attention = None
    if (isinstance(a, AttentionWeights) and layer.post_attn_norm is None
            and a.qkv_bias is None and a.o_bias is None and (a.q_norm is None) == (a.k_norm is None)
            and not (a.output_gate or a.values_from_keys or a.value_norm)):
        qkv, o = _product(a.qkv), _product(a.o)
        if qkv is not None and o is not None:
            sinks = ops.NO_SINKS if a.sinks is None else np.ascontiguousarray(a.sinks, np.float32)
            q_norm, k_norm = (ops.NO_WEIGHT if w is None else w for w in (a.q_norm, a.k_norm))
            attention = (layer.attn_norm, qkv, o, a.heads, q_norm, k_norm, a.window, sinks)
    ffn = None
    if (silu and layer.experts is None and layer.gate_up is not None and layer.down is not None
            and layer.dense_post_norm is None and layer.post_ffn_norm is None):
        gate_up, down = _product(layer.gate_up), _product(layer.down)
        if gate_up is not None and down is not None:
            ffn = (layer.ffn_norm, gate_up, down)
    return CompiledHalves(attention, ffn, _moe_half(layer, config) if silu else None)


def _moe_half(layer: LayerWeights, config: ModelConfig) -> tuple | None:
    """`moe_kernel.moe_half`'s arguments for a plain MoE FFN (no dense FFN beside it, no biases,
    norms of its own, router scales or shared expert; a float32 router; expert stacks on the int8
    kernels), else None."""
    m = layer.experts
    if (m is None or layer.gate_up is not None or layer.post_ffn_norm is not None or m.shared is not None
            or any(part is not None for part in (m.router_bias, m.gate_up_bias, m.down_bias, m.router_scale,
                                                 m.expert_scale, m.norm, m.post_norm))
            or not (isinstance(m.router, np.ndarray) and m.router.dtype == np.float32)):
        return None
    gate_up, down = _expert_product(m.gate_up), _expert_product(m.down)
    if gate_up is None or down is None:
        return None
    return (layer.ffn_norm, m.router, config.router == ROUTE_TOPK_SOFTMAX, config.n_experts_used, gate_up, down)


def prepare(halves: list[CompiledHalves], kv_type: str) -> None:
    """Compile the halves for the argument types these layers pass over a `kv_type` cache (or load
    them from Numba's cache) without running them: compiled lazily, the first decode step after an
    install waited seconds for them (the rest a pass calls: `ops.prepare`)."""
    kernel, moe = ops.compiled("decode_layer_kernel"), ops.compiled("moe_kernel")
    if kernel is None:
        return
    rows, table = np.empty((1, 1), np.float32), np.empty((1, 1, 2), np.float32)  # as a pass's: C-ordered
    signatures = set()
    for half in halves:
        if half.attention is not None:
            norm, qkv, o, heads, q_norm, k_norm, window, sinks = half.attention
            blocks = None if kv_type == "f32" else kv_type  # rows as `ops.stored_rows` gives them
            stored = np.empty((heads[1], 1, heads[2]), np.float32 if blocks is None else np.uint8)
            signatures.add((kernel.attention_half, _types(rows, norm, np.float32(0), qkv, o, heads, q_norm, k_norm,
                                                           table, table, stored, stored, 0, np.float32(0), window,
                                                           sinks, *ops.block_kind(blocks))))
        if half.ffn is not None:
            norm, gate_up, down = half.ffn
            signatures.add((kernel.ffn_half, _types(rows, norm, np.float32(0), gate_up, down)))
        if half.moe is not None:
            norm, router, topk_softmax, k, gate_up, down = half.moe
            signatures.add((moe.moe_half, _types(rows, norm, np.float32(0), router, topk_softmax, k, gate_up, down)))
    matrix = np.empty((1, 2), np.float32)
    signatures.add((kernel.silu_mul, _types(matrix, matrix)))  # `ops.silu_mul`'s, for every pass
    for function, signature in signatures:
        function.compile(signature)


def _types(*arguments: object) -> tuple:
    """Numba's types of these arguments."""
    import numba

    return tuple(numba.typeof(argument) for argument in arguments)


def _product(matrix: Matrix) -> Product | None:
    """`matrix` as the kernel's tuple of parts, each `int8_kernels._times`' arguments, or None
    where some part does not run there."""
    from lmserve.engine_cpu import int8_kernels

    parts = matrix.parts if isinstance(matrix, MatrixStack) else (matrix,)
    if not all(isinstance(p, QuantMatrix) and int8_kernels.takes(p.q.dtype) for p in parts):
        return None
    return tuple((*p.arrays, int8_kernels.x_layout(p.q.dtype), int8_kernels.by_superblock(p.q.dtype, p.scale.dtype))
                 for p in parts)


def _expert_product(experts: Experts) -> Product | None:
    """An expert stack as `int8_kernels._grouped_times`' matrix arguments, or None where it does
    not run there."""
    from lmserve.engine_cpu import int8_kernels

    if not (isinstance(experts, ExpertStack) and int8_kernels.takes(experts.whole.q.dtype)):
        return None
    whole = experts.whole
    return (*experts.cubes, int8_kernels.x_layout(whole.q.dtype), int8_kernels.by_superblock(whole.q.dtype, whole.scale.dtype))


def attention_half(h: np.ndarray, halves: CompiledHalves, batch: Batch, layer: int,
                   rope: tuple[np.ndarray, np.ndarray], scale: float, eps: float) -> bool:
    """`h += ` the attention half, compiled, where the pass takes it; False (nothing done) where not."""
    if halves.attention is None or len(batch.spans) != 1:
        return False
    (s,) = batch.spans
    norm, qkv, o, heads, q_norm, k_norm, window, sinks = halves.attention
    blocks = stored_blocks(batch)
    if not ops.attends_in_one_call(batch.width * heads[0] // heads[1], s.start + batch.width, blocks):
        return False
    ops.compiled("decode_layer_kernel").attention_half(
        h, norm, np.float32(eps), qkv, o, heads, q_norm, k_norm, rope[0], rope[1],
        *ops.stored_rows(s.cache.k[layer], s.cache.v[layer], blocks), s.start, np.float32(scale), window, sinks,
        *ops.block_kind(blocks))
    return True


def ffn_half(h: np.ndarray, halves: CompiledHalves, eps: float) -> bool:
    """`h += ` the FFN half, compiled, where the pass takes it; False (nothing done) where not."""
    if (halves.ffn is None and halves.moe is None) or len(h) > KERNEL_ROWS:
        return False
    if halves.moe is not None:
        norm, router, topk_softmax, k, gate_up, down = halves.moe
        ops.compiled("moe_kernel").moe_half(h, norm, np.float32(eps), router, topk_softmax, k, gate_up, down)
        return True
    norm, gate_up, down = halves.ffn
    ops.compiled("decode_layer_kernel").ffn_half(h, norm, np.float32(eps), gate_up, down)
    return True
