"""`--distributed pipeline`: a model's layers split into contiguous runs, one run per rank.

For the families whose mlx-lm class has no tensor-parallel `shard()` (Gemma 3, Phi-3), and any
other. Rank 0 holds the first layers and the last rank the last ones. A step's hidden state goes
from rank to rank (`mx.distributed.send` / `recv_like`), and the last rank's output is gathered to
every rank (`all_gather`), whose norm and output head then run as usual: embeddings, final norm
and head are replicated. One rank computes at a time, so this splits a model's memory, not its
time. A rank reads from the GGUF only its own layers' tensors.

A layer another rank holds is a `Skipped` module in its place: the hidden state passes through,
and its cache keeps a 1x1 key and value per position (a recurrent layer's, Qwen3.5's Gated
DeltaNet, a 1x1x1 state). The model's own mask code reads the caches by layer index (layer 0,
Gemma 3's first global layer, gpt-oss's first sliding one, Qwen3.5's first recurrent and first
attention layers), and the engine batches, truncates, checkpoints, recomputes, copies and saves
all of a sequence's layers alike, so every rank keeps a cache for every layer with the same
offsets, and cuts back to the same checkpoints (every rank remembers the same token ids). mlx-lm's
own `PipelineMixin` covers only qwen2, qwen3_moe and qwen3_5 of our families, and keeps caches for
a rank's own layers only, which the first of those breaks.

Gemma 4's decoder layers return (hidden state, shared KV, offset) rather than the hidden state: the
modules here pass the first on and hand back the rest as the layer gave it (nothing, for a
skipped one: no layer of ours shares another's KV).

Every send and receive is in the graph of what the engine evaluates: a skipped layer's cache
depends on the hidden state it passed on (a prefill chunk evaluates only the caches), and a received
state depends on the skipped layers before it.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

T = TypeVar("T")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.")  # a GGUF tensor of one layer


def runs(n_layers: int, world: int) -> list[range]:
    """Each rank's layers: contiguous, as even as can be (the first ranks take one more)."""
    base, extra = divmod(n_layers, world)
    out, start = [], 0
    for rank in range(world):
        out.append(range(start, start + base + (rank < extra)))
        start = out[-1].stop
    return out


def _keep_flags(layer: nn.Module, into: nn.Module) -> None:
    """The plain settings of a layer the model's own forward reads (llama's `use_sliding`)."""
    for key, value in vars(layer).items():
        if isinstance(value, (bool, int, float, str)) and not key.startswith("_"):
            setattr(into, key, value)


class Skipped(nn.Module):
    """A layer another rank holds: the hidden state passes through, the cache counts positions."""

    def __init__(self, layer: nn.Module, tuple_out: bool) -> None:
        super().__init__()
        _keep_flags(layer, self)
        self.tuple_out = tuple_out

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None, **kwargs: Any) -> Any:
        if isinstance(cache, ArraysCache):  # a recurrent layer's: a state that depends on x
            cache[0] = cache[1] = mx.depends(mx.zeros((x.shape[0], 1, 1), x.dtype), x)
            cache.advance(x.shape[1])
            x = mx.depends(x, [cache[0]])
        elif cache is not None:
            tiny = mx.depends(mx.zeros((x.shape[0], 1, x.shape[1], 1), x.dtype), x)
            x = mx.depends(x, list(cache.update_and_fetch(tiny, tiny)))
        return (x, None, None) if self.tuple_out else x


class Boundary(nn.Module):
    """A layer where the hidden state crosses ranks: received from `source` before it, sent to
    `target` after it, and after the model's last layer gathered from the last rank."""

    def __init__(self, layer: nn.Module, group: mx.distributed.Group, source: int | None = None,
                 target: int | None = None, gather: bool = False, tuple_out: bool = False) -> None:
        super().__init__()
        _keep_flags(layer, self)
        self.layer = layer
        self.group, self.source, self.target, self.gather = group, source, target, gather
        self.tuple_out = tuple_out

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        if self.source is not None:
            x = mx.depends(mx.distributed.recv_like(x, self.source, group=self.group), x)
        out = self.layer(x, *args, **kwargs)
        x, rest = (out[0], out[1:]) if self.tuple_out else (out, ())
        if self.target is not None:
            x = mx.distributed.send(x, self.target, group=self.group)
        if self.gather:
            x = mx.distributed.all_gather(x, group=self.group)[-x.shape[0]:]
        return (x, *rest) if self.tuple_out else x


class LayerSplit:
    """This rank's run of layers, and the surgery that leaves a model with only those."""

    def __init__(self, n_layers: int, group: mx.distributed.Group, tuple_layers: bool = False) -> None:
        self.group = group
        self.n_layers = n_layers
        self.tuple_layers = tuple_layers  # the model's decoder layers return a tuple (Gemma 4)
        self.runs = runs(n_layers, group.size())
        self.held = self.runs[group.rank()]

    @property
    def kv_share(self) -> float:
        """The largest part of a cached position one rank holds (slots are sized for it)."""
        return max(map(len, self.runs)) / self.n_layers

    def describe(self) -> str:
        return "layers " + " | ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in self.runs)

    def prune(self, model: nn.Module) -> None:
        """Before the weights load: the other ranks' layers become `Skipped` (no parameters)."""
        layers = model.model.layers  # the list itself (some classes' `layers` is a slice of it)
        for i in range(len(layers)):
            if i not in self.held:
                layers[i] = Skipped(layers[i], self.tuple_layers)

    def tensors(self, tensors: Mapping[str, T]) -> dict[str, T]:
        """The file's tensors this rank loads: every one but the other ranks' layers'."""
        return {name: info for name, info in tensors.items()
                if (m := _LAYER_TENSOR.match(name)) is None or int(m.group(1)) in self.held}

    def connect(self, model: nn.Module) -> None:
        """After the weights load: the boundaries of this rank's run, and the final gather."""
        rank, last = self.group.rank(), self.group.size() - 1
        ends: dict[int, dict[str, Any]] = collections.defaultdict(dict)
        if rank > 0:
            ends[self.held.start]["source"] = rank - 1
        if rank < last:
            ends[self.held.stop - 1]["target"] = rank + 1
        ends[self.n_layers - 1]["gather"] = True
        layers = model.model.layers  # the list itself (some classes' `layers` is a slice of it)
        for i, where in ends.items():
            layers[i] = Boundary(layers[i], self.group, tuple_out=self.tuple_layers, **where)
