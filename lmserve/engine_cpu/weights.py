"""Load a GGUF model's weights as float32 NumPy arrays laid out for fast decoding.

Decode is bound by reading weights, so each layer's Q/K/V rows are fused into one matrix and
gate/up into another: one matrix product per fused weight instead of three or two. Matrices keep
GGUF's `[out, in]` row order, C-contiguous (measured: `W @ x.T` is as fast as or faster than any
pre-transposed layout for one row and for small batches, and it costs no transpose at load).
Phi-3 files fuse Q/K/V and gate/up themselves; MoE experts are fused the same way, one
`[2 * ffn, hidden]` gate/up matrix per expert, and so are Gated DeltaNet's projections (q/k/v with
the output gate z, beta with alpha). Each layer's mixer is an `AttentionWeights` or, in Qwen3.5's
recurrent layers, a `DeltaNetWeights`.

Tensors are dequantized 64K values at a time straight into their place in the fused matrices,
which live in a few large arenas (see `_Loader`): no extra copies, temporaries that stay in cache,
and one `gguf` call per 64K values rather than one per 16 rows. A thread pool of 2 was measured slower
(figures: docs/PERFORMANCE.md, measurements behind code choices): the `gguf` dequantizers are many
small NumPy calls that hold the GIL.

Weight matrices, MoE experts among them (one matrix per expert, so a step reads only the routed
ones), stay in their file's values when the compiled kernels are available, in the form
`encodings` gives their type (`QuantMatrix`: 0.75-2.25 bytes a value; a fused matrix whose tensors
differ in type is a `MatrixStack` of them); everything else (norms, biases, other types) is
float32, 4 bytes a value. `load_weights` lays every matrix out first, without touching its memory,
and refuses with the arithmetic if they do not fit in the memory available.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields, is_dataclass
from typing import TypeVar

import numpy as np
import psutil
from gguf import MODEL_TENSOR, TENSOR_NAMES
from gguf import quants as gguf_quants

from lmserve.engine_cpu.encodings import Encoding, encode, encoding_of
from lmserve.engine_cpu.qmatrix import ExpertStack, Matrix, MatrixStack, QuantMatrix
from lmserve.model.config import ROPE_INTERLEAVED, ModelConfig
from lmserve.model.families import ROUTE_GEMMA4
from lmserve.model.gguf_file import GGUFFile, ModelLoadError
from lmserve.model.rope import Rope, rope_for

ALIGN = 16  # float32 values: every array starts on a 64-byte cache line
ARENA_VALUES = 1 << 24  # float32 values an arena holds at least (64 MiB): big enough for huge pages
CHUNK_ELEMENTS = 1 << 16  # values dequantized per call: few calls, temporaries fit in L2 cache
_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed
_TRIM_THRESHOLD = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers

Progress = Callable[[int, int], None]
# float32 `[experts, rows, columns]`, kept matrices of one encoding stacked, or one kept matrix per
# expert (gate and up of different types)
Experts = np.ndarray | ExpertStack | list[Matrix]


@dataclass
class SharedExpert:
    """Qwen3.5 MoE: an expert every token runs beside its routed ones, its output scaled by
    sigmoid(x . gate)."""

    gate: np.ndarray  # [hidden]
    gate_up: Matrix  # [2 * ffn, hidden]: gate rows, then up rows
    down: Matrix  # [hidden, ffn]


@dataclass
class ExpertWeights:
    """A mixture-of-experts FFN: the router and every expert, stacked on a leading expert axis."""

    router: Matrix  # [experts, hidden]
    router_bias: np.ndarray | None  # gpt-oss
    gate_up: Experts  # [experts][2 * ffn, hidden]: each expert's gate rows, then its up rows
    gate_up_bias: np.ndarray | None  # [experts, 2 * ffn]
    down: Experts  # [experts][hidden, ffn]
    down_bias: np.ndarray | None  # [experts, hidden]
    shared: SharedExpert | None = None
    # Gemma 4: the router reads the residual stream RMS-normalized, times this and 1/sqrt(hidden)
    # (not the experts' input), and each chosen expert's weight is times its own `expert_scale`.
    router_scale: np.ndarray | None = None  # [hidden]
    expert_scale: np.ndarray | None = None  # [experts]
    norm: np.ndarray | None = None  # Gemma 4: the experts' own pre-norm (beside the dense FFN's)
    post_norm: np.ndarray | None = None  # and post-norm, before the two outputs are summed


@dataclass
class AttentionWeights:
    """Grouped-query attention of one layer. Matrices are `[out, in]`; biases and norms are vectors."""

    qkv: Matrix  # rows: Q heads (each a query then its gate with `output_gate`), K heads, V heads
    o: Matrix
    heads: tuple[int, int, int]  # query heads, KV heads, head size
    qkv_bias: np.ndarray | None = None  # qwen2, gpt-oss
    q_norm: np.ndarray | None = None  # qwen3, gemma: per-head RMSNorm weight [head_dim]
    k_norm: np.ndarray | None = None
    o_bias: np.ndarray | None = None  # gpt-oss
    sinks: np.ndarray | None = None  # gpt-oss: one extra softmax logit per query head [heads]
    window: int = 0  # attends to the last `window` positions only (0: all of them)
    local_rope: bool = False  # rotates with `ModelWeights.rope_local` (Gemma's sliding layers)
    output_gate: bool = False  # Qwen3.5: the output is times sigmoid(the gate rows)
    values_from_keys: bool = False  # Gemma 4's global layers: no V rows, values are the K projection
    value_norm: bool = False  # Gemma 4: values RMS-normalized (no weight)


@dataclass
class DeltaNetWeights:
    """A Gated DeltaNet layer (Qwen3.5), as `delta_net.py` runs it."""

    in_proj: Matrix  # rows: q, k and v (the convolution's channels), then z (the output gate)
    ba: Matrix  # rows: beta's logit per value head, then alpha (the decay's input)
    conv: np.ndarray  # [conv_dim, kernel]: the depthwise causal convolution
    dt_bias: np.ndarray  # [v_heads]
    a: np.ndarray  # [v_heads]: -exp(A_log), as the file stores it
    norm: np.ndarray  # [head_v_dim]: the gated RMSNorm's weight
    out: Matrix  # [hidden, v_heads * head_v_dim]


@dataclass
class LayerWeights:
    """One block: a mixer (attention or Gated DeltaNet) and an FFN (dense, experts, or both)."""

    attn_norm: np.ndarray
    mixer: AttentionWeights | DeltaNetWeights
    ffn_norm: np.ndarray
    gate_up: Matrix | None  # rows: gate, then up (None: the FFN is `experts` alone)
    down: Matrix | None
    experts: ExpertWeights | None = None
    post_attn_norm: np.ndarray | None = None  # gemma: on the mixer's output, before the residual
    post_ffn_norm: np.ndarray | None = None  # gemma: on the FFN output, before the residual
    dense_post_norm: np.ndarray | None = None  # Gemma 4 MoE: on the dense FFN's output, before the experts' join it
    out_scale: np.ndarray | None = None  # Gemma 4: the layer's output (residual included) times this [1]


@dataclass
class ModelWeights:
    """Every weight the forward pass reads. `output` is `embed` itself when embeddings are tied."""

    embed: Matrix
    layers: list[LayerWeights]
    output_norm: np.ndarray
    output: Matrix
    rope: Rope
    rope_local: Rope | None = None  # the sliding layers' own (Gemma 3 and 4)

    @property
    def nbytes(self) -> int:
        """Resident bytes, counting a tied output matrix once."""
        arrays = {id(a): a for a in _arrays([self.embed, self.output_norm, self.output, *self.layers])}
        return sum(a.nbytes for a in arrays.values())


T = TypeVar("T")


def _arrays(items: Iterable[object]) -> Iterator[np.ndarray]:
    """Every array in `items` and in the weight dataclasses and lists they hold, however nested."""
    return _leaves(items, np.ndarray)


def _quant_matrices(items: Iterable[object]) -> Iterator[QuantMatrix]:
    return _leaves(items, QuantMatrix)


def _leaves(items: Iterable[object], kind: type[T]) -> Iterator[T]:
    """Every `kind` in `items` and in the dataclasses and lists they hold, however nested."""
    for item in items:
        if isinstance(item, kind):
            yield item
        elif isinstance(item, list | tuple):
            yield from _leaves(item, kind)
        elif is_dataclass(item):
            yield from _leaves((getattr(item, f.name) for f in fields(item)), kind)


def _name(kind: MODEL_TENSOR, block: int | None = None) -> str:
    return TENSOR_NAMES[kind].format(bid=block) + ".weight"


def _bias(kind: MODEL_TENSOR, block: int) -> str:
    return TENSOR_NAMES[kind].format(bid=block) + ".bias"


def _scale(kind: MODEL_TENSOR, block: int) -> str:
    return TENSOR_NAMES[kind].format(bid=block) + ".scale"


class _Loader:
    """Collects (tensor, destination) jobs first so progress knows the total, then runs them.

    Float32 destinations are carved out of arenas of at least ARENA_VALUES: NumPy asks the
    kernel for transparent huge pages on large allocations, so first-touching the weights costs
    a fraction of what 4 KiB page faults do (figures: docs/PERFORMANCE.md, measurements behind
    code choices), and decode's weight stream needs fewer TLB entries. Nothing is touched until
    `run`, and an arena's untouched tail is never backed by memory.
    """

    def __init__(self, gguf: GGUFFile, head_dim: int, quantized: bool) -> None:
        self.gguf = gguf
        self.head_dim = head_dim
        self.quantized = quantized  # keep matrices in their `encodings` form (False: float32)
        # (tensor, destination, heads permuted, first row of the tensor it holds)
        self.jobs: list[tuple[str, Matrix, bool, int]] = []
        self._arena = np.empty(0, dtype=np.float32)
        self._used = 0

    def _alloc(self, shape: tuple[int, ...]) -> np.ndarray:
        start = -(-self._used // ALIGN) * ALIGN
        if start + math.prod(shape) > len(self._arena):
            self._arena, start = np.empty(max(ARENA_VALUES, math.prod(shape)), dtype=np.float32), 0
        self._used = start + math.prod(shape)
        return self._arena[start:self._used].reshape(shape)

    def tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A new float32 array to be filled from one tensor."""
        out = self._alloc(shape)
        self._add(name, out)
        return out

    def matrix(self, name: str, shape: tuple[int, int]) -> Matrix:
        """A weight matrix to be filled from one tensor: kept in its type's encoding if it has one."""
        if self._info(name) != shape:
            raise ModelLoadError(f"tensor {name} has shape {self._info(name)}, expected {shape}")
        return self.fused([name])

    def fused(self, names: list[str], permuted: tuple[bool, ...] | None = None) -> Matrix:
        """Several tensors stacked along their first axis: one contiguous float32 array, or when
        all are matrices with an encoding, one QuantMatrix (a MatrixStack where they differ)."""
        shapes = [self._info(name) for name in names]
        if len({shape[1:] for shape in shapes}) != 1:
            raise ModelLoadError(f"cannot fuse tensors of shapes {shapes}: {names}")
        flags = [bool(permuted and permuted[i]) for i in range(len(names))]
        return self._stacked([(name, 0, shape[0], flag) for name, shape, flag in zip(names, shapes, flags, strict=True)],
                             shapes[0][1:])

    def _stacked(self, sources: list[tuple[str, int, int, bool]], row_shape: tuple[int, ...]) -> Matrix:
        """Rows `first:first + count` of each source tensor (heads permuted where flagged), stacked."""
        rows = sum(count for _, _, count, _ in sources)
        encodings = [self._encoding(name) for name, *_ in sources]
        if None in encodings:
            out = self._alloc((rows, *row_shape))
            parts: list[Matrix] = []
            row = 0
            for _, _, count, _ in sources:
                parts.append(out[row:row + count])
                row += count
        else:  # neighbours of one encoding share a matrix
            kept = []
            parts = []
            for encoding, group in itertools.groupby(zip(encodings, sources, strict=True), key=lambda pair: pair[0]):
                counts = [count for _, (_, _, count, _) in group]
                matrix = QuantMatrix.empty(sum(counts), row_shape[0], encoding.block, encoding.dtype, encoding.scales)
                kept.append(matrix)
                row = 0
                for count in counts:
                    parts.append(matrix.rows(row, row + count))
                    row += count
            out = kept[0] if len(kept) == 1 else MatrixStack(tuple(kept))
        for (name, first, _, flag), part in zip(sources, parts, strict=True):
            self.jobs.append((name, part, flag, first))
        return out

    def _encoding(self, name: str) -> Encoding | None:
        info = self.gguf.tensors[name]
        if not self.quantized or len(info.shape) not in (2, 3):
            return None
        return encoding_of(info.qtype, info.shape[-1])

    def experts(self, names: list[str]) -> Experts:
        """Per-expert tensors `[experts, rows_i, ...]`, each expert's slices of them stacked: kept
        matrices in one ExpertStack (one encoding) or one per expert (several), or float32
        `[experts, sum of rows_i, ...]`."""
        shapes = [self._info(name) for name in names]
        if len({(shape[0], *shape[2:]) for shape in shapes}) != 1:
            raise ModelLoadError(f"cannot fuse expert tensors of shapes {shapes}: {names}")
        experts, row_shape = shapes[0][0], shapes[0][2:]
        encodings = {self._encoding(name) for name in names} if len(shapes[0]) == 3 else {None}
        if len(encodings) == 1 and None not in encodings:
            (encoding,) = encodings
            each = sum(shape[1] for shape in shapes)
            stack = ExpertStack(QuantMatrix.empty(experts * each, row_shape[0], encoding.block, encoding.dtype,
                                                  encoding.scales), experts)
            for e in range(experts):
                row = e * each
                for name, shape in zip(names, shapes, strict=True):
                    self.jobs.append((name, stack.whole.rows(row, row + shape[1]), False, e * shape[1]))
                    row += shape[1]
            return stack
        if None not in encodings:
            return [self._stacked([(name, e * shape[1], shape[1], False) for name, shape in zip(names, shapes, strict=True)],
                                  row_shape) for e in range(experts)]
        out = self._alloc((experts, sum(shape[1] for shape in shapes), *row_shape))
        row = 0
        for name, shape in zip(names, shapes, strict=True):
            rows_per_expert = math.prod(shape[1:-1])  # of the tensor's [rows, last axis] table
            for e in range(experts):
                self.jobs.append((name, out[e, row:row + shape[1]], False, e * rows_per_expert))
            row += shape[1]
        return out

    def _add(self, name: str, out: np.ndarray) -> None:
        if self._info(name) != out.shape:
            raise ModelLoadError(f"tensor {name} has shape {self._info(name)}, expected {out.shape}")
        self.jobs.append((name, out, False, 0))

    def _info(self, name: str) -> tuple[int, ...]:
        info = self.gguf.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.gguf.path.name} lacks the tensor {name}")
        return info.shape

    def run(self, progress: Progress | None) -> None:
        """Dequantize every job; progress counts tensors, each done at its last job (an expert
        tensor is several jobs, interleaved with its fused partner's: gate, up, gate, ...)."""
        last = {name: i for i, (name, *_) in enumerate(self.jobs)}
        done = 0
        for i, (name, out, heads_permuted, first_row) in enumerate(self.jobs):
            if isinstance(out, QuantMatrix):
                self._encode_into(name, out, heads_permuted, first_row)
            else:
                self._dequantize_into(name, out, heads_permuted, first_row)
            if progress is not None and last[name] == i:
                done += 1
                progress(done, len(last))

    def _dequantize_into(self, name: str, out: np.ndarray, heads_permuted: bool, first_row: int) -> None:
        """Fill `out` a few rows at a time, from row `first_row` of the tensor (its values seen as
        rows of its last axis). `heads_permuted` undoes llama.cpp's Q/K row order (pairs
        (2i, 2i+1) of each head, for ggml's adjacent-pair RoPE) back to Hugging Face's halves
        (i, i + head_dim/2), so one NeoX-style RoPE serves every architecture."""
        info = self.gguf.tensors[name]
        qtype = info.qtype
        raw = np.asarray(self.gguf.raw(name))  # a plain view: memmap views cost Python calls
        if len(info.shape) == 1:  # norms and biases: small, and their blocks may span rows
            table = out.reshape(-1, 1)
            chunks: Iterable[tuple[int, np.ndarray]] = [(0, gguf_quants.dequantize(raw, qtype))]
        else:
            table = out.reshape(-1, info.shape[-1])  # a view
            step = max(1, CHUNK_ELEMENTS // table.shape[1])
            if heads_permuted:
                step = -(-step // self.head_dim) * self.head_dim
            rows = raw.reshape(info.n_elements // info.shape[-1], -1)[first_row:first_row + len(table)]
            # One flat row per call: `gguf` then dequantizes the chunk in one group instead of
            # one group per 16 rows, and blocks never straddle rows, so the result is the same.
            chunks = ((s, gguf_quants.dequantize(rows[s:s + step].reshape(1, -1), qtype))
                      for s in range(0, len(table), step))
        for start, chunk in chunks:
            if heads_permuted:
                chunk = chunk.reshape(-1, self.head_dim // 2, 2, table.shape[1]).transpose(0, 2, 1, 3)
            part = chunk.reshape(-1, table.shape[1])
            table[start:start + len(part)] = part

    def _encode_into(self, name: str, out: QuantMatrix, heads_permuted: bool, first_row: int) -> None:
        """Fill `out` with the tensor's own values from row `first_row` on, a few rows at a time
        (rows permuted as in `_dequantize_into`)."""
        info = self.gguf.tensors[name]
        columns = info.shape[-1]
        raw = np.asarray(self.gguf.raw(name))
        rows = raw.reshape(info.n_elements // columns, -1)[first_row:first_row + len(out)]
        step = max(1, CHUNK_ELEMENTS // columns)
        if heads_permuted:
            step = -(-step // self.head_dim) * self.head_dim
        for start in range(0, len(out), step):
            try:
                parts = encode(rows[start:start + step], info.qtype, columns)
            except ValueError as error:  # a scale the kept form cannot hold exactly
                raise ModelLoadError(f"{name}: {error}") from error
            for part, table in zip(parts, out.arrays, strict=True):
                if not table.shape[1]:  # no supers
                    continue
                if heads_permuted:
                    part = part.reshape(-1, self.head_dim // 2, 2, part.shape[1]).transpose(0, 2, 1, 3)
                part = part.reshape(-1, table.shape[1])
                table[start:start + len(part)] = part


def _retain_freed_heap() -> None:
    """Stop glibc from handing freed heap memory back to the kernel after every chunk.

    Each dequantized chunk makes a few temporaries of 256 KiB; by default glibc trims the heap
    top as soon as they are freed, so every chunk page-faults them in again. Keeping up to
    64 MiB of freed heap spares those faults, a large share of the load time, and also decode's
    per-step buffers (figures: docs/PERFORMANCE.md, measurements behind code choices).
    Process-wide; a no-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    except (OSError, AttributeError):
        return


def _size(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def weight_bytes(gguf: GGUFFile, config: ModelConfig, quantized: bool) -> int:
    """Bytes the loaded weights would take (each matrix in its type's encoding when `quantized`,
    everything else float32; a tied head counted once), from their layout: nothing is read."""
    return _plan(gguf, config, quantized)[1].nbytes


def check_memory(gguf: GGUFFile, need: int, available: int | None = None) -> None:
    """Refuse weights of `need` bytes that do not fit in `available` bytes (None: what psutil
    reports available now)."""
    available = psutil.virtual_memory().available if available is None else available
    if need > available:
        file_bytes = gguf.path.stat().st_size
        raise ModelLoadError(
            f"the NumPy engine needs {_size(need)} for this model's weights "
            f"({need / file_bytes:.1f}x the {_size(file_bytes)} file) but {_size(available)} is available; "
            "on a Mac use --engine mlx (it keeps the quantized weights), or pick a smaller quant/model")


def load_weights(gguf: GGUFFile, config: ModelConfig, progress: Progress | None = None,
                 available_memory: int | None = None, quantized: bool = False) -> ModelWeights:
    """Load every tensor the forward pass needs into fused matrices (kept in their encodings when
    `quantized`, the rest float32), after checking that they fit in memory (`available_memory`
    bytes; None: ask psutil)."""
    c = config
    for i in c.attention_layers:
        if c.head_size(i) % 2 or c.layer_rotary_dims(i) % 2:
            raise ModelLoadError(f"head dimension {c.head_size(i)} (rotated: {c.layer_rotary_dims(i)}) of layer {i} "
                                 "is odd; RoPE needs pairs")
    loader, weights = _plan(gguf, config, quantized)
    check_memory(gguf, weights.nbytes, available_memory)
    _retain_freed_heap()
    loader.run(progress)
    return weights


def _plan(gguf: GGUFFile, config: ModelConfig, quantized: bool) -> tuple[_Loader, ModelWeights]:
    """Every weight laid out (allocated, not yet touched) and the loader that fills them."""
    c = config
    loader = _Loader(gguf, c.head_dim, quantized)
    permute = c.rope_style == ROPE_INTERLEAVED
    embed = loader.matrix(_name(MODEL_TENSOR.TOKEN_EMBD), (c.vocab_size, c.hidden_size))
    layers = [_layer(loader, c, i, permute) for i in range(c.n_layers)]
    output_norm = loader.tensor(_name(MODEL_TENSOR.OUTPUT_NORM), (c.hidden_size,))
    output = embed
    if not c.tied_embeddings:
        output = loader.matrix(_name(MODEL_TENSOR.OUTPUT), (c.vocab_size, c.hidden_size))
    # Only the global layers read `rope_freqs` (Gemma 4's proportional rope; Llama 3 has no local ones).
    global_rope = rope_for(gguf, c, c.rope_theta, c.rope_linear_factor, c.layer_rotary_dims(_global_layer(c)),
                        c.has_rope_freqs)
    local_rope = None
    if c.rope_theta_local is not None and any(
            isinstance(layer.mixer, AttentionWeights) and layer.mixer.local_rope for layer in layers):
        sliding = next(i for i in c.attention_layers if c.sliding_layers[i])
        local_rope = rope_for(gguf, c, c.rope_theta_local, 1.0, c.layer_rotary_dims(sliding), False)
    return loader, ModelWeights(embed, layers, output_norm, output, global_rope, local_rope)


def _global_layer(c: ModelConfig) -> int:
    """An attention layer that does not slide (the first attention layer where all do)."""
    attention = c.attention_layers
    return next((i for i in attention if not (c.sliding_layers and c.sliding_layers[i])), attention[0])


def _layer(loader: _Loader, c: ModelConfig, i: int, permute: bool) -> LayerWeights:
    """One block's weights, named as llama.cpp's converter names them for the family."""
    tensors = loader.gguf.tensors
    hidden = c.hidden_size
    # The FFN's pre-norm: `ffn_norm`, except that gpt-oss and Qwen3.5 files call it
    # `post_attention_norm` (Hugging Face's post_attention_layernorm, which feeds the FFN); Gemma's
    # post norms are extra norms on each sub-block's output.
    ffn_norm = _name(MODEL_TENSOR.FFN_NORM, i)
    if ffn_norm not in tensors and not c.post_norms:
        ffn_norm = _name(MODEL_TENSOR.ATTN_POST_NORM, i)
    gate_up = down = None
    if not c.is_moe or c.moe_dense_ffn:
        if c.fused_gate_up:  # Phi-3: `ffn_up` holds the gate rows, then the up rows
            gate_up = loader.matrix(_name(MODEL_TENSOR.FFN_UP, i), (2 * c.ffn_size, hidden))
        else:
            gate_up = loader.fused([_name(MODEL_TENSOR.FFN_GATE, i), _name(MODEL_TENSOR.FFN_UP, i)])
        down = loader.matrix(_name(MODEL_TENSOR.FFN_DOWN, i), (hidden, c.ffn_size))

    def norm(kind: MODEL_TENSOR, present: bool) -> np.ndarray | None:
        return loader.tensor(_name(kind, i), (hidden,)) if present else None

    return LayerWeights(
        attn_norm=loader.tensor(_name(MODEL_TENSOR.ATTN_NORM, i), (hidden,)),
        mixer=_delta_net(loader, c, i) if c.is_recurrent(i) else _attention(loader, c, i, permute),
        ffn_norm=loader.tensor(ffn_norm, (hidden,)),
        gate_up=gate_up,
        down=down,
        experts=_experts(loader, c, i) if c.is_moe else None,
        post_attn_norm=norm(MODEL_TENSOR.ATTN_POST_NORM, c.post_norms),
        post_ffn_norm=norm(MODEL_TENSOR.FFN_POST_NORM, c.post_norms),
        dense_post_norm=norm(MODEL_TENSOR.FFN_POST_NORM_1, c.moe_dense_ffn),
        out_scale=loader.tensor(_name(MODEL_TENSOR.LAYER_OUT_SCALE, i), (1,)) if c.layer_output_scale else None,
    )


def _attention(loader: _Loader, c: ModelConfig, i: int, permute: bool) -> AttentionWeights:
    """An attention layer's projections, norms and options."""
    tensors = loader.gguf.tensors
    nq, nkv, hd = c.n_heads, c.kv_heads(i), c.head_size(i)
    from_keys = bool(c.values_from_keys) and c.values_from_keys[i]
    kinds = (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K) + (() if from_keys else (MODEL_TENSOR.ATTN_V,))
    permuted = (permute, permute, False)[:len(kinds)]
    if c.fused_qkv:  # Phi-3: one tensor, rows Q then K then V
        rows = (nq + 2 * nkv) * hd
        qkv = loader.matrix(_name(MODEL_TENSOR.ATTN_QKV, i), (rows, c.hidden_size))
        qkv_bias = None
        if _bias(MODEL_TENSOR.ATTN_QKV, i) in tensors:
            qkv_bias = loader.tensor(_bias(MODEL_TENSOR.ATTN_QKV, i), (rows,))
    else:
        qkv = loader.fused([_name(kind, i) for kind in kinds], permuted)
        qkv_bias = loader.fused([_bias(kind, i) for kind in kinds], permuted) if c.qkv_bias else None
    q_rows = nq * hd * (2 if c.attn_output_gate else 1)
    if len(qkv) != q_rows + nkv * hd * (len(kinds) - 1):
        raise ModelLoadError(f"the attention projections of layer {i} have {len(qkv)} rows, expected "
                             f"{q_rows + nkv * hd * (len(kinds) - 1)}")
    sliding = bool(c.sliding_layers) and c.sliding_layers[i] and c.sliding_window > 0
    return AttentionWeights(
        qkv=qkv,
        o=loader.matrix(_name(MODEL_TENSOR.ATTN_OUT, i), (c.hidden_size, nq * hd)),
        heads=(nq, nkv, hd),
        qkv_bias=qkv_bias,
        q_norm=loader.tensor(_name(MODEL_TENSOR.ATTN_Q_NORM, i), (hd,)) if c.qk_norm else None,
        k_norm=loader.tensor(_name(MODEL_TENSOR.ATTN_K_NORM, i), (hd,)) if c.qk_norm else None,
        o_bias=loader.tensor(_bias(MODEL_TENSOR.ATTN_OUT, i), (c.hidden_size,)) if c.o_bias else None,
        sinks=loader.tensor(_name(MODEL_TENSOR.ATTN_SINKS, i), (nq,)) if c.attn_sinks else None,
        window=c.sliding_window if sliding else 0,
        local_rope=sliding and c.rope_theta_local is not None,
        output_gate=c.attn_output_gate,
        values_from_keys=from_keys,
        value_norm=c.value_norm,
    )


def _delta_net(loader: _Loader, c: ModelConfig, i: int) -> DeltaNetWeights:
    """A Gated DeltaNet layer's tensors, as llama.cpp's converter writes them: q/k/v and z fused
    into one projection, beta and alpha into another (each step reads each once); V heads tiled."""
    la = c.linear_attention
    if la is None:
        raise ModelLoadError(f"layer {i} is recurrent but the file gives no ssm.* shapes")
    values = la.v_heads * la.head_v_dim
    in_proj = loader.fused([_name(MODEL_TENSOR.ATTN_QKV, i), _name(MODEL_TENSOR.ATTN_GATE, i)])
    ba = loader.fused([_name(MODEL_TENSOR.SSM_BETA, i), _name(MODEL_TENSOR.SSM_ALPHA, i)])
    if in_proj.shape != (la.conv_dim + values, c.hidden_size) or ba.shape != (2 * la.v_heads, c.hidden_size):
        raise ModelLoadError(f"the linear-attention projections of layer {i} have shapes {in_proj.shape} and "
                             f"{ba.shape}, expected {(la.conv_dim + values, c.hidden_size)} and "
                             f"{(2 * la.v_heads, c.hidden_size)}")
    return DeltaNetWeights(
        in_proj=in_proj,
        ba=ba,
        conv=loader.tensor(_name(MODEL_TENSOR.SSM_CONV1D, i), (la.conv_dim, la.conv_kernel)),
        dt_bias=loader.tensor(_bias(MODEL_TENSOR.SSM_DT, i), (la.v_heads,)),
        a=loader.tensor(TENSOR_NAMES[MODEL_TENSOR.SSM_A].format(bid=i), (la.v_heads,)),
        norm=loader.tensor(_name(MODEL_TENSOR.SSM_NORM, i), (la.head_v_dim,)),
        out=loader.matrix(_name(MODEL_TENSOR.SSM_OUT, i), (c.hidden_size, values)),
    )


def _experts(loader: _Loader, c: ModelConfig, i: int) -> ExpertWeights:
    """The router and the experts' `ffn_{gate,up,down}_exps` tensors (one slice per expert; gate
    and up may come fused as `ffn_gate_up_exps`), with Qwen3.5's shared expert and Gemma 4's
    router scales and norms."""
    tensors = loader.gguf.tensors
    n, hidden, ffn = c.n_experts, c.hidden_size, c.expert_ffn_size or c.ffn_size
    if _name(MODEL_TENSOR.FFN_GATE_UP_EXP, i) in tensors:
        gate_up = loader.experts([_name(MODEL_TENSOR.FFN_GATE_UP_EXP, i)])
    else:
        gate_up = loader.experts([_name(MODEL_TENSOR.FFN_GATE_EXP, i), _name(MODEL_TENSOR.FFN_UP_EXP, i)])
    down = loader.experts([_name(MODEL_TENSOR.FFN_DOWN_EXP, i)])
    for stack, shape in ((gate_up, (2 * ffn, hidden)), (down, (hidden, ffn))):
        if len(stack) != n or stack[0].shape != shape:
            raise ModelLoadError(f"expert tensors of layer {i} are {len(stack)} of shape {stack[0].shape}, "
                                 f"expected {n} of {shape}")
    bias = c.expert_bias
    gate, up = MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP
    shared = None
    shared_gate = _name(MODEL_TENSOR.FFN_GATE_INP_SHEXP, i)
    if shared_gate in tensors:
        shared_gate_up = loader.fused([_name(MODEL_TENSOR.FFN_GATE_SHEXP, i), _name(MODEL_TENSOR.FFN_UP_SHEXP, i)])
        shape = tensors[shared_gate].shape  # [hidden], or [1, hidden] as the converter writes it
        shared = SharedExpert(
            gate=loader.tensor(shared_gate, shape if math.prod(shape) == hidden else (hidden,)).reshape(hidden),
            gate_up=shared_gate_up,
            down=loader.matrix(_name(MODEL_TENSOR.FFN_DOWN_SHEXP, i), (hidden, len(shared_gate_up) // 2)))
    gemma = c.router == ROUTE_GEMMA4
    dense_beside = c.moe_dense_ffn
    return ExpertWeights(
        router=loader.matrix(_name(MODEL_TENSOR.FFN_GATE_INP, i), (n, hidden)),
        router_bias=loader.tensor(_bias(MODEL_TENSOR.FFN_GATE_INP, i), (n,)) if bias else None,
        gate_up=gate_up,
        gate_up_bias=loader.experts([_bias(gate, i), _bias(up, i)]) if bias else None,
        down=down,
        down_bias=loader.tensor(_bias(MODEL_TENSOR.FFN_DOWN_EXP, i), (n, hidden)) if bias else None,
        shared=shared,
        router_scale=loader.tensor(_scale(MODEL_TENSOR.FFN_GATE_INP, i), (hidden,)) if gemma else None,
        expert_scale=loader.tensor(_scale(MODEL_TENSOR.FFN_DOWN_EXP, i), (n,)) if gemma else None,
        norm=loader.tensor(_name(MODEL_TENSOR.FFN_PRE_NORM_2, i), (hidden,)) if dense_beside else None,
        post_norm=loader.tensor(_name(MODEL_TENSOR.FFN_POST_NORM_2, i), (hidden,)) if dense_beside else None,
    )


def kept_forms(weights: ModelWeights) -> set[tuple[np.dtype, np.dtype, int]]:
    """The (values, scales) dtypes of the matrices kept in their file's quants, with each form's
    block size (values a scale), which tells Q5_K from Q6_K (`amx_kernels.recipe_for`)."""
    return {(matrix.q.dtype, matrix.scale.dtype, matrix.block) for matrix in _quant_matrices([weights])}


def stacked_forms(weights: ModelWeights) -> set[tuple[np.dtype, np.dtype]]:
    """The (values, scales) dtypes of the expert stacks (their grouped kernel is compiled apart)."""
    return {(stack.whole.q.dtype, stack.whole.scale.dtype) for layer in weights.layers if layer.experts is not None
            for stack in (layer.experts.gate_up, layer.experts.down) if isinstance(stack, ExpertStack)}
