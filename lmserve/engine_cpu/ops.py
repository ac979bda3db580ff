"""The NumPy building blocks of the forward pass, all in float32 (weights may be quantized)."""

from __future__ import annotations

import functools
import importlib
import math
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

import numpy as np

from lmserve.engine_cpu.kv_codec import Q4_FACTORS
from lmserve.engine_cpu.qmatrix import Matrix
from lmserve.model.families import GELU_TANH, SILU, SWIGLU_OAI


def _cpus() -> int:
    """CPUs this process may run on: the threads BLAS starts by default."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Up to this many rows, one matrix-vector product per row beats one matrix product: OpenBLAS's GEMM
# packs the weights and runs a kernel built for wide right-hand sides, so for 2-7 rows it reads them
# slower than the blocked products below, and at 8 rows they are even
# (figures: docs/PERFORMANCE.md, measurements behind code choices).
GEMV_ROWS = 7
# The products run one block of matrix rows at a time, every row of `x` against the block while it
# is in cache: the first product reads the block from memory, the others from L2. BLAS splits a
# block's rows between its threads the same way each time, so each core finds its share in its own
# L2 when it has 1.5 MiB a thread (on 2 MiB L2 cores: smaller blocks pay for calls, larger ones lose
# the reuse; figures: docs/PERFORMANCE.md, measurements behind code choices).
BLOCK_BYTES = (3 << 19) * _cpus()
# Rows a block holds a whole number of: BLAS runs a ragged group of rows (of a block, or of a
# thread's share of it) down another path, which rounds differently from the same rows inside the
# one-row product; with whole groups each row's result has the one-row product's bits.
GROUP = 16 * _cpus()
# Attention scores of at most this many query rows a KV head (a decode step's) run as the keys
# times the queries once their product is past SMALL_PRODUCT values multiplied, where OpenBLAS
# leaves its small-matrix kernel (`_scores`; figures: docs/PERFORMANCE.md, measurements behind
# code choices). Up to as many, a q8_0 / q4_0 / f16 cache's rows are read by `block_attention_kernel`:
# at 64 rows unpacking them into float32 for BLAS costs less (ibid.).
FEW_QUERY_ROWS = 16
SMALL_PRODUCT = 1 << 16
# A decode step's (or verify pass's) attention over a float32 cache runs as one compiled call a
# cache (`row_attention_kernel`: the rope, the cache writes, scores, softmax and mix) while it reads
# at most this many positions: with its heads on the kernels' threads it was as fast as NumPy's
# threaded products or faster at every context measured, up to this one (figures:
# docs/PERFORMANCE.md, a decode step's attention on threads).
ONE_CALL_POSITIONS = 32768
# A prompt chunk's attention products run this many query positions at a time, each run over the
# keys it sees only (`_attention_products`; figures: docs/PERFORMANCE.md, measurements behind code
# choices).
CAUSAL_RUN = 128
# A softmax over at least this many scores (a prompt pass's, about a millisecond of work a part) is
# split between the CPUs, a range of rows on each (`_softmax`; figures: docs/PERFORMANCE.md,
# measurements behind code choices).
THREADED_SCORES = 1 << 20
# A prompt pass's norms and SwiGLU (a row-wise compiled loop over at least this many values, a
# fraction of a millisecond) are split between the CPUs the same way (`in_parts`; figures:
# docs/PERFORMANCE.md, measurements behind code choices).
THREADED_ROWS = 1 << 17


def linear(x: np.ndarray, w: Matrix) -> np.ndarray:
    """`x [n, in]` times `w [out, in]` transposed (kept quants run their own kernels). For float32
    weights, in the order measured fastest for `n`: up to
    GEMV_ROWS rows each row's result is, up to rounding and bit for bit where the matrix splits into
    whole groups (SmolLM2 on 2 CPUs), that row's alone: a sequence decodes to the same logits
    whatever it is batched with."""
    if not isinstance(w, np.ndarray):
        return w.times(x)
    n = len(x)
    if n == 1:
        return (w @ x[0])[None]
    if n > GEMV_ROWS:  # the same bits as `(w @ x.T).T`, a little more BLAS time, but rows come out
        return x @ w.T  # C-ordered: the rest of the layer then walks contiguous memory
    out = np.empty((n, len(w)), dtype=np.result_type(x, w))
    blocks = max(1, round(w.nbytes / BLOCK_BYTES))
    rows = -(-len(w) // blocks // GROUP) * GROUP
    vectors = x[:, :, None]  # [n, in, 1]: one call runs the n matrix-vector products on a block
    for start in range(0, len(w), rows):
        np.matmul(w[start:start + rows], vectors, out=out[:, start:start + rows, None])
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: `x / sqrt(mean(x^2) + eps) * weight` (no weight: Gemma 4's
    value norm). Compiled where Numba is (`norm_kernel`, the same bits; a prompt pass's rows split
    between the CPUs, `in_parts`), else written out in
    place (np.mean's Python wrapper costs more than the arithmetic on one row); the same bits as
    `np.mean(np.square(x), -1, dtype=float32)`: float32 sum, then the division by the count
    (np.mean divides in float64 and rounds, which for one division is the same)."""
    compiled = _compiled_norm()
    if compiled is not None:
        rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
        out = np.empty(rows.shape, np.float32)
        weight, eps = NO_WEIGHT if weight is None else weight, np.float32(eps)
        in_parts(lambda lo, hi: compiled(rows[lo:hi], weight, eps, out[lo:hi]), len(rows), rows.size, THREADED_ROWS)
        return out.reshape(x.shape)
    scale = np.add.reduce(np.square(x), axis=-1, keepdims=True)
    scale /= np.float32(x.shape[-1])
    scale += np.float32(eps)
    np.sqrt(scale, out=scale)
    out = np.divide(x, scale)
    if weight is not None:
        out *= weight
    return out


NO_WEIGHT = np.empty(0, np.float32)


def _compiled_norm() -> Callable[..., None] | None:
    """`norm_kernel.rms_norm`, or None where Numba is not installed (macOS)."""
    module = compiled("norm_kernel")
    return None if module is None else module.rms_norm


@functools.cache
def compiled(name: str) -> ModuleType | None:
    """The compiled module `lmserve.engine_cpu.<name>`, or None where Numba is not installed (macOS)."""
    try:
        return importlib.import_module(f"lmserve.engine_cpu.{name}")
    except ImportError:
        return None


def prepare(kv_type: str, experts: bool) -> None:
    """Compile the kernels a pass calls beside the weights' products and the decode halves (or load
    them from Numba's cache) without running them, for the argument types the passes give: every
    prompt's norms and softmax, the attention of a pass of several float32 caches (a decode step's
    rows are C-ordered views, a verify pass's strided ones) and a prompt's rotation into one, a
    quantized cache's writer and readers (`kv_type`), a MoE's router and weighted sum (`experts`),
    a prompt's attention on AMX tiles where they run. Compiled
    lazily, a fresh install's first prompt and first concurrent streams waited seconds for them."""
    norm = compiled("norm_kernel")
    if norm is None:
        return
    import numba

    matrix, vector, cube = np.empty((1, 1), np.float32), np.empty(1, np.float32), np.empty((1, 1, 1), np.float32)
    calls: list[tuple[Callable, tuple]] = [
        (norm.rms_norm, (matrix, vector, np.float32(0), matrix)),
        (compiled("softmax_kernel").causal_softmax, (cube, 0, 0, 0, np.float32(0), 0, vector, 0, 0))]
    strided = np.empty((2, 2, 1), np.float32)[:, :1]
    rows = compiled("row_attention_kernel")
    part = np.empty((2, 2, 1, 1), np.float32)[:, :1]  # a part of a pass's query rows laid out by KV head
    for qk, v in ((cube, cube), (strided, strided), (strided, cube)):  # (strided, C): Gemma 4's normed values
        calls += [(rows.attend_rows, (qk, v, cube, cube, cube, cube, 0, np.float32(0), 0, NO_SINKS, cube))]
        calls += [(rows.rope_rows, (qk, v, cube, cube, cube, cube, 0, q, True)) for q in (part[:1], part)]
    blocks, stored = compiled("block_attention_kernel"), np.empty((1, 1, 1), np.uint8)
    if kv_type in blocks.KINDS:
        for qk, v in ((cube, cube), (strided, strided), (strided, cube)):
            calls.append((blocks.attend_rows, (qk, v, cube, cube, stored, stored, 0, np.float32(0), 0, NO_SINKS, 0,
                                               Q4_FACTORS, cube)))
    if kv_type in ("q8_0", "q4_0"):  # a prompt's rows, written by `KVCodec.encode`
        encode = compiled("kv_encode_kernel")
        writer = ((encode.q8_0_blocks, (matrix, stored[0])) if kv_type == "q8_0"
                  else (encode.q4_0_blocks, (matrix, stored[0], Q4_FACTORS)))
        calls.append(writer)
    if experts:
        moe = compiled("moe_kernel")
        ids = np.empty(1, np.int64)
        calls += [(moe.router_logits, (matrix, matrix, matrix)),
                  (moe.route, (matrix, True, np.empty((1, 1), np.int64), matrix)),
                  (moe.add_weighted, (matrix, vector, ids, 0, matrix, 0, 0))]
    for function, arguments in calls:
        function.compile(tuple(numba.typeof(argument) for argument in arguments))
    compiled("amx_attention").prepare()


def sigmoid(x: np.ndarray) -> np.ndarray:
    """The logistic function in its tanh form, which never overflows: (tanh(x / 2) + 1) / 2."""
    out = np.multiply(x, np.float32(0.5))
    np.tanh(out, out=out)
    out += np.float32(1)
    out *= np.float32(0.5)
    return out


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """SwiGLU: silu(gate) * up for `[..., 2 * ffn]` rows of gate then up, by
    `decode_layer_kernel.silu_mul` where Numba is (the compiled FFN half's too, so every path
    gives a row the same bits; a prompt pass's rows split between the CPUs, `in_parts`), else in
    NumPy in one buffer, by the tanh form of the sigmoid, which never overflows, so large
    negative gates raise no warnings."""
    half = gate_up.shape[-1] // 2
    kernel = compiled("decode_layer_kernel")
    if kernel is not None:
        rows = np.ascontiguousarray(gate_up, np.float32).reshape(-1, 2 * half)
        out = np.empty((len(rows), half), np.float32)
        in_parts(lambda lo, hi: kernel.silu_mul(rows[lo:hi], out[lo:hi]), len(rows), rows.size, THREADED_ROWS)
        return out.reshape(*gate_up.shape[:-1], half)
    gate, up = gate_up[..., :half], gate_up[..., half:]
    out = np.multiply(gate, np.float32(0.5))
    np.tanh(out, out=out)
    out += np.float32(1)
    np.multiply(gate, out, out=out)
    out *= np.float32(0.5)
    out *= up
    return out


def gelu_tanh_mul(gate_up: np.ndarray) -> np.ndarray:
    """GeGLU (Gemma): gelu(gate) * up with GELU's tanh approximation (`gelu_pytorch_tanh`)."""
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :half], gate_up[..., half:]
    inner = gate * (np.float32(1) + np.float32(0.044715) * gate * gate) * np.float32(np.sqrt(2 / np.pi))
    return gate * (np.tanh(inner) + np.float32(1)) * np.float32(0.5) * up


OAI_ALPHA, OAI_LIMIT = np.float32(1.702), np.float32(7.0)  # gpt-oss's swiglu_alpha and swiglu_limit


def swiglu_oai_mul(gate_up: np.ndarray) -> np.ndarray:
    """gpt-oss's clamped SwiGLU (Hugging Face's GptOssExperts): gate = min(gate, 7),
    up = clip(up, -7, 7), gate * sigmoid(1.702 * gate) * (up + 1)."""
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :half], gate_up[..., half:]
    gate = np.minimum(gate, OAI_LIMIT)
    up = np.clip(up, -OAI_LIMIT, OAI_LIMIT)
    sigmoid = (np.tanh(gate * (OAI_ALPHA * np.float32(0.5))) + np.float32(1)) * np.float32(0.5)
    return gate * sigmoid * (up + np.float32(1))


GATED_ACTIVATIONS = {SILU: silu_mul, GELU_TANH: gelu_tanh_mul, SWIGLU_OAI: swiglu_oai_mul}


def gated_ffn(x: np.ndarray, gate_up: Matrix, down: Matrix,
              activation: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """A dense gated FFN: `down(activation(gate_up(x)))`, gate and up in one fused matrix."""
    return linear(activation(linear(x, gate_up)), down)


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin `[n, 1, rotary_dims]` for each row's position (computed in float64), times
    `scale` (YaRN's attention factor), laid out for `rope`: cos twice, then -sin and sin."""
    angles = np.outer(positions, inv_freq)[:, None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.astype(np.float32), sin.astype(np.float32)
    return np.concatenate([cos, cos], axis=-1), np.concatenate([-sin, sin], axis=-1)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate `[n, heads, head_dim]` by pairing dimension i with i + rotary_dims/2 (NeoX style);
    with partial rotary (tables narrower than a head) the remaining dimensions pass through.
    Computed as `x * cos + swap_halves(x) * sin`, rotate_half's minus sign carried by the sin
    table: the same bits as `first * cos - second * sin` and `second * cos + first * sin`, in
    four whole-width ops."""
    rotary = cos.shape[-1]
    half = rotary // 2
    rotated = x[..., :rotary]
    swapped = np.concatenate([rotated[..., half:], rotated[..., :half]], axis=-1)
    swapped *= sin
    if rotary == x.shape[-1]:
        out = np.multiply(x, cos)
        out += swapped
        return out
    out = np.empty(x.shape, dtype=np.float32)
    np.multiply(rotated, cos, out=out[..., :rotary])
    out[..., :rotary] += swapped
    out[..., rotary:] = x[..., rotary:]
    return out


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, scale: float,
              window: int = 0, sinks: np.ndarray | None = None, scratch: Scratch | None = None) -> np.ndarray:
    """Causal attention of `n` new queries at positions `start..start+n-1`.

    q: `[n, heads, head_dim]`; keys, values: `[kv_heads, start + n, head_dim]`, with the new
    positions already written. Query head h reads KV head h // (heads // kv_heads). Scores are
    scaled by `scale`. `window`: a query at position p sees keys in (p - window, p] only (sliding
    window; 0: all). `sinks` `[heads]`: one logit per head that joins the softmax's denominator
    and nothing else (gpt-oss). `scratch`: the pass's buffer for the scores. Returns `[n, heads *
    head_dim]`.
    """
    n, n_heads, head_dim = q.shape
    kv_heads = keys.shape[0]
    group = n_heads // kv_heads
    qg = q.reshape(n, kv_heads, group, head_dim).transpose(1, 0, 2, 3).reshape(kv_heads, n * group, head_dim)
    out = grouped_attention(qg, n, keys, values, start, scale, window, sinks, scratch)
    return out.reshape(kv_heads, n, group, head_dim).transpose(1, 0, 2, 3).reshape(n, n_heads * head_dim)


def grouped_attention(qg: np.ndarray, n: int, keys: np.ndarray, values: np.ndarray, start: int, scale: float,
                      window: int = 0, sinks: np.ndarray | None = None, scratch: Scratch | None = None) -> np.ndarray:
    """`attention` of queries laid out a KV head's rows together, a position's group in a run
    (row `i * group + g` of `qg` `[kv_heads, n * group, head_dim]`: query head `h * group + g` at
    position `start + i`), so a run of positions is a run of rows; the result in that layout."""
    first = max(0, start - window + 1) if window else 0  # no query here sees a key before it
    if first:
        keys, values = keys[:, first:], values[:, first:]
    return _attention_products(qg, keys, values, n, start, first, scale, window, sinks, scratch)


def _attention_products(qg: np.ndarray, keys: np.ndarray, values: np.ndarray, n: int, start: int, first: int,
                        scale: float, window: int, sinks: np.ndarray | None, scratch: Scratch | None) -> np.ndarray:
    """`attention`'s scores, softmax and mix in BLAS (`qg` `[kv_heads, n * group, head_dim]`):
    for a prompt chunk, each run of CAUSAL_RUN positions multiplies only the keys some query of it
    sees, so the masked half of the chunk's products is mostly skipped; one softmax takes the
    whole chunk (it reads only the scores a query sees and zeroes the rest)."""
    kv_heads, rows, head = qg.shape
    tiles = compiled("amx_attention")
    if tiles is not None and tiles.takes(n, head):
        return tiles.attend(qg, keys, values, n, start, first, scale, window,
                            NO_SINKS if sinks is None else np.ascontiguousarray(sinks, np.float32))
    group, seen = rows // n, keys.shape[1]
    runs = _visible_runs(n, start, first, window, seen)
    if len(runs) == 1:
        scores = _scores(qg, keys, scratch)
        _softmax(scores, n, start, first, scale, window, sinks)
        return scores @ values  # [kv_heads, n * group, head_dim]
    shape = (kv_heads, rows, seen)
    scores = np.empty(shape, np.float32) if scratch is None else scratch.take(shape)
    for lo, hi, begin, stop in runs:
        np.matmul(qg[:, lo * group:hi * group], keys[:, begin:stop].transpose(0, 2, 1),
                  out=scores[:, lo * group:hi * group, begin:stop])
    _softmax(scores, n, start, first, scale, window, sinks)
    out = np.empty_like(qg)
    for lo, hi, begin, stop in runs:
        np.matmul(scores[:, lo * group:hi * group, begin:stop], values[:, begin:stop], out=out[:, lo * group:hi * group])
    return out


def _visible_runs(n: int, start: int, first: int, window: int, seen: int) -> list[tuple[int, int, int, int]]:
    """`(lo, hi, begin, stop)`: queries `lo:hi` of a pass of `n` from position `start` see no
    key outside columns `begin:stop` (key columns from position `first`): runs of CAUSAL_RUN
    queries, or one run over every column for a pass of at most that many."""
    if n <= CAUSAL_RUN:
        return [(0, n, 0, seen)]
    return [(lo, min(n, lo + CAUSAL_RUN), max(0, start + lo - window + 1 - first) if window else 0,
             start + min(n, lo + CAUSAL_RUN) - first) for lo in range(0, n, CAUSAL_RUN)]


def prompt_attention_on_tiles(head_sizes: Iterable[int]) -> bool:
    """Whether a prompt pass's attention runs on AMX tiles (`amx_attention.enabled`) in some layer
    of these head sizes: what the banner and /health name."""
    tiles = compiled("amx_attention")
    return tiles is not None and any(tiles.enabled(size) for size in head_sizes)


def reads_blocks(query_rows: int) -> bool:
    """Whether a pass of `query_rows` rows a KV head reads a q8_0, q4_0 or f16 cache's rows
    themselves (`block_attention_kernel.attend_rows`): where Numba is installed, and for a decode
    step's or verify pass's few rows, whose one use of each position's keys and values costs less
    than unpacking them into float32 for BLAS (a prompt pass's hundreds of rows run faster in
    BLAS)."""
    return query_rows <= FEW_QUERY_ROWS and compiled("block_attention_kernel") is not None


def attends_in_one_call(query_rows: int, positions: int, blocks: str | None = None) -> bool:
    """Whether `attend_rows` takes a pass of `query_rows` rows a KV head over a cache that it reads
    `positions` of: a decode step's or verify pass's few rows, where Numba is; a float32 cache's
    up to ONE_CALL_POSITIONS, a `blocks` cache's ("q8_0", "q4_0", "f16": its readers are
    `reads_blocks`' at any length) always."""
    if blocks is not None:
        return reads_blocks(query_rows)
    return (query_rows <= FEW_QUERY_ROWS and positions <= ONE_CALL_POSITIONS
            and compiled("row_attention_kernel") is not None)


def attend_rows(qk: np.ndarray, v: np.ndarray, cos: np.ndarray, sin: np.ndarray, keys: np.ndarray,
                values: np.ndarray, start: int, scale: float, window: int, sinks: np.ndarray | None,
                out: np.ndarray, blocks: str | None = None) -> None:
    """`row_attention_kernel.attend_rows`, or for a `blocks` cache `block_attention_kernel`'s
    (where `attends_in_one_call`): one cache's new rows rotated, written and attended, into `out`
    `[n, heads, head_dim]`."""
    sinks = NO_SINKS if sinks is None else np.ascontiguousarray(sinks, np.float32)
    if blocks is None:
        compiled("row_attention_kernel").attend_rows(qk, v, cos, sin, keys, values, start, np.float32(scale), window,
                                                     sinks, out)
        return
    compiled("block_attention_kernel").attend_rows(qk, v, cos, sin, *stored_rows(keys, values, blocks), start,
                                                   np.float32(scale), window, sinks, *block_kind(blocks), out)


def stored_rows(keys: np.ndarray, values: np.ndarray, blocks: str | None) -> tuple[np.ndarray, np.ndarray]:
    """A layer's cached keys and values as the one-call kernels take them: a float32 cache's as
    they are, a `blocks` cache's as bytes."""
    return (keys, values) if blocks is None else (keys.view(np.uint8), values.view(np.uint8))


def block_kind(blocks: str | None) -> tuple[int, np.ndarray]:
    """`block_attention_kernel.attend_rows`' `kind` of a `blocks` cache (-1 for float32) and
    q4_0's scales to try."""
    return (-1 if blocks is None else compiled("block_attention_kernel").KINDS[blocks]), Q4_FACTORS


NO_SINKS = np.empty(0, np.float32)


class Scratch:
    """A float32 buffer that a forward pass's layers write their attention scores into in turn.
    A new array past glibc's mmap threshold (32 MiB at most: a long prompt's scores) is fresh
    pages that the kernel zeroes at first touch, and the product writing them ran at half speed
    (figures: docs/PERFORMANCE.md, measurements behind code choices). The engine keeps one between
    passes while it holds no more than `KEPT_SCRATCH` bytes: a served prompt is a pass a chunk,
    and the first layer of each wrote fresh pages again (a long prompt's larger buffer is not kept)."""

    def __init__(self) -> None:
        self._flat = np.empty(0, np.float32)

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        """A `shape` array over the buffer (grown to fit), valid until the next `take`."""
        size = math.prod(shape)
        if size > self._flat.size:
            self._flat = np.empty(size, np.float32)
        return self._flat[:size].reshape(shape)

    @property
    def nbytes(self) -> int:
        """The bytes the buffer holds."""
        return self._flat.nbytes

    def release_past(self, nbytes: int) -> None:
        """Drop the buffer if it holds more than `nbytes`: what a pass leaves for the next."""
        if self.nbytes > nbytes:
            self._flat = np.empty(0, np.float32)


def _scores(qg: np.ndarray, keys: np.ndarray, scratch: Scratch | None = None) -> np.ndarray:
    """`qg [kv_heads, rows, head_dim]` times the keys transposed: `[kv_heads, rows, seen]`, in
    `scratch` where given. For a decode step's few query rows past OpenBLAS's small-matrix path,
    as the keys times the queries (the positions as BLAS's long side), which runs 2-3x faster
    there, where this machine's BLAS gives that form the same bits (`_transposed_scores_agree`;
    figures: docs/PERFORMANCE.md, measurements behind code choices)."""
    (kv_heads, rows, _), (_, seen, head_dim) = qg.shape, keys.shape
    if rows <= FEW_QUERY_ROWS and rows * seen * head_dim > SMALL_PRODUCT and _transposed_scores_agree():
        return np.ascontiguousarray(np.matmul(keys, qg.transpose(0, 2, 1)).transpose(0, 2, 1))
    out = None if scratch is None else scratch.take((kv_heads, rows, seen))
    return np.matmul(qg, keys.transpose(0, 2, 1), out=out)


@functools.cache
def _transposed_scores_agree() -> bool:
    """Whether this machine's BLAS gives keys times queries the bits of queries times keys, for
    decode-shaped scores past SMALL_PRODUCT. It does with OpenBLAS's AVX-512 kernels; with its
    AVX2 ones (an AMD EPYC, Zen 3) it does not, and a decode step's scores would then differ from
    a prompt pass's over the same positions. Checked once, on the shapes decode steps take."""
    rng = np.random.default_rng(0)
    for kv_heads, rows, head_dim, seen in ((3, 3, 64, 700), (4, 16, 64, 5000), (8, 4, 128, 700), (1, 8, 256, 50)):
        qg = rng.standard_normal((kv_heads, rows, head_dim)).astype(np.float32)
        keys = rng.standard_normal((kv_heads, seen + 30, head_dim)).astype(np.float32)[:, :seen]
        transposed = np.matmul(keys, qg.transpose(0, 2, 1)).transpose(0, 2, 1)
        if not np.array_equal(transposed, np.matmul(qg, keys.transpose(0, 2, 1))):
            return False
    return True


def _softmax(scores: np.ndarray, n: int, start: int, first: int, scale: float, window: int,
             sinks: np.ndarray | None) -> None:
    """`softmax_kernel.causal_softmax` over all rows of `scores`: compiled, a part of the rows on
    each CPU once they are `THREADED_SCORES` or more (on plain threads, which block rather than
    spin while they wait: with another process on a core the split costs nothing), else NumPy's."""
    compiled = _compiled_softmax()
    if compiled is None:
        _numpy_softmax(scores, n, start, first, scale, window, sinks)
        return
    run = functools.partial(compiled, scores, n, start, first, np.float32(scale), window,
                            NO_SINKS if sinks is None else np.ascontiguousarray(sinks, np.float32))
    in_parts(run, scores.shape[0] * scores.shape[1], scores.size, THREADED_SCORES)


def in_parts(run: Callable[[int, int], None], rows: int, values: int, threshold: int) -> None:
    """`run(lo, hi)` over rows `0:rows`: a range on each CPU once `values` reach `threshold` (on
    plain threads, which block rather than spin while they wait: with another process on a core
    the split costs nothing), else in one call on this thread. `run` must not call this itself."""
    parts = min(rows, values // threshold)
    if parts > 1:  # asked only here: the system call cost a decode step 1% (30 layers)
        parts = min(parts, _cpus())
    if parts <= 1:  # a decode step's: no hand-off
        run(0, rows)
        return
    bounds = [rows * i // parts for i in range(parts + 1)]
    helped = [_helpers().submit(run, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:], strict=True)]
    run(0, bounds[1])
    for part in helped:
        part.result()


@functools.cache
def _helpers() -> ThreadPoolExecutor:
    """The threads that run the other parts of a split kernel (`in_parts`)."""
    return ThreadPoolExecutor(max(1, _cpus() - 1), thread_name_prefix="lmserve-parts")


def _compiled_softmax() -> Callable[..., None] | None:
    """`softmax_kernel.causal_softmax`, or None where Numba is not installed (macOS)."""
    module = compiled("softmax_kernel")
    return None if module is None else module.causal_softmax


def _numpy_softmax(scores: np.ndarray, n: int, start: int, first: int, scale: float, window: int,
                   sinks: np.ndarray | None) -> None:
    """`softmax_kernel.causal_softmax` in NumPy, where it is not compiled."""
    kv_heads, _, seen = scores.shape
    group = scores.shape[1] // n
    scores *= np.float32(scale)
    if n > 1:
        key_pos, query_pos = np.arange(first, first + seen)[None, :], np.arange(start, start + n)[:, None]
        hidden = key_pos > query_pos
        if window:
            hidden |= key_pos <= query_pos - window
        scores.reshape(kv_heads, n, group, seen).transpose(0, 2, 1, 3)[:, :, hidden] = -np.inf
    peak = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = np.broadcast_to(sinks.reshape(kv_heads, 1, group), (kv_heads, n, group)).reshape(kv_heads, n * group, 1)
        peak = np.maximum(peak, sink)
    scores -= peak
    np.exp(scores, out=scores)
    denominator = scores.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denominator += np.exp(sink - peak)
    scores /= denominator
