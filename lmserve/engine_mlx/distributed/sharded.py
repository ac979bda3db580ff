"""The engines a rank runs on its share of the weights: tensor parallel (mlx-lm's `Model.shard`:
attention heads and FFN columns split, embeddings and norms replicated) or pipeline parallel (a
run of whole layers per rank, pipeline.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from lmserve.engine.kv_types import AUTO
from lmserve.engine_mlx import pipeline
from lmserve.engine_mlx.engine import MLXEngine, Progress
from lmserve.engine_mlx.model import family_of, text_model
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile, TensorInfo


class ShardedMLXEngine(MLXEngine):
    """An MLX engine holding its rank's share of the weights; every step is a collective."""

    queue_next_step = False  # no greedy step left in flight between two lockstep calls
    parallelism = ""  # for the banner

    def __init__(self, gguf: GGUFFile, config: ModelConfig, group: mx.distributed.Group,
                 progress: Progress | None = None, kv_type: str = AUTO) -> None:
        self.group = group
        super().__init__(gguf, config, progress, kv_type=kv_type)


class TensorParallelEngine(ShardedMLXEngine):
    """A share of every layer: mlx-lm's `shard` (heads and FFN columns split)."""

    parallelism = "tensor parallel"

    def __init__(self, gguf: GGUFFile, config: ModelConfig, group: mx.distributed.Group,
                 progress: Progress | None = None, kv_type: str = AUTO) -> None:
        self.kv_share = 1 / group.size()  # each rank caches 1/N of the KV heads (and recurrent state)
        self._sharded_a_layer = False
        super().__init__(gguf, config, group, progress, kv_type)

    def _layer_loaded(self, layer: int) -> None:
        """mlx-lm's `shard`, on this one layer (it shards every layer of the list it finds),
        evaluated so that the whole layer's arrays are let go now. qwen3_5's `shard` splits its
        untied output head too, whenever it runs: after the first layer it is told the head is
        tied (what it checks), so that the head is split once."""
        inner, text = self.model.model, text_model(self.model, self.config)
        keep_head = self._sharded_a_layer and family_of(self.config).shards_head
        tied = keep_head and text.args.tie_word_embeddings
        layers, inner.layers = inner.layers, [inner.layers[layer]]
        if keep_head:
            text.args.tie_word_embeddings = True
        try:
            self.model.shard(self.group)
        finally:
            inner.layers = layers
            if keep_head:
                text.args.tie_word_embeddings = tied
        self._sharded_a_layer = True
        mx.eval(layers[layer].parameters())


class PipelineParallelEngine(ShardedMLXEngine):
    """A run of whole layers (pipeline.py)."""

    def __init__(self, gguf: GGUFFile, config: ModelConfig, group: mx.distributed.Group,
                 progress: Progress | None = None, kv_type: str = AUTO) -> None:
        self.layer_split = pipeline.LayerSplit(config.n_layers, group, family_of(config).tuple_layers)
        self.parallelism = f"pipeline parallel ({self.layer_split.describe()})"
        self.kv_share = self.layer_split.kv_share
        super().__init__(gguf, config, group, progress, kv_type)

    def _build_model(self, config: ModelConfig, gguf: GGUFFile) -> nn.Module:
        model = super()._build_model(config, gguf)
        self.layer_split.prune(model)
        return model

    def _tensors(self, gguf: GGUFFile) -> dict[str, TensorInfo]:
        return self.layer_split.tensors(gguf.tensors)

    def _loaded(self) -> None:
        self.layer_split.connect(self.model)


ENGINES = {"tensor": TensorParallelEngine, "pipeline": PipelineParallelEngine}
