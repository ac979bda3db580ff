"""The NumPy engine: the Engine protocol on any CPU, activations in float32.

Weight matrices stay in the file's quants where compiled kernels can read them (`qmatrix`), and
are dequantized to float32 otherwise.

A step stacks the hidden states of every row it advances (all prompt tokens in prefill, one token
per sequence in batched decode), so each weight matrix is read once per step; only the mixers
(attention, Gated DeltaNet's recurrence) run per sequence, over that sequence's own cache
(`batch.py`). A mixture-of-experts FFN groups the rows by the experts they are routed to
(`moe.py`), so each selected expert's matrices are read once per step and the others not at all.

Sliding-window layers keep every position in the cache like the others (so truncating, copying
and saving a cache stay one slice), and attend to the window's positions only.

Hybrid models (Qwen3.5 / 3.6) keep each recurrent layer's state instead of its keys and values
(`cache.py`). Cutting such a cache back restores the latest state it kept at or below the cut (a
checkpoint, or the state from before the last verify pass) and feeds the remembered token ids from
there to the cut again, a prefill without logits: truncating, copying a prefix or loading gives
the cache that was fed the prefix.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from lmserve.engine.chunks import even_chunk
from lmserve.engine.kv_types import AUTO, KV_TYPES, check_head_sizes
from lmserve.engine.protocol import Engine, check_token_ids, verify_rows
from lmserve.engine_cpu import decode_layer, delta_net, ops
from lmserve.engine_cpu.attention import attend
from lmserve.engine_cpu.batch import Batch
from lmserve.engine_cpu.cache import CPUCache, Layout
from lmserve.engine_cpu.ffn import feed_forward
from lmserve.engine_cpu.qmatrix import KERNEL_ROWS
from lmserve.engine_cpu.threads import ThreadTuner, blas_threads
from lmserve.engine_cpu.weights import DeltaNetWeights, kept_forms, load_weights, stacked_forms
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile

FORWARD_CHUNK = 2048  # prompt tokens a forward pass at most (`_pass_rows`), as mlx-lm's prefill step
LONG_PASS_ROWS = 256  # the fewest rows `_pass_rows` halves a pass to (a long prompt's, for its scores)
# Bytes of a pass's widest activations (a row's FFN or experts' gate and up outputs, or its Q, K
# and V) past which a pass takes fewer rows: a dense 8B model's gate and up outputs are 112 KiB a
# row, so its passes take about 1,170 rows; SmolLM2's and the synthetic MoE's the whole 2,048.
ACTIVATION_BUDGET = 128 * 2**20
# Passes of up to this many rows have their kernels' thread count tuned (`ThreadTuner`): verify
# passes of several streams and short prompts as well as decode steps. With a core busy, served MoE
# verify passes of 32-64 rows on every thread took 400-770 ms where a 24-row pass on one took 59.
TUNED_ROWS = 128
SCORES_BUDGET = 256 * 2**20  # bytes of a pass's attention scores past which its rows halve (a long prompt's)
# The most bytes of attention scores' buffer (`ops.Scratch`) kept from one pass for the next: a
# 512-token chunk's after 1,024 positions of 16 query heads (32 MiB) is; a long prompt's is not.
KEPT_SCRATCH = 64 * 2**20


class CPUEngine(Engine[CPUCache]):
    """Every family of `model/families.py` (Llama, Mistral, Qwen2, Qwen3, Qwen3 MoE, Gemma 3,
    Phi-3, gpt-oss, Qwen3.5 and its MoE, Gemma 4) on NumPy float32 and quantized-matrix kernels."""

    name = "cpu"
    state_dtype_bytes = 4  # recurrent states are kept as float32 whatever --kv-type says
    quant_summary = ""  # the file's own values are kept (quantized or float32): nothing converted to report
    device_argmax = False  # the logits are on the host already: an argmax here saves nothing

    def __init__(self, gguf: GGUFFile, config: ModelConfig,
                 progress: Callable[[int, int], None] | None = None,
                 available_memory: int | None = None, quantized: bool | None = None,
                 kv_type: str = AUTO, dots: str = AUTO, tune_threads: bool = True) -> None:
        """`available_memory`: bytes the weights may take (None: what psutil reports available);
        a model whose weights need more is refused with `ModelLoadError`. `quantized`: keep
        quantized matrices quantized (None: when the compiled kernels run here; False: float32
        throughout, the reference arithmetic). `kv_type`: what keys and values are cached as
        (`auto`: float32); ModelLoadError for a block type the model's head sizes do not divide.
        `dots`: `int8` or `float32` activations in the kernels' products, for the whole process
        (`int8_kernels.choose`; `auto` leaves its default). `tune_threads` False: decode passes
        keep every thread, with no trials of one (`ThreadTuner`'s `trials`)."""
        self.config = config
        self.kv_type = "f32" if kv_type == AUTO else kv_type
        check_head_sizes(KV_TYPES[self.kv_type], (config.head_size(i) for i in config.attention_layers))
        self.kv_dtype_bytes = KV_TYPES[self.kv_type].bytes_per_element
        quantized = kernels_available() if quantized is None else quantized
        if quantized:  # the kernels' settings, checked before the weights load
            from lmserve.engine_cpu import amx_kernels, int8_kernels, kernels

            int8_kernels.choose(dots)
            amx_kernels.check_setting()
        self.weights = load_weights(gguf, config, progress, available_memory, quantized)
        self._activation = ops.GATED_ACTIVATIONS[config.activation]
        self._layout = Layout.of(config, self.kv_type)
        self.weight_bytes = self.weights.nbytes
        self._threads: ThreadTuner | None = None
        self._halves = [decode_layer.NONE] * len(self.weights.layers)  # the layers' compiled decode halves
        self._scratch = ops.Scratch()  # the passes' attention scores, one pass after another
        kind, tiled = "float32", []
        if quantized:
            kind = f"kernels on the file's quants, {'int8' if int8_kernels.ENABLED else 'float32'} activations"
            forms = kept_forms(self.weights)
            if int8_kernels.ENABLED and amx_kernels.enabled() and any(amx_kernels.recipe_for(*form) is not None
                                                                      for form in forms):
                tiled.append("prompt chunks of K-quants")
            self.prepared = kernels.prepare(forms, stacked_forms(self.weights))
            blas, most = blas_threads(), kernels.most_threads()

            def apply(count: int, wide: bool) -> None:
                # BLAS keeps one count per shape whatever the load: a pass's results must not
                # depend on it, and BLAS's long products (attention's mix past a few hundred
                # positions) give other bits on other thread counts; the kernels' do not.
                kernels.set_threads(count)
                blas(most if wide else 1)

            self._threads = ThreadTuner(most, apply, KERNEL_ROWS, TUNED_ROWS, trials=tune_threads)
            self._halves = [decode_layer.compiled_halves(layer, config) for layer in self.weights.layers]
            decode_layer.prepare(self._halves, self.kv_type)
        ops.prepare(self.kv_type, any(layer.experts is not None for layer in self.weights.layers))
        if ops.prompt_attention_on_tiles(config.head_size(i) for i in config.attention_layers):
            tiled.append("prompt attention")
        if tiled:
            kind += f" ({' and '.join(tiled)} on AMX tiles)"
        self.device = f"numpy, {kind} ({len(os.sched_getaffinity(0))} cpus)"

    # -- caches ------------------------------------------------------------------------------

    def new_cache(self, capacity: int) -> CPUCache:
        return CPUCache(self._layout, capacity, self.checkpoints_per_cache)

    def resume_point(self, cache: CPUCache, n: int) -> int:
        return _own(cache).resume_point(n)

    def checkpoint(self, cache: CPUCache) -> None:
        _own(cache).checkpoint()

    def truncate(self, cache: CPUCache, n: int) -> None:
        c = _own(cache)
        self._feed(c, c.truncate(n))

    def copy_prefix(self, src: CPUCache, dst: CPUCache, n: int) -> None:
        d = _own(dst)
        self._feed(d, _own(src).copy_prefix_to(d, n))

    def save_cache(self, cache: CPUCache, path: Path) -> None:
        _own(cache).save(path)

    def load_cache(self, path: Path, capacity: int) -> CPUCache:
        return CPUCache.load(self._layout, path, capacity, self.checkpoints_per_cache)

    def _feed(self, cache: CPUCache, ids: np.ndarray) -> None:
        """Feed the token ids a cut-back hybrid cache recomputes (no logits; room is there)."""
        collections.deque(self._passes(cache, ids), maxlen=0)

    # -- inference ---------------------------------------------------------------------------

    def prefill(self, cache: CPUCache, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        chunks = self._chunks(_own(cache), token_ids, "prefill")
        if all_logits:
            return np.concatenate([self._logits(h) for h in chunks])
        (h,) = collections.deque(chunks, maxlen=1)  # every chunk runs; the last one's last row gives the logits
        return self._logits(h[-1:])[0]

    def prefill_together(self, caches: Sequence[CPUCache], token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """One pass for every prompt where they fit one (`_most_rows`, padding included) and no
        recurrent state would see the padding: each matrix is read once for all, and no decode
        step runs between them (figures: docs/PERFORMANCE.md, "Served decode: prompts that arrive
        together")."""
        own = [_own(c) for c in caches]
        lengths, ids = verify_rows(own, token_ids, self.config.vocab_size, "prefill_together")
        width = ids.shape[1]
        if self.config.is_hybrid or ids.size > self._most_rows():
            return super().prefill_together(caches, token_ids)
        for c in own:
            c.reserve(c.length + width)
        h = self._forward(ids.reshape(-1), own, lengths)
        return self._logits(h[np.arange(len(own)) * width + np.array(lengths) - 1])

    def embed(self, token_ids: Sequence[int]) -> np.ndarray:
        """The prompt's pass on a cache of exactly its length, made here and dropped after: the
        output norm's result of every chunk, no head."""
        chunks = self._chunks(self.new_cache(len(token_ids)), token_ids, "embed")
        return np.concatenate([self._norm(h) for h in chunks])

    def _chunks(self, cache: CPUCache, token_ids: Sequence[int], what: str) -> Iterator[np.ndarray]:
        """Append `token_ids` to the cache a chunk at a time (checked and room reserved before the
        first), yielding each chunk's last hidden states `[chunk, hidden]`."""
        ids = check_token_ids(token_ids, self.config.vocab_size)
        if len(ids) == 0:
            raise ValueError(f"{what} needs at least one token")
        cache.reserve(cache.length + len(ids))
        return self._passes(cache, ids)

    def _passes(self, cache: CPUCache, ids: np.ndarray) -> Iterator[np.ndarray]:
        """Forward passes over `ids`, appended to the cache, yielding each pass's last hidden states."""
        start = 0
        while start < len(ids):
            rows = self._pass_rows(cache.length, len(ids) - start)
            yield self._forward(ids[start:start + rows], [cache])
            start += rows

    def _pass_rows(self, position: int, left: int) -> int:
        """The rows of the next pass from `position`, `left` rows to go: the fewest passes of at
        most `_most_rows`, evened out (`even_chunk`). Each pass unpacks a MoE's experts and runs a
        layer's Python once, so fewer, larger passes ran prompts 1.04-1.22x faster than 512-row ones
        (docs/PERFORMANCE.md). Halved while the pass's attention scores (every query head's row
        over every position seen, where BLAS takes them) would pass SCORES_BUDGET, down to
        LONG_PASS_ROWS: a long prompt's."""
        most = self._most_rows()
        while True:
            rows = even_chunk(left, most)
            if most <= LONG_PASS_ROWS or self.config.n_heads * rows * (position + rows) * 4 <= SCORES_BUDGET:
                return rows
            most = max(LONG_PASS_ROWS, rows // 2)

    def _most_rows(self) -> int:
        """FORWARD_CHUNK, or fewer where a pass's widest activations would pass ACTIVATION_BUDGET."""
        c = self.config
        widest = max(2 * c.ffn_size, 2 * c.n_experts_used * c.expert_ffn_size,
                     (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.hidden_size)
        return min(FORWARD_CHUNK, max(LONG_PASS_ROWS, ACTIVATION_BUDGET // (4 * widest)))

    def decode(self, caches: Sequence[CPUCache], token_ids: Sequence[int]) -> np.ndarray:
        own = [_own(c) for c in caches]
        ids = check_token_ids(token_ids, self.config.vocab_size)
        if len(own) != len(ids):
            raise ValueError(f"{len(own)} caches but {len(ids)} tokens")
        if len({id(c) for c in own}) != len(own):
            raise ValueError("a cache appears twice in one decode step")
        for c in own:
            c.reserve(c.length + 1)
        return self._logits(self._forward(ids, own))

    def decode_argmax(self, caches: Sequence[CPUCache], token_ids: Sequence[int]) -> np.ndarray:
        return self.decode(caches, token_ids).argmax(-1).astype(np.int64)

    def verify(self, caches: Sequence[CPUCache], token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One pass over the weights for all lists: each is padded to the longest with its own
        last token (causal attention keeps the real rows blind to it, and no recurrent state
        sees it), and each cache advances by its own list only. A hybrid cache keeps its state
        from before the pass, so cutting back into it recomputes only the tokens kept."""
        own = [_own(c) for c in caches]
        lengths, ids = verify_rows(own, token_ids, self.config.vocab_size)
        width = ids.shape[1]
        for c in own:
            c.reserve(c.length + width)
            c.keep()
        h = self._forward(ids.reshape(-1), own, lengths)
        real = np.concatenate([np.arange(i * width, i * width + n) for i, n in enumerate(lengths)])
        return np.split(self._logits(h[real]), np.cumsum(lengths)[:-1])

    def _forward(self, ids: np.ndarray, caches: list[CPUCache], real: list[int] | None = None) -> np.ndarray:
        """Run rows `ids` through every layer and return the last hidden states `[n, hidden]`.
        One cache extends by all rows (prefill), or each of several by as many (decode, verify:
        `real` of them kept per cache); room is already reserved."""
        try:
            if self._threads is None:
                return self._layers(ids, caches, real)
            threads = self._threads.choose(len(ids))
            started = time.perf_counter()
            h = self._layers(ids, caches, real)
            self._threads.record(len(ids), threads, time.perf_counter() - started)
            return h
        finally:
            self._scratch.release_past(KEPT_SCRATCH)

    def _layers(self, ids: np.ndarray, caches: list[CPUCache], real: list[int] | None) -> np.ndarray:
        cfg, w = self.config, self.weights
        batch = Batch(caches, len(ids) // len(caches), real, self._scratch)
        tables = ops.rope_tables(batch.positions, w.rope.inv_freq, w.rope.scale)
        local = tables if w.rope_local is None else ops.rope_tables(batch.positions, w.rope_local.inv_freq,
                                                                   w.rope_local.scale)
        h = w.embed[ids]
        if cfg.embed_scale != 1.0:
            h = h * np.float32(cfg.embed_scale)  # rounded to float32 first, as Gemma does
        for li, (layer, halves) in enumerate(zip(w.layers, self._halves, strict=True)):
            # h is this pass's own array (the embedding rows were copied out): the halves add to it.
            mixer = layer.mixer
            rope = local if getattr(mixer, "local_rope", False) else tables
            if not decode_layer.attention_half(h, halves, batch, li, rope, cfg.attention_scale, cfg.rms_eps):
                x = ops.rms_norm(h, layer.attn_norm, cfg.rms_eps)
                if isinstance(mixer, DeltaNetWeights):
                    out = delta_net.mix(x, mixer, batch, li, cfg.linear_attention, cfg.rms_eps)
                else:
                    out = attend(x, mixer, batch, li, rope, cfg.attention_scale, cfg.rms_eps)
                if layer.post_attn_norm is not None:
                    out = ops.rms_norm(out, layer.post_attn_norm, cfg.rms_eps)
                h += out
            if not decode_layer.ffn_half(h, halves, cfg.rms_eps):
                h += feed_forward(h, layer, cfg, self._activation)
            if layer.out_scale is not None:
                h *= layer.out_scale
        batch.finish(ids)
        return h

    def _norm(self, h: np.ndarray) -> np.ndarray:
        """The output norm: the last hidden states `[n, hidden]` as the head (or a pooling) reads them."""
        return ops.rms_norm(h, self.weights.output_norm, self.config.rms_eps)

    def _logits(self, h: np.ndarray) -> np.ndarray:
        """Final norm and output head: `[n, hidden]` -> `[n, vocab]`; softcapped where the model
        caps its logits (Gemma 4: cap * tanh(logits / cap))."""
        logits = ops.linear(self._norm(h), self.weights.output)
        cap = self.config.final_softcap
        if cap:
            logits /= np.float32(cap)
            np.tanh(logits, out=logits)
            logits *= np.float32(cap)
        return logits


def kernels_available() -> bool:
    """Whether the quantized-matrix kernels run here (numba is not installed on macOS)."""
    try:
        from lmserve.engine_cpu import kernels
    except ImportError:
        return False
    return kernels.available()


def _own(cache: object) -> CPUCache:
    """The cache itself, checked: the scheduler holds caches only as the protocol's `KVCache`."""
    if not isinstance(cache, CPUCache):
        raise TypeError(f"the CPU engine cannot use a {type(cache).__name__}")
    return cache
