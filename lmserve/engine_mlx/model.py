"""Build an `mlx_lm.models` network from a ModelConfig and name its parameters in GGUF terms.

The network classes are mlx-lm's own; only their arguments, a few GGUF conventions and the tensor
names are mapped here:

- GGUF stores llama-family Q/K rows permuted so that interleaved ("traditional") RoPE reproduces
  Hugging Face's rotate-half; attention scores are invariant to that permutation, so the rows are
  used as stored with `rope_traditional=True` instead of being un-permuted.
- Llama 3.x rope scaling is the `rope_freqs` tensor: llama.cpp divides each inverse frequency by
  its entry, so each layer's rope (mlx-lm's `Llama3RoPE`) gets periods `base^(2i/d) * rope_freqs[i]`.
- llama.cpp's converter stores Gemma's RMSNorm weights with the `1 +` of Gemma's norm added;
  mlx-lm's Gemma norm adds it itself, so 1 is subtracted on loading (`adjust_weights`).
- What ModelConfig does not carry is read from the file: Phi-3.5 / Phi-4-mini's LongRoPE factors
  (`rope_factors_long` / `_short`).
- YaRN left unrounded (gpt-oss's config: `YarnScaling.truncate`) sets mlx-lm YarnRoPE's periods.
- Expert stacks (`ffn_*_exps`, `[experts, out, in]`) are mlx-lm's `SwitchGLU` weights as stored;
  the GGUF name map knows them as `mlp.experts.*`, mlx-lm's qwen3_moe as `mlp.switch_mlp.*`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from lmserve.model import families
from lmserve.model.config import ROPE_INTERLEAVED, ModelConfig
from lmserve.model.gguf_file import GGUFFile, ModelLoadError

Args = dict[str, object]


@dataclass(frozen=True)
class Family:
    """One mlx-lm model class and what it implements beyond the common llama shape."""

    module: str
    extra: Callable[[ModelConfig], Args] = lambda config: {}
    activation: str = families.SILU
    router: str | None = None  # MoE classes: how the class routes
    own_scale: bool = False  # the attention scale is an argument (else 1/sqrt(head_dim))
    partial_rotary: bool = False  # the rotated dimensions are an argument
    sliding: bool = False  # sliding-window layers
    scalings: tuple[str, ...] = ("linear", "llama3", "yarn")  # rope_scaling types the class builds itself
    scaled_embedding: bool = False  # embeddings times sqrt(hidden)
    head_dim_free: bool = True  # else head_dim must be hidden / heads


def _moe(config: ModelConfig) -> Args:
    return {"num_experts": config.n_experts, "num_experts_per_tok": config.n_experts_used,
            "moe_intermediate_size": config.expert_ffn_size, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "norm_topk_prob": True}




def _gemma3(config: ModelConfig) -> Args:
    pattern = _sliding_pattern(config)
    return {"model_type": "gemma3_text", "rope_local_base_freq": config.rope_theta_local,
            "query_pre_attn_scalar": config.attention_scale ** -2, "sliding_window": config.sliding_window or 1,
            "sliding_window_pattern": pattern}


def _phi3(config: ModelConfig) -> Args:
    return {"partial_rotary_factor": config.rotary_dims / config.head_dim}


def _gpt_oss(config: ModelConfig) -> Args:
    return {"model_type": "gpt_oss", "num_local_experts": config.n_experts,
            "num_experts_per_tok": config.n_experts_used, "intermediate_size": config.expert_ffn_size,
            "sliding_window": config.sliding_window,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in config.sliding_layers]}


FAMILIES = {
    "llama": Family("mlx_lm.models.llama"),
    "qwen2": Family("mlx_lm.models.qwen2", head_dim_free=False),
    "qwen3": Family("mlx_lm.models.qwen3"),
    "qwen3moe": Family("mlx_lm.models.qwen3_moe", _moe, router=families.ROUTE_SOFTMAX_TOPK, scalings=()),
    "gemma3": Family("mlx_lm.models.gemma3_text", _gemma3, activation=families.GELU_TANH, own_scale=True,
                     sliding=True, scaled_embedding=True),
    "phi3": Family("mlx_lm.models.phi3", _phi3, partial_rotary=True, scalings=("longrope",), head_dim_free=False),
    "gpt-oss": Family("mlx_lm.models.gpt_oss", _gpt_oss, activation=families.SWIGLU_OAI,
                      router=families.ROUTE_TOPK_SOFTMAX, sliding=True),
}
# GGUF tensors that are not parameters of the network (consumed while building it).
BUILD_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
NORM_OFFSET = {"gemma3": 1.0}  # subtracted from every `*norm.weight` the file stores


def build_model(config: ModelConfig, gguf_file: GGUFFile | None = None) -> nn.Module:
    """An uninitialized (lazy) mlx-lm model of this shape; `load_weights` fills it. `gguf_file`
    supplies what ModelConfig does not carry (the `rope_freqs` values, LongRoPE factors);
    without it only the parameter names are right."""
    family = FAMILIES.get(config.architecture)
    if family is None:
        raise ModelLoadError(f"the MLX engine does not support architecture '{config.architecture}'")
    _check(config, family)
    scaling = _rope_scaling(config, gguf_file)
    in_args = scaling is not None and scaling["type"] in family.scalings
    module = importlib.import_module(family.module)
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
        "rope_scaling": scaling if in_args else None,
        "original_max_position_embeddings": (scaling or {}).get("original_max_position_embeddings",
                                                               config.context_length),
        "attention_bias": config.qkv_bias,
        "tie_word_embeddings": config.tied_embeddings,
    } | family.extra(config))
    model = module.Model(args)
    if "lm_head" in model and config.tied_embeddings:  # gemma3_text's own `sanitize` does this
        if config.architecture != "gemma3":
            raise ModelLoadError(f"mlx-lm's {config.architecture} model has no tied output head")
        model.tie_word_embeddings = True
        model.pop("lm_head")
    if scaling is not None and not in_args:  # the class ignores or refuses this rope_scaling: set it here
        from mlx_lm.models.rope_utils import initialize_rope

        for layer in model.layers:
            layer.self_attn.rope = initialize_rope(config.rotary_dims, config.rope_theta,
                                                   config.rope_style == ROPE_INTERLEAVED, scaling,
                                                   config.context_length)
    periods = None
    if config.has_rope_freqs and gguf_file is not None:
        periods = _rope_periods(config, gguf_file.dequantize("rope_freqs.weight"))
    elif config.rope_yarn is not None and not config.rope_yarn.truncate:
        periods = _yarn_periods(config)
    for layer in model.layers if periods is not None else ():
        layer.self_attn.rope._freqs = periods
    return model


def _check(config: ModelConfig, family: Family) -> None:
    """Refuse what the mlx-lm class would silently compute otherwise."""
    arch = config.architecture
    problems = []
    if config.activation != family.activation:
        problems.append(f"activation {config.activation}")
    if config.is_moe and config.router != family.router:
        problems.append(f"router {config.router}")
    if not family.own_scale and not math.isclose(config.attention_scale, config.head_dim ** -0.5):
        problems.append(f"attention scale {config.attention_scale:g}")
    if config.rope_dims and not family.partial_rotary:
        problems.append(f"partial rotary ({config.rope_dims} of {config.head_dim} dims)")
    if (config.embed_scale != 1.0) != family.scaled_embedding:
        problems.append(f"embedding scale {config.embed_scale:g}")
    if config.sliding_window and not family.sliding:
        problems.append("sliding-window layers")
    if not family.head_dim_free and config.head_dim * config.n_heads != config.hidden_size:
        problems.append("head_dim * heads != hidden size")
    if config.has_rope_freqs and arch != "llama":
        problems.append("rope_freqs")
    if config.rope_yarn and config.has_rope_freqs:
        problems.append("YaRN with rope_freqs")
    if problems:
        raise ModelLoadError(f"mlx-lm's {arch} model cannot compute this file's {', '.join(problems)}")


def _sliding_pattern(config: ModelConfig) -> int:
    """gemma3_text's `sliding_window_pattern`: every n-th layer global, checked against the config."""
    layers = config.sliding_layers if config.sliding_window else (False,) * config.n_layers
    pattern = next((i + 1 for i, sliding in enumerate(layers) if not sliding), config.n_layers + 1)
    if tuple((i + 1) % pattern != 0 for i in range(config.n_layers)) != tuple(layers) or pattern > config.n_layers:
        raise ModelLoadError("mlx-lm's gemma3 model needs one global layer every n layers")
    return pattern


def _rope_scaling(config: ModelConfig, gguf_file: GGUFFile | None) -> Args | None:
    """mlx-lm's `rope_scaling` argument (the Hugging Face config's) for this file."""
    if config.rope_yarn is not None:
        yarn = config.rope_yarn
        return {"type": "yarn", "factor": yarn.factor, "original_max_position_embeddings": yarn.original_context,
                "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow}
    if config.has_rope_freqs:  # a Llama3RoPE, whose periods build_model then sets from the tensor
        return {"type": "llama3", "factor": 1.0, "original_max_position_embeddings": config.context_length}
    if gguf_file is not None and "rope_factors_long.weight" in gguf_file.tensors:
        return _longrope(config, gguf_file)
    factor = config.rope_linear_factor
    return {"type": "linear", "factor": factor} if factor != 1.0 else None


def _longrope(config: ModelConfig, gguf_file: GGUFFile) -> Args:
    """Phi-3.5 / Phi-4-mini LongRoPE, which ModelConfig does not carry: per-pair frequency factors
    in `rope_factors_long` / `_short`. mlx-lm's SuScaledRoPE applies the long ones at every length
    (as it does for the Hugging Face checkpoint; llama.cpp picks them when its context exceeds the
    original one) with its attention factor sqrt(1 + ln(ctx / original) / ln(original))."""
    key = f"{config.architecture}.rope.scaling.original_context_length"
    return {"type": "longrope", "long_factor": gguf_file.dequantize("rope_factors_long.weight").tolist(),
            "short_factor": gguf_file.dequantize("rope_factors_short.weight").tolist(),
            "original_max_position_embeddings": int(gguf_file.metadata.get(key, config.context_length))}


def _rope_periods(config: ModelConfig, rope_freqs: np.ndarray) -> mx.array:
    """What `mx.fast.rope(freqs=...)` takes: per dimension pair, the position divisor of its angle
    (theta_i = pos * base^(-2i/d) / rope_freqs[i], as llama.cpp)."""
    d = config.rotary_dims
    if rope_freqs.shape != (d // 2,):
        raise ModelLoadError(f"rope_freqs has shape {rope_freqs.shape}, expected ({d // 2},)")
    return config.rope_theta ** (mx.arange(0, d, 2, dtype=mx.float32) / d) * mx.array(rope_freqs, mx.float32)


def _yarn_periods(config: ModelConfig) -> mx.array:
    """mlx-lm's YarnRoPE periods with the correction range left unrounded (gpt-oss's own config;
    mlx-lm rounds it, as Hugging Face's default and llama.cpp do)."""
    yarn, d, base = config.rope_yarn, config.rotary_dims, config.rope_theta
    assert yarn is not None

    def correction(rotations: float) -> float:
        return d * math.log(yarn.original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(correction(yarn.beta_fast), 0.0), min(correction(yarn.beta_slow), d - 1.0)
    ramp = mx.clip((mx.arange(d // 2, dtype=mx.float32) - low) / max(high - low, 1e-3), 0, 1)
    extra = base ** (mx.arange(0, d, 2, dtype=mx.float32) / d)
    inter = yarn.factor * extra
    return inter * extra / (inter * (1 - ramp) + extra * ramp)


def adjust_weights(config: ModelConfig, arrays: dict[str, mx.array]) -> None:
    """GGUF conventions that differ from mlx-lm's (in place, lazily)."""
    offset = NORM_OFFSET.get(config.architecture)
    if offset:
        for name in [n for n in arrays if n.endswith("norm.weight")]:
            arrays[name] = arrays[name] - offset


def gguf_names(model: nn.Module, config: ModelConfig, tensors: dict) -> dict[str, str]:
    """MLX parameter name -> GGUF tensor name, for every parameter the model has; a file tensor
    the model has no place for is refused too (as llama.cpp refuses it)."""
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == config.architecture)
    name_map = gguf.get_tensor_name_map(arch, config.n_layers)
    names = {}
    for param, _ in tree_flatten(model.parameters()):
        module_path, suffix = param.rsplit(".", 1)
        base = name_map.get_name(module_path.replace(".switch_mlp.", ".experts."))
        name = f"{base}.{suffix}"
        if base is None:  # a bare parameter of its module (gpt-oss's attention sinks)
            base = name_map.get_name(param)
            name = f"{base}.weight"
        if base is None or name not in tensors:
            raise ModelLoadError(f"the model file has no tensor for {param} ({name})")
        names[param] = name
    unused = sorted(set(tensors) - set(names.values()) - set(BUILD_TENSORS))
    if unused:
        shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
        raise ModelLoadError(f"mlx-lm's {config.architecture} model has no place for the tensors {shown}")
    return names
