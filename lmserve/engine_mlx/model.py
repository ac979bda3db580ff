"""Build an `mlx_lm.models` network from a ModelConfig and name its parameters in GGUF terms.

The network classes are mlx-lm's own; only their arguments and the tensor names are mapped here.
GGUF stores llama-family Q/K rows permuted so that interleaved ("traditional") RoPE reproduces
Hugging Face's rotate-half; attention scores are invariant to that permutation, so the rows are
used as stored with `rope_traditional=True` instead of being un-permuted.
"""

from __future__ import annotations

import importlib

import gguf
import mlx.nn as nn
from mlx.utils import tree_flatten

from lmserve.model.config import ROPE_INTERLEAVED, ModelConfig
from lmserve.model.gguf_file import ModelLoadError

MLX_LM_MODULES = {"llama": "mlx_lm.models.llama", "qwen2": "mlx_lm.models.qwen2", "qwen3": "mlx_lm.models.qwen3"}


def build_model(config: ModelConfig) -> nn.Module:
    """An uninitialized (lazy) mlx-lm model of this shape; `load_weights` fills it."""
    if config.architecture not in MLX_LM_MODULES:
        raise ModelLoadError(f"the MLX engine does not support architecture '{config.architecture}'")
    if config.architecture == "qwen2" and config.head_dim * config.n_heads != config.hidden_size:
        raise ModelLoadError("mlx-lm's qwen2 needs head_dim * heads == hidden size")
    module = importlib.import_module(MLX_LM_MODULES[config.architecture])
    args = module.ModelArgs.from_dict({
        "model_type": config.architecture,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.n_layers,
        "intermediate_size": config.ffn_size,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_eps,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.context_length,
        "rope_theta": config.rope_theta,
        "rope_traditional": config.rope_style == ROPE_INTERLEAVED,
        "attention_bias": config.qkv_bias,
        "tie_word_embeddings": config.tied_embeddings,
    })
    return module.Model(args)


def gguf_names(model: nn.Module, config: ModelConfig, tensors: dict) -> dict[str, str]:
    """MLX parameter name -> GGUF tensor name, for every parameter the model has."""
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == config.architecture)
    name_map = gguf.get_tensor_name_map(arch, config.n_layers)
    names = {}
    for param, _ in tree_flatten(model.parameters()):
        module_path, suffix = param.rsplit(".", 1)
        base = name_map.get_name(module_path)
        if base is None or f"{base}.{suffix}" not in tensors:
            raise ModelLoadError(f"the model file has no tensor for {param} ({base}.{suffix})")
        names[param] = f"{base}.{suffix}"
    return names
