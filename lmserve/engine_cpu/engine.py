"""The NumPy engine: the Engine protocol on any CPU, activations in float32.

Weight matrices stay in the file's quants where compiled kernels can read them (`qmatrix`), and
are dequantized to float32 otherwise.

A step stacks the hidden states of every row it advances (all prompt tokens in prefill, one token
per sequence in batched decode), so each weight matrix is read once per step; only attention runs
per sequence, over that sequence's own cache. A mixture-of-experts FFN groups the rows by the
experts they are routed to, so each selected expert's matrices are read once per step and the
others not at all.

Sliding-window layers keep every position in the cache like the others (so truncating, copying
and saving a cache stay one slice), and attend to the window's positions only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from lmserve.engine.protocol import Engine, check_token_ids, verify_rows
from lmserve.engine_cpu import ops
from lmserve.engine_cpu.cache import CPUCache
from lmserve.engine_cpu.weights import ExpertWeights, load_weights
from lmserve.model.config import ModelConfig
from lmserve.model.families import ROUTE_TOPK_SOFTMAX
from lmserve.model.gguf_file import GGUFFile

PREFILL_CHUNK = 256  # prompt tokens per forward pass: bounds the attention scores' memory


class CPUEngine(Engine[CPUCache]):
    """Every family of `model/families.py` (Llama, Mistral, Qwen2, Qwen3, Qwen3 MoE, Gemma 3,
    Phi-3, gpt-oss) on NumPy float32 and quantized-matrix kernels."""

    name = "cpu"
    kv_dtype_bytes = 4  # keys and values are cached as float32
    quant_summary = ""  # the file's own values are kept (quantized or float32): nothing converted to report
    device_argmax = False  # the logits are on the host already: an argmax here saves nothing

    def __init__(self, gguf: GGUFFile, config: ModelConfig,
                 progress: Callable[[int, int], None] | None = None,
                 available_memory: int | None = None, quantized: bool | None = None) -> None:
        """`available_memory`: bytes the weights may take (None: what psutil reports available);
        a model whose weights need more is refused with `ModelLoadError`. `quantized`: keep
        quantized matrices quantized (None: when the compiled kernels run here; False: float32
        throughout, the reference arithmetic)."""
        self.config = config
        quantized = kernels_available() if quantized is None else quantized
        self.weights = load_weights(gguf, config, progress, available_memory, quantized)
        self._activation = ops.GATED_ACTIVATIONS[config.activation]
        self.weight_bytes = self.weights.nbytes
        kind = "int8-block kernels" if quantized else "float32"
        self.device = f"numpy, {kind} ({len(os.sched_getaffinity(0))} cpus)"

    # -- caches ------------------------------------------------------------------------------

    def new_cache(self, max_tokens: int) -> CPUCache:
        return CPUCache(self.config, max_tokens)

    def truncate(self, cache: CPUCache, n: int) -> None:
        _own(cache).truncate(n)

    def copy_prefix(self, src: CPUCache, dst: CPUCache, n: int) -> None:
        _own(src).copy_prefix_to(_own(dst), n)

    def save_cache(self, cache: CPUCache, path: Path) -> None:
        _own(cache).save(path)

    def load_cache(self, path: Path, max_tokens: int) -> CPUCache:
        return CPUCache.load(self.config, path, max_tokens)

    # -- inference ---------------------------------------------------------------------------

    def prefill(self, cache: CPUCache, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        c = _own(cache)
        ids = check_token_ids(token_ids, self.config.vocab_size)
        if len(ids) == 0:
            raise ValueError("prefill needs at least one token")
        c.reserve(c.length + len(ids))
        logits = []
        for start in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[start:start + PREFILL_CHUNK]
            h = self._forward(chunk, [c])
            if all_logits:
                logits.append(self._logits(h))
        return np.concatenate(logits) if all_logits else self._logits(h[-1:])[0]

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
        last token (causal attention keeps the real rows blind to it), and the padding is
        truncated away again."""
        own = [_own(c) for c in caches]
        lengths, ids = verify_rows(own, token_ids, self.config.vocab_size)
        width = ids.shape[1]
        for c in own:
            c.reserve(c.length + width)
        h = self._forward(ids.reshape(-1), own)
        for c, n in zip(own, lengths, strict=True):
            c.truncate(c.length - (width - n))
        real = np.concatenate([np.arange(i * width, i * width + n) for i, n in enumerate(lengths)])
        return np.split(self._logits(h[real]), np.cumsum(lengths)[:-1])

    def _forward(self, ids: np.ndarray, caches: list[CPUCache]) -> np.ndarray:
        """Run rows `ids` through every layer and return the last hidden states `[n, hidden]`.
        One cache extends by all rows (prefill), or each of several by one row (decode);
        room is already reserved."""
        cfg, w = self.config, self.weights
        nq, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        per_cache = len(ids) // len(caches)
        spans = [(c, c.length, i * per_cache, (i + 1) * per_cache) for i, c in enumerate(caches)]
        positions = np.concatenate([np.arange(s, s + per_cache) for _, s, _, _ in spans])
        tables = ops.rope_tables(positions, w.rope.inv_freq, w.rope.scale)
        local = tables if w.rope_local is None else ops.rope_tables(positions, w.rope_local.inv_freq,
                                                                   w.rope_local.scale)
        h = w.embed[ids]
        if cfg.embed_scale != 1.0:
            h = h * np.float32(cfg.embed_scale)  # rounded to float32 first, as Gemma does
        for li, layer in enumerate(w.layers):
            x = ops.rms_norm(h, layer.attn_norm, cfg.rms_eps)
            qkv = ops.linear(x, layer.qkv)
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            qkv = qkv.reshape(len(ids), nq + 2 * nkv, hd)
            if layer.q_norm is not None and layer.k_norm is not None:
                qkv[:, :nq] = ops.rms_norm(qkv[:, :nq], layer.q_norm, cfg.rms_eps)
                qkv[:, nq:nq + nkv] = ops.rms_norm(qkv[:, nq:nq + nkv], layer.k_norm, cfg.rms_eps)
            qk = ops.rope(qkv[:, :nq + nkv], *(local if layer.local_rope else tables))  # Q and K in one pass
            q, k, v = qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv:]
            attn = np.empty((len(ids), nq * hd), dtype=np.float32)
            for c, s, lo, hi in spans:
                end = s + per_cache
                c.k[li, :, s:end] = k[lo:hi].transpose(1, 0, 2)
                c.v[li, :, s:end] = v[lo:hi].transpose(1, 0, 2)
                attn[lo:hi] = ops.attention(q[lo:hi], c.k[li, :, :end], c.v[li, :, :end], s,
                                            cfg.attention_scale, layer.window, layer.sinks)
            out = ops.linear(attn, layer.o)
            if layer.o_bias is not None:
                out += layer.o_bias
            if layer.post_attn_norm is not None:
                out = ops.rms_norm(out, layer.post_attn_norm, cfg.rms_eps)
            h += out  # h is this pass's own array (the embedding rows were copied out)
            x = ops.rms_norm(h, layer.ffn_norm, cfg.rms_eps)
            if layer.experts is not None:
                out = self._moe(x, layer.experts)
            else:
                out = ops.linear(self._activation(ops.linear(x, layer.gate_up)), layer.down)
            if layer.post_ffn_norm is not None:
                out = ops.rms_norm(out, layer.post_ffn_norm, cfg.rms_eps)
            h += out
        for c in caches:
            c.length += per_cache
        return h

    def _moe(self, x: np.ndarray, m: ExpertWeights) -> np.ndarray:
        """Route each row to its top-k experts and sum their outputs, weighted. Rows are grouped
        by expert: each selected expert runs once, on the rows routed to it."""
        cfg = self.config
        k = cfg.n_experts_used
        logits = ops.linear(x, m.router)
        if m.router_bias is not None:
            logits += m.router_bias
        chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :k]  # [n, k]
        if cfg.router == ROUTE_TOPK_SOFTMAX:  # gpt-oss: softmax over the k chosen logits
            weights = ops.softmax(np.take_along_axis(logits, chosen, axis=-1))
        else:  # softmax over every expert, keep the chosen, renormalize (Qwen3 MoE)
            weights = np.take_along_axis(ops.softmax(logits), chosen, axis=-1)
            weights /= weights.sum(axis=-1, keepdims=True)
        flat, flat_weights = chosen.ravel(), weights.ravel()
        order = np.argsort(flat, kind="stable")  # (row, slot) pairs grouped by expert
        counts = np.bincount(flat, minlength=cfg.n_experts)
        out = np.zeros_like(x)
        stop = 0
        for expert, count in enumerate(counts.tolist()):
            if not count:
                continue
            pairs = order[stop:stop + count]
            stop += count
            rows = pairs // k  # distinct: a row picks an expert at most once
            gate_up = ops.linear(x[rows], m.gate_up[expert])
            if m.gate_up_bias is not None:
                gate_up += m.gate_up_bias[expert]
            y = ops.linear(self._activation(gate_up), m.down[expert])
            if m.down_bias is not None:
                y += m.down_bias[expert]
            out[rows] += y * flat_weights[pairs, None]
        return out

    def _logits(self, h: np.ndarray) -> np.ndarray:
        """Final norm and output head: `[n, hidden]` -> `[n, vocab]`."""
        return ops.linear(ops.rms_norm(h, self.weights.output_norm, self.config.rms_eps), self.weights.output)


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
