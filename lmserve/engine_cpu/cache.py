"""The CPU engine's cache of one sequence: every attention layer's keys and values, every recurrent
layer's state, and the token ids it holds.

Keys and values are one array per attention layer, `[kv_head, position, row]` (a layer's own
geometry: Gemma 4's sliding and global layers differ), a row being one position's head in the
cache's `--kv-type` (float32 by default; float16, or q8_0 / q4_0 blocks: `kv_codec.py`): a head's
keys for the first `n` positions are one contiguous run, so attention reads float32 ones without a
copy, and growing, copying a prefix or saving the valid part is one slice per array, whatever the
type. They grow in steps up to a fixed capacity.

A recurrent layer (Qwen3.5's Gated DeltaNet) keeps no position axis, only its state after the last
position: the convolution's window (its last kernel - 1 inputs) and the delta-rule state. Such a
state cannot be cut back, so a hybrid cache also keeps checkpoints (`engine/checkpoints.py`) and the
token ids, and cutting it back to `n` restores the latest state at or below `n` and hands the
engine the token ids from there to `n` to feed again. States are snapshots: the forward pass
makes new arrays rather than changing them, so keeping one is keeping a reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmserve.engine.checkpoints import Checkpoints
from lmserve.engine.kv_types import KV_TYPES
from lmserve.engine.protocol import CacheFullError
from lmserve.engine_cpu.kv_codec import KVCodec
from lmserve.model.config import ModelConfig

GROW_STEP = 256  # positions added per reallocation
TOKEN_BYTES = 4  # each cached position's token id (int32)
_FORMAT = "lmserve-cpu-kv-3"  # 3: keys and values in the file's own kv_type

LayerState = tuple[np.ndarray, np.ndarray]  # conv window [kernel - 1, conv_dim], delta-rule state [v_heads, k_dim, v_dim]
State = dict[int, LayerState]  # by layer index; a layer absent is at its empty (zero) state


@dataclass(frozen=True)
class Layout:
    """What a cache holds, from the model's config; a saved cache is refused by another."""

    kv: tuple[tuple[int, int] | None, ...]  # per layer: (KV heads, head size) of attention, None if recurrent
    conv: tuple[int, int] = (0, 0)  # a recurrent layer's conv window (kernel - 1, channels)
    ssm: tuple[int, int, int] = (0, 0, 0)  # and its delta-rule state (value heads, key dim, value dim)
    kv_type: str = "f32"  # what keys and values are stored as (`--kv-type`)

    @classmethod
    def of(cls, config: ModelConfig, kv_type: str = "f32") -> Layout:
        kv = tuple(None if config.is_recurrent(i) else (config.kv_heads(i), config.head_size(i))
                   for i in range(config.n_layers))
        la = config.linear_attention
        if la is None or not config.is_hybrid:
            return cls(kv, kv_type=kv_type)
        return cls(kv, (la.conv_kernel - 1, la.conv_dim), (la.v_heads, la.head_k_dim, la.head_v_dim), kv_type)

    @property
    def codec(self) -> KVCodec:
        return KVCodec(KV_TYPES[self.kv_type])

    @property
    def recurrent(self) -> list[int]:
        return [i for i, geometry in enumerate(self.kv) if geometry is None]

    @property
    def attention(self) -> list[int]:
        return [i for i, geometry in enumerate(self.kv) if geometry is not None]

    def key(self) -> tuple[int, ...]:
        """The layout as integers, as a saved cache records it."""
        return (len(self.kv), *(x for g in self.kv for x in (g or (0, 0))), *self.conv, *self.ssm)

    def zero_state(self) -> LayerState:
        return np.zeros(self.conv, np.float32), np.zeros(self.ssm, np.float32)


class CPUCache:
    """One sequence's cache; `length` positions are valid."""

    def __init__(self, layout: Layout, max_tokens: int, checkpoints: int) -> None:
        """`checkpoints`: the most recurrent-state checkpoints kept (unused without recurrent layers)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.layout = layout
        self.codec = layout.codec
        self._capacity = max_tokens
        self.length = 0
        self.k: list[np.ndarray] = [self._empty(li, 0) for li in range(len(layout.kv))]
        self.v: list[np.ndarray] = [self._empty(li, 0) for li in range(len(layout.kv))]
        self.tokens = np.zeros(0, np.int32)
        self.state: State = {}
        self.checkpoints: Checkpoints[State] = Checkpoints(checkpoints)
        self.kept: tuple[int, State] | None = None  # the state from before the last verify pass

    def _empty(self, layer: int, positions: int) -> np.ndarray:
        """A layer's K or V array (a recurrent layer's holds nothing)."""
        heads, head_dim = self.layout.kv[layer] or (0, 0)
        return self.codec.empty(heads, positions, head_dim)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def allocated(self) -> int:
        """Positions the current arrays can hold."""
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Keys, values and token ids as allocated, and every distinct state array kept: the current
        state, the one from before the last verify pass, and the checkpoints' (shared ones once)."""
        states = [self.state, *(s for _, s in self.checkpoints), *([self.kept[1]] if self.kept else [])]
        arrays = {id(a): a for state in states for pair in state.values() for a in pair}
        return (sum(a.nbytes for a in (*self.k, *self.v, self.tokens))
                + sum(a.nbytes for a in arrays.values()))

    def reserve(self, n: int) -> None:
        """Make room for `n` positions in all, growing by whole steps; refuse past capacity."""
        if n > self._capacity:
            raise CacheFullError(f"KV cache full: {n} positions needed, capacity is {self._capacity}")
        if n <= self.allocated:
            return
        size = min(self._capacity, -(-n // GROW_STEP) * GROW_STEP)
        for arrays in (self.k, self.v):
            for li, old in enumerate(arrays):
                arrays[li] = self._empty(li, size)
                arrays[li][:, :self.length] = old[:, :self.length]
        tokens = np.zeros(size, np.int32)
        tokens[:self.length] = self.tokens[:self.length]
        self.tokens = tokens

    # -- recurrent state -------------------------------------------------------------------------

    def checkpoint(self) -> None:
        """Keep the current recurrent state as the state at the current length."""
        if self.layout.recurrent:
            self.checkpoints.add(self.length, dict(self.state))

    def keep(self) -> None:
        """Keep the current recurrent state before a verify pass, so that cutting back into the
        pass starts from it rather than from an older checkpoint."""
        if self.layout.recurrent:
            self.kept = (self.length, dict(self.state))

    def resume_point(self, n: int) -> int:
        """The longest prefix of at most `n` positions reached without recomputing: `n` at the
        length or without recurrent layers, else the latest kept state at or below `n`."""
        return self._restore_point(n)[0]

    def _restore_point(self, n: int) -> tuple[int, State]:
        """Where cutting back to `n` starts from and the state there: `n` itself at the length or
        without recurrent layers (nothing to restore), else the latest checkpoint at or below `n`
        or the state kept before a verify pass, whichever is later (0 and the empty state when
        neither is)."""
        if n == self.length or not self.layout.recurrent:
            return n, self.state
        position, state = self.checkpoints.latest(n)
        if self.kept is not None and position < self.kept[0] <= n:
            position, state = self.kept
        return position, dict(state or {})

    # -- cutting and copying ---------------------------------------------------------------------

    def truncate(self, n: int) -> np.ndarray:
        """Keep the first `n` positions (the allocation stays for reuse). A hybrid cache is cut back
        to its latest state at or below `n`: returns the token ids from there to `n`, which the
        engine must feed again (none where nothing is recomputed)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {n}")
        start, state = self._restore_point(n)
        replay = self.tokens[start:n].copy()
        self.checkpoints.drop_above(n)
        if self.kept is not None and self.kept[0] > n:
            self.kept = None
        self.length, self.state = start, state
        return replay

    def copy_prefix_to(self, dst: CPUCache, n: int) -> np.ndarray:
        """Make `dst` hold this cache's first `n` positions: keys, values and tokens up to the
        latest state at or below `n`, that state and the checkpoints up to `n`. Returns the token
        ids from there to `n`, which the engine must feed `dst` again."""
        if dst.layout != self.layout:
            raise ValueError("caches belong to different model geometries")
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot copy {n} positions from a cache of {self.length}")
        if dst is self:
            return self.truncate(n)
        start, state = self._restore_point(n)
        dst.reserve(n)
        for li in self.layout.attention:
            dst.k[li][:, :start] = self.k[li][:, :start]
            dst.v[li][:, :start] = self.v[li][:, :start]
        dst.tokens[:start] = self.tokens[:start]
        dst.length, dst.state, dst.kept = start, dict(state), None
        dst.checkpoints = self.checkpoints.up_to(n)
        return self.tokens[start:n].copy()

    # -- files -------------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Write the valid positions, the token ids, the recurrent state and its checkpoints, the
        layout they belong to and the type keys and values are stored in (uncompressed .npz, one
        array per layer)."""
        n = self.length
        arrays = {"format": np.array(_FORMAT), "layout": np.array(self.layout.key()),
                  "kv_type": np.array(self.layout.kv_type), "tokens": self.tokens[:n]}
        for li in self.layout.attention:
            arrays[f"k{li}"], arrays[f"v{li}"] = self.k[li][:, :n], self.v[li][:, :n]
        if self.layout.recurrent:
            snapshots = [(n, self.state), *self.checkpoints]
            arrays["positions"] = np.array([p for p, _ in snapshots], np.int64)
            for li in self.layout.recurrent:
                pairs = [state.get(li) or self.layout.zero_state() for _, state in snapshots]
                arrays[f"conv{li}"] = np.stack([conv for conv, _ in pairs])
                arrays[f"ssm{li}"] = np.stack([ssm for _, ssm in pairs])
        with open(path, "wb") as f:
            np.savez(f, **arrays)

    @classmethod
    def load(cls, layout: Layout, path: Path, max_tokens: int, checkpoints: int) -> CPUCache:
        """Read a cache written by `save`; refuse one of another format or layout. Keys and values
        saved in another `--kv-type` are converted to this cache's (read back as float32, stored
        again), never read as if they were of this one."""
        cache = cls(layout, max_tokens, checkpoints)
        with np.load(path, allow_pickle=False) as data:
            if "format" not in data or str(data["format"]) != _FORMAT:
                raise ValueError(f"{path} is not a saved CPU KV cache of format {_FORMAT}")
            saved = tuple(int(x) for x in data["layout"])
            if saved != layout.key():
                raise ValueError(f"{path} holds a KV cache of layout {saved} (layers, then KV heads and head "
                                 f"size per layer, then the recurrent state's shapes); this model needs {layout.key()}")
            saved_type = str(data["kv_type"])
            if saved_type not in KV_TYPES:
                raise ValueError(f"{path} holds keys and values of an unknown type {saved_type!r}")
            convert = saved_type != layout.kv_type
            saved_codec = KVCodec(KV_TYPES[saved_type])
            tokens = data["tokens"]
            n = len(tokens)
            cache.reserve(n)
            cache.tokens[:n] = tokens
            for li in layout.attention:
                for stored, name in ((cache.k[li], f"k{li}"), (cache.v[li], f"v{li}")):
                    saved = data[name]
                    stored[:, :n] = cache.codec.encode(saved_codec.values(saved)) if convert else saved
            if layout.recurrent:
                states: list[State] = [{} for _ in data["positions"]]
                for li in layout.recurrent:
                    for state, conv, ssm in zip(states, data[f"conv{li}"], data[f"ssm{li}"], strict=True):
                        state[li] = (conv, ssm)
                cache.state = states[0]
                for position, state in zip(data["positions"][1:].tolist(), states[1:], strict=True):
                    cache.checkpoints.add(position, state)
        cache.length = n
        return cache
