"""Load a GGUF model's weights as float32 NumPy arrays laid out for fast decoding.

Decode is bound by reading weights, so each layer's Q/K/V rows are fused into one matrix and
gate/up into another: one matrix product per fused weight instead of three or two. Matrices keep
GGUF's `[out, in]` row order, C-contiguous (measured: `W @ x.T` is as fast as or faster than any
pre-transposed layout for one row and for small batches, and it costs no transpose at load).

Tensors are dequantized 64K values at a time straight into their place in the fused matrices,
which all live in one arena (see `_Loader`): no extra copies, temporaries that stay in cache, and
one `gguf` call per 64K values rather than one per 16 rows. A thread pool of 2 was measured slower
(1.2-1.5 s against 0.7 s for SmolLM2): the `gguf` dequantizers are many small NumPy calls that
hold the GIL.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

import numpy as np
from gguf import MODEL_TENSOR, TENSOR_NAMES
from gguf import quants as gguf_quants

from lmserve.model.config import ROPE_INTERLEAVED, ModelConfig
from lmserve.model.gguf_file import GGUFFile, ModelLoadError

ALIGN = 16  # float32 values: every array starts on a 64-byte cache line
CHUNK_ELEMENTS = 1 << 16  # values dequantized per call: few calls, temporaries fit in L2 cache
_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed
_TRIM_THRESHOLD = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers

Progress = Callable[[int, int], None]


@dataclass
class LayerWeights:
    """One transformer block. Matrices are `[out, in]`; biases and norms are vectors."""

    attn_norm: np.ndarray
    qkv: np.ndarray  # rows: Q heads, then K heads, then V heads
    qkv_bias: np.ndarray | None  # qwen2
    q_norm: np.ndarray | None  # qwen3: per-head RMSNorm weight [head_dim]
    k_norm: np.ndarray | None
    o: np.ndarray
    ffn_norm: np.ndarray
    gate_up: np.ndarray  # rows: gate, then up
    down: np.ndarray


@dataclass
class ModelWeights:
    """Every weight the forward pass reads. `output` is `embed` itself when embeddings are tied."""

    embed: np.ndarray
    layers: list[LayerWeights]
    output_norm: np.ndarray
    output: np.ndarray
    inv_freq: np.ndarray  # RoPE inverse frequencies [head_dim // 2]

    @property
    def nbytes(self) -> int:
        """Resident bytes, counting a tied output matrix once."""
        arrays = {id(a): a for a in (self.embed, self.output_norm, self.output)}
        for layer in self.layers:
            for f in fields(layer):
                value = getattr(layer, f.name)
                if value is not None:
                    arrays[id(value)] = value
        return sum(a.nbytes for a in arrays.values())


def _name(kind: MODEL_TENSOR, block: int | None = None) -> str:
    return TENSOR_NAMES[kind].format(bid=block) + ".weight"


def _bias(kind: MODEL_TENSOR, block: int) -> str:
    return TENSOR_NAMES[kind].format(bid=block) + ".bias"


class _Loader:
    """Collects (tensor, destination) jobs first so progress knows the total, then runs them.

    Destinations are carved out of one arena big enough for every tensor in the file: NumPy
    asks the kernel for transparent huge pages on large allocations, so first-touching ~0.5 GB
    costs about 0.06 s instead of 0.2-0.6 s of 4 KiB page faults, and decode's weight
    stream needs fewer TLB entries. Untouched arena tail is never backed by memory.
    """

    def __init__(self, gguf: GGUFFile, head_dim: int) -> None:
        self.gguf = gguf
        self.head_dim = head_dim
        self.jobs: list[tuple[str, np.ndarray, bool]] = []
        size = sum(info.n_elements + ALIGN for info in gguf.tensors.values())
        self._arena = np.empty(size, dtype=np.float32)
        self._used = 0

    def _alloc(self, shape: tuple[int, ...]) -> np.ndarray:
        start = -(-self._used // ALIGN) * ALIGN
        self._used = start + int(np.prod(shape))
        return self._arena[start:self._used].reshape(shape)

    def tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A new float32 array to be filled from one tensor."""
        out = self._alloc(shape)
        self._add(name, out)
        return out

    def fused(self, names: list[str], permuted: tuple[bool, ...] | None = None) -> np.ndarray:
        """Several tensors stacked along their first axis into one contiguous array."""
        shapes = [self._info(name) for name in names]
        if len({shape[1:] for shape in shapes}) != 1:
            raise ModelLoadError(f"cannot fuse tensors of shapes {shapes}: {names}")
        out = self._alloc((sum(shape[0] for shape in shapes), *shapes[0][1:]))
        row = 0
        for i, (name, shape) in enumerate(zip(names, shapes, strict=True)):
            self._add(name, out[row:row + shape[0]], bool(permuted and permuted[i]))
            row += shape[0]
        return out

    def _add(self, name: str, out: np.ndarray, heads_permuted: bool = False) -> None:
        if self._info(name) != out.shape:
            raise ModelLoadError(f"tensor {name} has shape {self._info(name)}, expected {out.shape}")
        self.jobs.append((name, out, heads_permuted))

    def _info(self, name: str) -> tuple[int, ...]:
        info = self.gguf.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.gguf.path.name} lacks the tensor {name}")
        return info.shape

    def run(self, progress: Progress | None) -> None:
        for done, (name, out, heads_permuted) in enumerate(self.jobs, 1):
            self._dequantize_into(name, out, heads_permuted)
            if progress is not None:
                progress(done, len(self.jobs))

    def _dequantize_into(self, name: str, out: np.ndarray, heads_permuted: bool) -> None:
        """Fill `out` a few rows at a time. `heads_permuted` undoes llama.cpp's Q/K row order
        (pairs (2i, 2i+1) of each head, for ggml's adjacent-pair RoPE) back to Hugging Face's
        halves (i, i + head_dim/2), so one NeoX-style RoPE serves every architecture."""
        qtype = self.gguf.tensors[name].qtype
        raw = np.asarray(self.gguf.raw(name))  # a plain view: memmap views cost Python calls
        table = out.reshape(out.shape[0], -1)  # a view; vectors become one column
        if out.ndim == 1:  # norms and biases: small, and their blocks may span rows
            chunks: Iterable[tuple[int, np.ndarray]] = [(0, gguf_quants.dequantize(raw, qtype))]
        else:
            step = max(1, CHUNK_ELEMENTS // out.shape[1])
            if heads_permuted:
                step = -(-step // self.head_dim) * self.head_dim
            rows = raw.reshape(out.shape[0], -1)
            # One flat row per call: `gguf` then dequantizes the chunk in one group instead of
            # one group per 16 rows, and blocks never straddle rows, so the result is the same.
            chunks = ((s, gguf_quants.dequantize(rows[s:s + step].reshape(1, -1), qtype))
                      for s in range(0, out.shape[0], step))
        for start, chunk in chunks:
            if heads_permuted:
                chunk = chunk.reshape(-1, self.head_dim // 2, 2, table.shape[1]).transpose(0, 2, 1, 3)
            part = chunk.reshape(-1, table.shape[1])
            table[start:start + len(part)] = part


def _retain_freed_heap() -> None:
    """Stop glibc from handing freed heap memory back to the kernel after every chunk.

    Each dequantized chunk makes a few temporaries of 256 KiB; by default glibc trims the heap
    top as soon as they are freed, so every chunk page-faults them in again: about 380,000
    faults and 0.6 s for SmolLM2 (measured). Keeping up to 64 MiB of freed heap halves the
    load time and also spares decode's per-step buffers. Process-wide; a no-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    except (OSError, AttributeError):
        return


def load_weights(gguf: GGUFFile, config: ModelConfig, progress: Progress | None = None) -> ModelWeights:
    """Dequantize every tensor the forward pass needs into fused float32 matrices."""
    c = config
    _retain_freed_heap()
    if c.head_dim % 2:
        raise ModelLoadError(f"head dimension {c.head_dim} is odd; RoPE needs pairs")
    loader = _Loader(gguf, c.head_dim)
    permute = c.rope_style == ROPE_INTERLEAVED
    embed = loader.tensor(_name(MODEL_TENSOR.TOKEN_EMBD), (c.vocab_size, c.hidden_size))
    layers = []
    for i in range(c.n_layers):
        qkv = (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V)
        layers.append(LayerWeights(
            attn_norm=loader.tensor(_name(MODEL_TENSOR.ATTN_NORM, i), (c.hidden_size,)),
            qkv=loader.fused([_name(kind, i) for kind in qkv], (permute, permute, False)),
            qkv_bias=loader.fused([_bias(kind, i) for kind in qkv], (permute, permute, False))
            if c.qkv_bias else None,
            q_norm=loader.tensor(_name(MODEL_TENSOR.ATTN_Q_NORM, i), (c.head_dim,)) if c.qk_norm else None,
            k_norm=loader.tensor(_name(MODEL_TENSOR.ATTN_K_NORM, i), (c.head_dim,)) if c.qk_norm else None,
            o=loader.tensor(_name(MODEL_TENSOR.ATTN_OUT, i), (c.hidden_size, c.n_heads * c.head_dim)),
            ffn_norm=loader.tensor(_name(MODEL_TENSOR.FFN_NORM, i), (c.hidden_size,)),
            gate_up=loader.fused([_name(MODEL_TENSOR.FFN_GATE, i), _name(MODEL_TENSOR.FFN_UP, i)]),
            down=loader.tensor(_name(MODEL_TENSOR.FFN_DOWN, i), (c.hidden_size, c.ffn_size)),
        ))
    output_norm = loader.tensor(_name(MODEL_TENSOR.OUTPUT_NORM), (c.hidden_size,))
    output = embed
    if not c.tied_embeddings:
        output = loader.tensor(_name(MODEL_TENSOR.OUTPUT), (c.vocab_size, c.hidden_size))
    loader.run(progress)
    return ModelWeights(embed, layers, output_norm, output, _inv_freq(gguf, c))


def _inv_freq(gguf: GGUFFile, config: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies; Llama 3.x files carry per-frequency divisors in `rope_freqs`."""
    dims = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
    inv_freq = config.rope_theta ** -dims
    factors = _name(MODEL_TENSOR.ROPE_FREQS)
    if factors in gguf.tensors:
        inv_freq = inv_freq / gguf.dequantize(factors).astype(np.float64)
    return inv_freq
