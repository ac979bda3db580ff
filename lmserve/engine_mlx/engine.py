"""The MLX engine: the engine protocol over an mlx-lm network and MLX KV caches.

Everything runs on one thread-local stream (as mlx-lm's generation does), so the engine may be
built on one thread and driven from the scheduler's worker thread. Only the logits of the
positions asked for are computed and copied to the host; `decode_argmax` keeps even those on
the device and returns one id per sequence. `verify` runs several positions per sequence at once
(a speculative draft), batched like a decode step. Saved caches are mlx-lm prompt-cache files
(`save_prompt_cache`), tagged with this model's KV geometry.

Sliding-window layers (Gemma 3 and 4, gpt-oss) keep every position like the others, and attend
only their window (`kv.WindowKVCache`), so a cache can still be truncated or copied to any prefix.

A hybrid model's cache (Qwen3.5: Gated DeltaNet layers beside attention) goes back to a position
its recurrent layers have left by restoring a kept state and recomputing from there (hybrid.py):
`checkpoint` keeps one, `verify` keeps the state from before its pass (rows shorter than the pass
are masked out of the recurrent layers past their end, so their padding costs nothing), and the
greedy step `decode_argmax` queues ahead is undone by putting the state from before it back.
"""

from __future__ import annotations

import operator
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGMLQuantizationType
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, load_prompt_cache, save_prompt_cache

from lmserve.engine.kv_types import AUTO, KV_TYPES, check_head_sizes
from lmserve.engine.protocol import Engine, check_token_ids, verify_rows
from lmserve.engine_mlx import disk_cache
from lmserve.engine_mlx.hybrid import State, flatten, recurrent, restore, snapshot, unflatten
from lmserve.engine_mlx.kv import Batch, Layer, MergedLayer, MLXKVCache, layer_arrays
from lmserve.engine_mlx.kv_quant import Packing, store
from lmserve.engine_mlx.layout import undo_gguf_layout
from lmserve.engine_mlx.model import LAYER_PARAM, build_model, gguf_names, output_head
from lmserve.engine_mlx.weights import Choice, convert, reads_natively, summarize
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile, ModelLoadError, TensorInfo

FORWARD_CHUNK = 2048  # positions per forward pass during prefill (mlx-lm's default step)
KV_FORMAT = "lmserve-mlx-kv-3"  # an mlx-lm prompt-cache file with our metadata

Progress = Callable[[int, int], None]


def describe_device() -> str:
    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu (MLX CPU backend)"
    return "gpu (Metal)" if mx.metal.is_available() else "gpu (CUDA)"


_DTYPE_NAMES = {mx.float32: "f32", mx.float16: "f16"}  # --kv-type's names (bfloat16 has none there)
QUANTIZED = ("q8_0", "q4_0")


def compute_dtype(gguf: GGUFFile) -> mx.Dtype:
    """Activation, scale and KV dtype. MLX's CPU kernels run float16 quantized matmuls many times
    slower than float32 (figures: docs/PERFORMANCE.md, measurements behind code choices), so the
    CPU backend computes in float32; a GPU computes in the precision of the file's float matrices
    (float16 for quantized files)."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return mx.float32
    types = {t.qtype for t in gguf.tensors.values() if len(t.shape) == 2}
    if GGMLQuantizationType.F32 in types:
        return mx.float32
    return mx.bfloat16 if GGMLQuantizationType.BF16 in types else mx.float16


@dataclass
class _QueuedGreedyStep:
    """A greedy step queued on the device for `caches` (whose per-layer caches are `layers`), fed
    with the ids the last one returned; `before` is its recurrent layers' state before it."""

    caches: list[MLXKVCache]
    layers: list[Layer] | list[MergedLayer]
    before: State
    ids: mx.array
    inputs: list[int] | None = None

    def continues(self, caches: Sequence[MLXKVCache], token_ids: Sequence[int]) -> bool:
        return (self.inputs is not None and len(caches) == len(self.caches)
                and all(map(operator.is_, caches, self.caches)) and self.inputs == list(token_ids))


class MLXEngine(Engine[MLXKVCache]):
    """A GGUF model on MLX's default device (Metal on a Mac, CUDA or the CPU backend elsewhere)."""

    name = "mlx"
    device_argmax = True  # decode_argmax copies one id per row instead of the logits
    # decode_argmax queues the next greedy step before returning; a distributed engine turns it
    # off so that no collective is left in flight between two calls (distributed.py).
    queue_next_step = True

    def __init__(self, gguf: GGUFFile, config: ModelConfig, progress: Progress | None = None,
                 cache_dir: Path | None = None, kv_type: str = AUTO) -> None:
        """`kv_type`: `auto` caches keys and values in the compute dtype; q8_0 / q4_0 pack them
        quantized (kv_quant.py); f32 / f16 are refused unless the compute dtype is that one."""
        self.config = config
        self.device = describe_device()
        self.dtype = compute_dtype(gguf)
        # On MLX's CPU backend a verify pass costs nearly a decode step a row (figures: docs/PERFORMANCE.md)
        self.cheap_verify = mx.default_device().type != mx.DeviceType.cpu
        self.kv_type = _DTYPE_NAMES.get(self.dtype, "bf16") if kv_type == AUTO else kv_type
        self._packing = Packing(KV_TYPES[kv_type].bits, self.dtype) if kv_type in QUANTIZED else None
        if self._packing is None and self.kv_type != _DTYPE_NAMES.get(self.dtype, "bf16"):
            raise ModelLoadError(f"--kv-type {kv_type}: the MLX engine caches unquantized keys and values in its "
                                 f"compute dtype ({self.dtype}); choose auto, q8_0 or q4_0")
        if self._packing is not None:
            check_head_sizes(KV_TYPES[kv_type], (config.head_size(i) for i in config.attention_layers))
        self.state_dtype_bytes = self.dtype.size  # recurrent states: the compute dtype
        self.kv_dtype_bytes = self._packing.bytes_per_element if self._packing else self.dtype.size
        self.stream = mx.new_thread_local_stream(mx.default_device())  # all of this engine's work
        with mx.stream(self.stream):
            self.model = self._build_model(config, gguf)
            choices, self.weights_from = self._load(gguf, progress, cache_dir)
            self._loaded()
            mx.eval(self.model.parameters(), _module_constants(self.model))
        self.quant_summary = summarize(choices)
        self.weight_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        self._queued: _QueuedGreedyStep | None = None
        self._head = output_head(self.model, config)
        self._geometry = f"{_geometry(config, self.dtype)};kv={self.kv_type}"  # a file of another type is refused

    def _build_model(self, config: ModelConfig, gguf: GGUFFile) -> nn.Module:
        """The network, before its weights load (a pipeline rank drops the others' layers)."""
        return build_model(config, gguf)

    def _tensors(self, gguf: GGUFFile) -> dict[str, TensorInfo]:
        """The file's tensors this engine loads (a pipeline rank: only its layers')."""
        return gguf.tensors

    def _layer_loaded(self, layer: int) -> None:
        """Called once a layer's weights are in, before the next part loads: a tensor-parallel
        rank keeps its share of it here, so that it never holds more than its share and one
        layer of the file (distributed.py); one device keeps them all."""

    def _loaded(self) -> None:
        """Called once every weight is in, before they are evaluated (a pipeline rank connects
        its layers to the other ranks' here)."""

    def _load(self, gguf: GGUFFile, progress: Progress | None, cache_dir: Path | None) -> tuple[dict[str, Choice], str]:
        """The weights, a part at a time (what is outside the layers, then each layer): native
        files straight from the GGUF, tensor by tensor; others from the disk cache, else
        converted (and cached). Returns every tensor's choice, and where the weights came from."""
        names = gguf_names(self.model, self.config, self._tensors(gguf))
        entry = None
        if not reads_natively(gguf, list(names.values())):
            entry = disk_cache.Entry(gguf, self.dtype, Path(cache_dir or disk_cache.default_cache_dir()))
        choices: dict[str, Choice] = {}
        loaded: set[str] = set()
        converted = False
        for layer, part in _parts(names).items():
            done = len(choices)
            arrays_choices = entry.load(layer) if entry is not None else None
            if arrays_choices is None:
                converted = True
                arrays_choices = convert(gguf, part, self.dtype, progress and (
                    lambda n, _, done=done: progress(done + n, len(names))))
                if entry is not None:
                    entry.save(layer, *arrays_choices)
            elif progress is not None:
                progress(done + len(part), len(names))
            arrays, part_choices = arrays_choices
            loaded |= self._install(arrays, part_choices)
            choices |= part_choices
            del arrays, arrays_choices
            if layer is not None:
                self._layer_loaded(layer)
        missing = sorted({name for name, _ in tree_flatten(self.model.parameters())} - loaded)
        if missing:
            raise ModelLoadError(f"no weights loaded for {', '.join(missing[:4])}")
        if entry is None:
            return choices, f"{gguf.path.name} (native)"
        return choices, f"{gguf.path.name} (converted, cached in {entry.path})" if converted else f"cache {entry.path}"

    def _install(self, arrays: dict[str, mx.array], choices: dict[str, Choice]) -> set[str]:
        """One part's arrays into the network, GGUF layouts undone (layout.py): its quantized
        layers made so, shapes checked. Returns the parameters it set."""
        arrays, choices = undo_gguf_layout(self.config, arrays, choices)
        quant = {name.rsplit(".", 1)[0]: {"group_size": c.group_size, "bits": c.bits, "mode": c.mode}
                 for name, c in choices.items() if c.bits is not None}
        if quant:
            nn.quantize(self.model, class_predicate=lambda path, _: quant.get(path, False))
        params = dict(tree_flatten(self.model.parameters()))
        wrong = [name for name, array in arrays.items() if name not in params or params[name].shape != array.shape]
        if wrong:
            raise ModelLoadError(f"the converted weights do not fit the network: {', '.join(sorted(wrong)[:4])}")
        self.model.load_weights(list(arrays.items()), strict=False)
        return set(arrays)

    # -- forward passes ----------------------------------------------------------------------

    def _check_ids(self, token_ids: Sequence[int]) -> np.ndarray:
        return check_token_ids(token_ids, self.config.vocab_size).astype(np.uint32)

    @staticmethod
    def _layers(caches: Sequence[MLXKVCache]) -> list[Layer] | list[MergedLayer]:
        """The per-layer caches a pass over `caches` runs on: one's own, or their batch's."""
        return caches[0].own() if len(caches) == 1 else Batch.of(caches).layers

    def _step(self, caches: Sequence[MLXKVCache], tokens: mx.array) -> mx.array:
        """Lazy logits `[batch, vocab]` of one decode step, whose K/V the caches' layers take
        (`n`, the committed length, is the caller's to advance)."""
        return self._head(self.model.model(tokens[:, None], cache=self._layers(caches))[:, -1, :])

    def _start(self, caches: Sequence[MLXKVCache], token_ids: Sequence[int]) -> mx.array:
        """Checks, then any queued speculation is dropped and the step's token ids go up."""
        if not caches or len(caches) != len(token_ids):
            raise ValueError("decode needs one token id per cache")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a cache appears twice in one decode step")
        for cache in caches:
            cache.reserve(1)
        tokens = mx.array(self._check_ids(token_ids))
        self._settle()
        return tokens

    def _settle(self) -> None:
        """Undo a speculative step nobody took: attention layers drop the position it appended,
        recurrent layers get their state from before it back."""
        queued, self._queued = self._queued, None
        if queued is not None:
            for layer in queued.layers:
                if not isinstance(layer, ArraysCache):
                    layer.trim(1)
            if queued.before:
                restore(queued.layers, queued.before)

    def _feed(self, cache: MLXKVCache, ids: np.ndarray, last: bool) -> np.ndarray | None:
        """Run `ids` into the cache's own layers in chunks (counting the positions, not their
        ids). `last`: return the last position's logits; it runs alone through the last layer's
        attention and FFN, the others only for what they leave in the caches (as in mlx-lm's
        generate_step)."""
        layers = cache.own()
        body = ids[:-1] if last else ids
        for start in range(0, len(body), FORWARD_CHUNK):
            chunk = body[start:start + FORWARD_CHUNK]
            self.model.model(mx.array(chunk)[None], cache=layers)
            cache.n += len(chunk)
            mx.eval(layer_arrays(layers))
        if not last:
            return None
        h = self.model.model(mx.array(ids[-1:])[None], cache=layers)
        cache.n += 1
        return np.array(self._head(h[0, -1]).astype(mx.float32))

    def _hidden(self, cache: MLXKVCache, ids: np.ndarray) -> Iterator[mx.array]:
        """Run `ids` into the cache's own layers in chunks, yielding each chunk's final hidden
        states `[chunk, hidden]` (after the output norm: mlx-lm's inner model applies it), lazy;
        each is in the graph of the cache's new positions, so evaluating it fills them."""
        layers = cache.own()
        for start in range(0, len(ids), FORWARD_CHUNK):
            chunk = ids[start:start + FORWARD_CHUNK]
            yield self.model.model(mx.array(chunk)[None], cache=layers)[0]
            cache.n += len(chunk)

    # -- the engine protocol -----------------------------------------------------------------

    def new_cache(self, capacity: int) -> MLXKVCache:
        windows = [self.config.sliding_window if sliding else 0 for sliding in self.config.sliding_layers]
        return MLXKVCache(self.config.n_layers, capacity, windows, self.config.recurrent_layers,
                          self.checkpoints_per_cache, self._packing)

    def prefill(self, cache: MLXKVCache, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        ids = self._check_ids(token_ids)
        if not len(ids):
            raise ValueError("prefill needs at least one token")
        cache.reserve(len(ids))
        with mx.stream(self.stream):
            self._settle()
            if all_logits:
                logits = np.concatenate([np.array(self._head(h).astype(mx.float32)) for h in self._hidden(cache, ids)])
            else:
                logits = self._feed(cache, ids, last=True)
            if cache.hybrid is not None:
                cache.hybrid.tokens.extend(ids.tolist())
        return logits

    def embed(self, token_ids: Sequence[int]) -> np.ndarray:
        """A prefill on a cache of exactly the input's length, made here and dropped after, keeping
        every position's hidden state instead of running the head. A greedy step `decode_argmax`
        queued for other caches stays queued: nothing here touches them."""
        ids = self._check_ids(token_ids)
        if not len(ids):
            raise ValueError("embed needs at least one token")
        cache = self.new_cache(len(ids))
        cache.reserve(len(ids))
        with mx.stream(self.stream):
            return np.concatenate([np.array(h.astype(mx.float32)) for h in self._hidden(cache, ids)])

    def decode(self, caches: Sequence[MLXKVCache], token_ids: Sequence[int]) -> np.ndarray:
        with mx.stream(self.stream):
            logits = self._step(caches, self._start(caches, token_ids)).astype(mx.float32)
            for cache, token in zip(caches, token_ids, strict=True):
                cache.appended([token])
            return np.array(logits)

    def decode_argmax(self, caches: Sequence[MLXKVCache], token_ids: Sequence[int]) -> np.ndarray:
        """Greedy step on the device: the ids `decode`'s logits would argmax to, without copying
        them. Like mlx-lm's generation loop, it queues the next step on the returned ids before
        waiting for them, so the device never idles while Python builds a step; that step is
        used when the next call continues those sequences with those ids, else undone."""
        with mx.stream(self.stream):
            queued = self._queued
            if queued is not None and queued.continues(caches, token_ids):
                self._queued, ids = None, queued.ids
            else:
                ids = self._greedy(caches, self._start(caches, token_ids))
            for cache, token in zip(caches, token_ids, strict=True):
                cache.appended([token])
            if self.queue_next_step and all(c.n < c.capacity for c in caches):
                layers = caches[0].layers if len(caches) == 1 else caches[0].batch.layers  # the step's
                before = snapshot(layers) if caches[0].hybrid is not None else ()
                self._queued = _QueuedGreedyStep(list(caches), layers, before, self._greedy(caches, ids))
                mx.async_eval(self._queued.ids)
            out = np.array(ids, dtype=np.int64)
            if self._queued is not None:
                self._queued.inputs = out.tolist()
            return out

    def verify(self, caches: Sequence[MLXKVCache], token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """All lists in one pass: shorter ones are padded with their own last token (causal
        attention keeps the real positions blind to it, and recurrent layers are masked from
        it) and the padding is cut away. A hybrid cache keeps its state from before the pass."""
        lengths, ids = verify_rows(caches, token_ids, self.config.vocab_size)
        width = ids.shape[1]
        for cache in caches:
            cache.reserve(width)
        with mx.stream(self.stream):
            self._settle()
            layers = self._layers(caches)
            for row, cache in enumerate(caches):
                if cache.hybrid is not None:
                    cache.hybrid.kept = (cache.n, snapshot(layers, row if len(caches) > 1 else None))
            padded = min(lengths) < width
            for layer in recurrent(layers) if padded else ():
                layer.prepare(lengths=lengths)  # each row's state stops at its own end
            h = self.model.model(mx.array(ids.astype(np.uint32)), cache=layers)
            for layer in recurrent(layers) if padded else ():
                layer.finalize()
            logits = np.array(self._head(h).astype(mx.float32))
            for cache, row_ids, n in zip(caches, ids, lengths, strict=True):
                cache.appended(row_ids[:n].tolist())
                if n < width:
                    self._drop_padding(cache, width - n)
        return [logits[i, :n] for i, n in enumerate(lengths)]

    @staticmethod
    def _drop_padding(cache: MLXKVCache, k: int) -> None:
        """Cut the `k` positions past the cache's length off its attention layers (positions
        its recurrent layers never took)."""
        if cache.batch is not None:  # the row stays merged
            cache.batch.drop(cache, k)
        else:
            for layer in cache.layers:
                if not isinstance(layer, ArraysCache):
                    layer.trim(k)

    def _greedy(self, caches: Sequence[MLXKVCache], tokens: mx.array) -> mx.array:
        return mx.argmax(self._step(caches, tokens).astype(mx.float32), axis=-1)

    def resume_point(self, cache: MLXKVCache, n: int) -> int:
        if cache.hybrid is None or n == cache.n:
            return n
        return cache.hybrid.resume(n)[0]

    def checkpoint(self, cache: MLXKVCache) -> None:
        if cache.hybrid is not None:
            with mx.stream(self.stream):
                self._settle()
                cache.hybrid.checkpoints.add(cache.n, snapshot(cache.own()))

    def truncate(self, cache: MLXKVCache, n: int) -> None:
        if not 0 <= n <= cache.length:
            raise ValueError(f"cannot truncate a cache of {cache.length} positions to {n}")
        with mx.stream(self.stream):
            self._settle()
            if cache.hybrid is None:
                if cache.batch is not None:  # the row stays merged (a verify pass's rejected drafts)
                    cache.batch.drop(cache, cache.n - n)
                else:
                    for layer in cache.layers:
                        layer.trim(layer.offset - n)
                cache.n = n
            elif n < cache.n:
                start, state = cache.hybrid.resume(n)
                layers = cache.own()
                restore(layers, state)
                for layer in layers:
                    if not isinstance(layer, ArraysCache):
                        layer.trim(layer.offset - start)
                cache.n = start
                cache.hybrid.cut(n)
                self._feed(cache, np.array(cache.hybrid.tokens[start:n], np.uint32), last=False)

    def copy_prefix(self, src: MLXKVCache, dst: MLXKVCache, n: int) -> None:
        if not 0 <= n <= src.length or n > dst.capacity:
            raise ValueError(f"cannot copy {n} positions from a cache of {src.length} into one of {dst.capacity}")
        if src is dst:
            self.truncate(src, n)
            return
        with mx.stream(self.stream):
            self._settle()
            dst.own()
            layers = src.own()
            start, state = (n, snapshot(layers)) if src.hybrid is None or n == src.n else src.hybrid.resume(n)
            dst.layers = [self._fresh(dst.empty_layer(i), layer, start) for i, layer in enumerate(layers)]
            restore(dst.layers, state)
            dst.n = start
            if src.hybrid is not None and dst.hybrid is not None:
                dst.hybrid = src.hybrid.prefix(n, dst.hybrid.checkpoints.limit)
                self._feed(dst, np.array(dst.hybrid.tokens[start:n], np.uint32), last=False)
            mx.eval(layer_arrays(dst.layers))

    @staticmethod
    def _fresh(layer: Layer, src: Layer, n: int) -> Layer:
        """`layer`, empty, given its own preallocated storage holding the first `n` positions of
        attention layer `src` (a recurrent layer is left empty: its state is restored)."""
        if n and isinstance(layer, KVCache) and src.keys is not None:
            store(layer, src.keys[..., :n, :], src.values[..., :n, :])
        return layer

    def save_cache(self, cache: MLXKVCache, path: Path) -> None:
        """mlx-lm's prompt-cache file of the cache's layers (attention ones cut to its length);
        a hybrid cache adds an ArraysCache of its token ids, then one per checkpoint (positions
        in the metadata)."""
        n = cache.n
        with mx.stream(self.stream):
            self._settle()
            layers: list[object] = [layer if isinstance(layer, ArraysCache) else self._exact(layer, n)
                                    for layer in cache.own()]
            metadata = {"format": KV_FORMAT, "geometry": self._geometry, "length": str(n)}
            if cache.hybrid is not None:
                layers += [_arrays([mx.array(np.array(cache.hybrid.tokens, np.uint32))])]
                layers += [_arrays(flatten(state)) for _, state in cache.hybrid.checkpoints]
                metadata["checkpoints"] = ",".join(map(str, cache.hybrid.checkpoints.positions))
            with Path(path).open("wb") as f:  # a file object: mx.save_safetensors adds no suffix
                save_prompt_cache(f, layers, metadata)

    def load_cache(self, path: Path, capacity: int) -> MLXKVCache:
        refused = ValueError(f"{path} is not a KV cache of this model on this engine")
        with mx.stream(self.stream), tempfile.TemporaryDirectory() as tmp:
            # mx.load names the format by the file's extension, which the caller's path may lack.
            named = Path(tmp) / "cache.safetensors"
            os.symlink(Path(path).resolve(strict=True), named)  # a missing file: OSError
            try:  # anything but our own file fails in here one way or another
                layers, metadata = load_prompt_cache(str(named), return_metadata=True)
                ours = metadata.get("format") == KV_FORMAT and metadata.get("geometry") == self._geometry
                n = int(metadata["length"])
                positions = [int(p) for p in metadata.get("checkpoints", "").split(",") if p]
            except (OSError, RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
                raise refused from exc
            cache, count = self.new_cache(capacity), self.config.n_layers
            own, extras = layers[:count], layers[count:]
            if not ours or len(own) != count or len(extras) != (1 + len(positions) if cache.hybrid else 0) or any(
                    type(layer) is not ArraysCache if cache.recurrent[i] else
                    type(layer) is not KVCache or layer.offset != n for i, layer in enumerate(own)):
                raise refused
            if n > capacity:
                raise ValueError(f"{path} holds {n} positions, more than {capacity}")
            cache.layers = [self._fresh(cache.empty_layer(i), layer, n) for i, layer in enumerate(own)]
            restore(cache.layers, snapshot(own))
            if cache.hybrid is not None:
                tokens, *saved = extras
                cache.hybrid.tokens = tokens[0].tolist()
                if len(cache.hybrid.tokens) != n:
                    raise refused
                for position, holder in zip(positions, saved, strict=True):
                    cache.hybrid.checkpoints.add(position, unflatten(holder.cache, cache.layers))
            mx.eval(layer_arrays(cache.layers))
        cache.n = n
        return cache

    @staticmethod
    def _exact(layer: KVCache, n: int) -> KVCache:
        """A view of `layer` holding exactly its first `n` positions, so that its `state` (what
        save_prompt_cache writes) has no preallocated slack."""
        exact = KVCache()
        if n:
            exact.keys, exact.values = layer.keys[..., :n, :], layer.values[..., :n, :]
            exact.offset = n
        return exact


def _arrays(entries: list[mx.array | None]) -> ArraysCache:
    """An ArraysCache holding `entries`: how a saved cache carries arrays that are not a layer's."""
    holder = ArraysCache(len(entries))
    holder.cache = list(entries)
    return holder


def _geometry(config: ModelConfig, dtype: mx.Dtype) -> str:
    """What a saved cache must match: the layers' KV shapes, the recurrent state's, the dtype."""
    base = f"{config.n_layers}x{config.n_kv_heads}x{config.head_dim}:{dtype}"
    if not (config.is_hybrid or config.layer_head_dims or config.layer_kv_heads):
        return base
    la = config.linear_attention
    layers = ",".join("r" if config.is_recurrent(i) else f"{config.kv_heads(i)}x{config.head_size(i)}"
                      for i in range(config.n_layers))
    recurrence = f";r={la.conv_kernel}x{la.k_heads}x{la.v_heads}x{la.head_k_dim}x{la.head_v_dim}" if la else ""
    return f"{base};{layers}{recurrence}"


def _module_constants(model: nn.Module) -> list[mx.array]:
    """Arrays modules keep outside their parameters (RoPE periods, YaRN's scales): evaluated at
    load, in the loading thread, since a lazy graph built here cannot be evaluated in the worker
    thread that serves (its thread-local stream does not exist there)."""
    return [value for _, module in model.named_modules() for value in (*module.values(), *vars(module).values())
            if isinstance(value, mx.array)]


def _parts(names: dict[str, str]) -> dict[int | None, dict[str, str]]:
    """The parameter -> tensor names by part: None (outside the layers) first, then each layer."""
    parts: dict[int | None, dict[str, str]] = {None: {}}
    for param, tensor in names.items():
        match = LAYER_PARAM.search(param)
        parts.setdefault(int(match.group(1)) if match else None, {})[param] = tensor
    return parts
