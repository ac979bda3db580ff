"""Build an `mlx_lm.models` network from a ModelConfig and name its parameters in GGUF terms.

The network classes are mlx-lm's own; only their arguments, a few GGUF conventions and the tensor
names are mapped here (the conventions that change weights are undone in `layout.py`):

- GGUF stores llama-family Q/K rows permuted so that interleaved ("traditional") RoPE reproduces
  Hugging Face's rotate-half; attention scores are invariant to that permutation, so the rows are
  used as stored with `rope_traditional=True` instead of being un-permuted.
- `rope_freqs` divides each inverse frequency (llama.cpp): Llama 3.x's rope scaling on every layer
  (mlx-lm's `Llama3RoPE`), Gemma 4's "proportional" partial rotary on its global layers (entries of
  1e30 leave a pair unrotated; mlx-lm's `ProportionalRoPE`): each gets periods
  `base^(2i/d) * rope_freqs[i]`.
- What ModelConfig does not carry is read from the file: Phi-3.5 / Phi-4-mini's LongRoPE factors
  (`rope_factors_long` / `_short`).
- YaRN left unrounded (gpt-oss's config: `YarnScaling.truncate`) sets mlx-lm YarnRoPE's periods.
- Expert stacks (`ffn_*_exps`, `[experts, out, in]`) are mlx-lm's `SwitchGLU` weights as stored;
  the GGUF name map knows them as `mlp.experts.*` / `experts.*`, mlx-lm as `switch_mlp` /
  `switch_glu`; a fused `ffn_gate_up_exps` (Gemma 4) is read once and split on loading.
- Qwen3.5's classes wrap the text model in `language_model` (its vision-language checkpoint
  layout); names are mapped without that prefix.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import gguf
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from lmserve.model import families
from lmserve.model.config import ROPE_INTERLEAVED, ModelConfig
from lmserve.model.gguf_file import GGUFFile, ModelLoadError
from lmserve.model.rope import rope_for

Args = dict[str, object]
Head = Callable[[mx.array], mx.array]
LAYER_PARAM = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a parameter of one layer (its number)


@dataclass(frozen=True)
class Family:
    """One mlx-lm model class and what it implements beyond the common llama shape."""

    module: str
    extra: Callable[[ModelConfig], Args] = lambda config: {}
    activation: str = families.SILU
    router: str | None = None  # MoE classes: how the class routes
    own_scale: bool = False  # the attention scale is an argument (else 1/sqrt(head_dim))
    fixed_scale: float = 0.0  # the attention scale the class hard-codes (Gemma 4: 1)
    partial_rotary: bool = False  # the rotated dimensions are an argument
    sliding: bool = False  # sliding-window layers
    scalings: tuple[str, ...] = ("linear", "llama3", "yarn")  # rope_scaling types the class builds itself
    scaled_embedding: bool = False  # embeddings times sqrt(hidden)
    head_dim_free: bool = True  # else head_dim must be hidden / heads
    rope_freqs: bool = False  # its non-sliding layers' rope takes llama.cpp's `rope_freqs` divisors
    uniform_rope: bool = True  # one rope for every layer (so a rope scaling the class lacks can be set)
    # Features of `features()` the class computes when the file has them, and those it computes
    # always (a file without them is refused too).
    computes: frozenset[str] = field(default_factory=frozenset)
    always: frozenset[str] = field(default_factory=frozenset)
    text_model: str = ""  # the attribute the class keeps its text model under (Qwen3.5: language_model)
    shards_head: bool = False  # its shard() splits the untied output head over the vocabulary
    tuple_layers: bool = False  # its decoder layers return (hidden, shared KV, offset) (Gemma 4)


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


def _qwen35(config: ModelConfig) -> Args:
    """qwen3_5's text arguments: its Gated DeltaNet shapes, one full-attention layer every
    `full_attention_interval` (checked against the file's layers), partial NeoX rotary."""
    la = config.linear_attention
    assert la is not None  # a hybrid config has it (_check)
    interval = config.attention_layers[0] + 1
    if config.recurrent_layers != tuple((i + 1) % interval != 0 for i in range(config.n_layers)):
        raise ModelLoadError("mlx-lm's qwen3_5 model needs one full-attention layer every n layers")
    args: Args = {"linear_num_value_heads": la.v_heads, "linear_num_key_heads": la.k_heads,
                  "linear_key_head_dim": la.head_k_dim, "linear_value_head_dim": la.head_v_dim,
                  "linear_conv_kernel_dim": la.conv_kernel, "full_attention_interval": interval,
                  "rope_parameters": {"type": "default", "rope_theta": config.rope_theta,
                                      "partial_rotary_factor": config.rotary_dims / config.head_dim}}
    if config.is_moe:  # llama.cpp: a file without the shared expert's length gives it the FFN's
        args |= _moe(config) | {"shared_expert_intermediate_size": config.shared_expert_ffn_size or config.ffn_size}
    return args


def _gemma4(config: ModelConfig) -> Args:
    """gemma4_text's arguments: one head size, KV head count and rope per layer kind (sliding and
    global), values from keys on the global layers (k_eq_v), the MoE block beside the dense FFN."""
    kinds = {kind: [i for i in range(config.n_layers) if config.sliding_layers[i] == kind] for kind in (True, False)}
    shapes = {kind: {(config.head_size(i), config.kv_heads(i), config.layer_rotary_dims(i)) for i in layers}
              for kind, layers in kinds.items()}
    k_eq_v = any(config.values_from_keys)
    problems = [f"{'sliding' if kind else 'global'} layers of several shapes" for kind, s in shapes.items() if len(s) > 1]
    if k_eq_v and config.values_from_keys != tuple(not s for s in config.sliding_layers):
        problems.append("values from keys on other layers than the global ones")
    (swa_dim, swa_kv, swa_rot), (full_dim, full_kv, _) = (
        next(iter(shapes[kind]), (config.head_dim, config.n_kv_heads, config.head_dim)) for kind in (True, False))
    if swa_rot != swa_dim:
        problems.append(f"partial rotary on the sliding layers ({swa_rot} of {swa_dim} dims)")
    if full_kv != swa_kv and not k_eq_v:
        problems.append("other KV heads on the global layers without values from keys")
    if problems:
        raise ModelLoadError(f"mlx-lm's gemma4_text model cannot compute this file's {', '.join(problems)}")
    rope = {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 1.0,  # periods: rope_freqs
                               "rope_theta": config.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": config.rope_theta_local or 10_000.0}}
    return {"model_type": "gemma4_text", "head_dim": swa_dim, "global_head_dim": full_dim,
            "num_key_value_heads": swa_kv, "num_global_key_value_heads": full_kv, "attention_k_eq_v": k_eq_v,
            "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "use_double_wide_mlp": False,
            "sliding_window": config.sliding_window or 1, "rope_parameters": rope,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in config.sliding_layers],
            "final_logit_softcapping": config.final_softcap or None, "enable_moe_block": config.is_moe,
            "num_experts": config.n_experts or None, "top_k_experts": config.n_experts_used or None,
            "moe_intermediate_size": config.expert_ffn_size or None}


HYBRID = "recurrent layers"
OUTPUT_GATE = "attention output gate"
PER_LAYER_SHAPES = "per-layer head sizes or KV heads"
VALUES_FROM_KEYS = "values from keys"
VALUE_NORM = "value norm"
LAYER_SCALE = "layer output scale"
SOFTCAP = "final logit softcap"
DENSE_BESIDE_EXPERTS = "dense FFN beside the experts"
_QWEN35 = dict(extra=_qwen35, router=families.ROUTE_SOFTMAX_TOPK, partial_rotary=True, scalings=(),
               computes=frozenset({HYBRID, OUTPUT_GATE}), always=frozenset({HYBRID, OUTPUT_GATE}),
               text_model="language_model", shards_head=True)

FAMILIES = {
    "llama": Family("mlx_lm.models.llama", rope_freqs=True),
    "qwen2": Family("mlx_lm.models.qwen2", head_dim_free=False),
    "qwen3": Family("mlx_lm.models.qwen3"),
    "qwen3moe": Family("mlx_lm.models.qwen3_moe", _moe, router=families.ROUTE_SOFTMAX_TOPK, scalings=()),
    "gemma3": Family("mlx_lm.models.gemma3_text", _gemma3, activation=families.GELU_TANH, own_scale=True,
                     sliding=True, scaled_embedding=True),
    "phi3": Family("mlx_lm.models.phi3", _phi3, partial_rotary=True, scalings=("longrope",), head_dim_free=False),
    "gpt-oss": Family("mlx_lm.models.gpt_oss", _gpt_oss, activation=families.SWIGLU_OAI,
                      router=families.ROUTE_TOPK_SOFTMAX, sliding=True),
    "qwen35": Family("mlx_lm.models.qwen3_5", **_QWEN35),
    "qwen35moe": Family("mlx_lm.models.qwen3_5_moe", **_QWEN35),
    "gemma4": Family("mlx_lm.models.gemma4_text", _gemma4, activation=families.GELU_TANH, router=families.ROUTE_GEMMA4,
                     fixed_scale=1.0, partial_rotary=True, sliding=True, scalings=(), scaled_embedding=True,
                     rope_freqs=True, uniform_rope=False, tuple_layers=True,
                     computes=frozenset({PER_LAYER_SHAPES, VALUES_FROM_KEYS, VALUE_NORM, LAYER_SCALE, SOFTCAP,
                                         DENSE_BESIDE_EXPERTS}),
                     always=frozenset({VALUE_NORM})),
}
# GGUF tensors that are not parameters of the network (consumed while building it).
BUILD_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def features(config: ModelConfig) -> set[str]:
    """What this file computes beyond the common llama shape, by the names `Family` uses."""
    named = {HYBRID: config.is_hybrid, OUTPUT_GATE: config.attn_output_gate,
             PER_LAYER_SHAPES: bool(config.layer_head_dims or config.layer_kv_heads),
             VALUES_FROM_KEYS: any(config.values_from_keys), VALUE_NORM: config.value_norm,
             LAYER_SCALE: config.layer_output_scale, SOFTCAP: bool(config.final_softcap),
             DENSE_BESIDE_EXPERTS: config.moe_dense_ffn}
    return {name for name, present in named.items() if present}


def build_model(config: ModelConfig, gguf_file: GGUFFile | None = None) -> nn.Module:
    """An uninitialized (lazy) mlx-lm model of this shape; `load_weights` fills it. `gguf_file`
    supplies what ModelConfig does not carry (the `rope_freqs` values, LongRoPE factors);
    without it only the parameter names are right."""
    family = family_of(config)
    scaling = _rope_scaling(config, family, gguf_file)
    in_args = scaling is not None and scaling["type"] in family.scalings
    _check(config, family, scaling is not None and not in_args)
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

        for attention in _attentions(model, config):
            attention.rope = initialize_rope(config.rotary_dims, config.rope_theta,
                                             config.rope_style == ROPE_INTERLEAVED, scaling, config.context_length)
    targets: list[nn.Module] = []
    if config.has_rope_freqs and gguf_file is not None:
        targets = _attentions(model, config, global_only=True)
    elif config.rope_yarn is not None and not config.rope_yarn.truncate:
        targets = _attentions(model, config)
    if targets:
        periods = _rope_periods(config, gguf_file)
        for attention in targets:
            attention.rope._freqs = periods
    return model


def family_of(config: ModelConfig) -> Family:
    family = FAMILIES.get(config.architecture)
    if family is None:
        raise ModelLoadError(f"the MLX engine does not support architecture '{config.architecture}'")
    return family


def text_model(model: nn.Module, config: ModelConfig) -> nn.Module:
    """The module holding the decoder (`model`) and the output head: the class itself, or the
    text model it wraps (Qwen3.5's `language_model`)."""
    attribute = family_of(config).text_model
    return model[attribute] if attribute else model


def output_head(model: nn.Module, config: ModelConfig) -> Head:
    """What the class's own `__call__` does after its decoder's final norm: the output head (or
    the tied embeddings), gathered over the vocabulary where its `shard()` split the head, and
    Gemma 4's final soft cap. The engine runs it on the positions it needs only."""
    text = text_model(model, config)
    shards_head, cap = family_of(config).shards_head, config.final_softcap

    def head(h: mx.array) -> mx.array:
        if "lm_head" not in text:
            out = text.model.embed_tokens.as_linear(h)
        else:
            out = text.lm_head(h)
            if shards_head and text.sharding_group is not None:
                from mlx_lm.models.base import gather_last_axis

                out = gather_last_axis(out, text.sharding_group)
        return cap * mx.tanh(out / cap) if cap else out

    return head


def _attentions(model: nn.Module, config: ModelConfig, global_only: bool = False) -> list[nn.Module]:
    """The attention modules (recurrent layers have none), or those of the global layers only:
    `rope_freqs` is theirs (Llama 3: every layer; Gemma 4: the full-attention ones)."""
    return [layer.self_attn for i, layer in enumerate(model.layers) if not config.is_recurrent(i)
            and not (global_only and config.sliding_layers and config.sliding_layers[i])]


def _check(config: ModelConfig, family: Family, rope_set_here: bool) -> None:
    """Refuse what the mlx-lm class would silently compute otherwise."""
    arch = config.architecture
    problems = []
    if config.activation != family.activation:
        problems.append(f"activation {config.activation}")
    if config.is_moe and config.router != family.router:
        problems.append(f"router {config.router}")
    scale = family.fixed_scale or config.head_dim ** -0.5
    if not family.own_scale and not math.isclose(config.attention_scale, scale):
        problems.append(f"attention scale {config.attention_scale:g}")
    if config.rope_dims and not family.partial_rotary:
        problems.append(f"partial rotary ({config.rope_dims} of {config.head_dim} dims)")
    if (config.embed_scale != 1.0) != family.scaled_embedding:
        problems.append(f"embedding scale {config.embed_scale:g}")
    if config.sliding_window and not family.sliding:
        problems.append("sliding-window layers")
    if not family.head_dim_free and config.head_dim * config.n_heads != config.hidden_size:
        problems.append("head_dim * heads != hidden size")
    if config.has_rope_freqs and not family.rope_freqs:
        problems.append("rope_freqs")
    if config.rope_yarn and config.has_rope_freqs:
        problems.append("YaRN with rope_freqs")
    if rope_set_here and not family.uniform_rope:
        problems.append("rope scaling")
    present = features(config)
    problems += sorted(present - family.computes) + [f"lack of {name}" for name in sorted(family.always - present)]
    if problems:
        raise ModelLoadError(f"mlx-lm's {arch} model cannot compute this file's {', '.join(problems)}")


def _sliding_pattern(config: ModelConfig) -> int:
    """gemma3_text's `sliding_window_pattern`: every n-th layer global, checked against the config."""
    layers = config.sliding_layers if config.sliding_window else (False,) * config.n_layers
    pattern = next((i + 1 for i, sliding in enumerate(layers) if not sliding), config.n_layers + 1)
    if tuple((i + 1) % pattern != 0 for i in range(config.n_layers)) != tuple(layers) or pattern > config.n_layers:
        raise ModelLoadError("mlx-lm's gemma3 model needs one global layer every n layers")
    return pattern


def _rope_scaling(config: ModelConfig, family: Family, gguf_file: GGUFFile | None) -> Args | None:
    """mlx-lm's `rope_scaling` argument (the Hugging Face config's) for this file."""
    if config.rope_yarn is not None:
        yarn = config.rope_yarn
        return {"type": "yarn", "factor": yarn.factor, "original_max_position_embeddings": yarn.original_context,
                "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow}
    if config.has_rope_freqs:  # periods build_model sets from the tensor: on a Llama3RoPE, or Gemma 4's own
        return {"type": "llama3", "factor": 1.0, "original_max_position_embeddings": config.context_length} \
            if family.uniform_rope else None
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


def _rope_periods(config: ModelConfig, gguf_file: GGUFFile | None) -> mx.array:
    """The periods `mx.fast.rope(freqs=...)` takes, from the rope module both engines share: the
    global layers' `rope_freqs` divisors (theta_i = pos * base^(-2i/d) / rope_freqs[i], as
    llama.cpp), or YaRN with its correction range left unrounded (gpt-oss's own config; mlx-lm's
    YarnRoPE rounds it, as Hugging Face's default and llama.cpp do)."""
    d = config.layer_rotary_dims(next(i for i in config.attention_layers
                                      if not (config.sliding_layers and config.sliding_layers[i])))
    rope = rope_for(gguf_file, config, config.rope_theta, config.rope_linear_factor, d, config.has_rope_freqs)
    return mx.array(rope.periods, mx.float32)


# Parameters the GGUF name map has no entry for: (the last two parts of the MLX name) -> the tensor
# after `blk.N.` (llama.cpp's converter renames them).
EXPLICIT = {"linear_attn.dt_bias": "ssm_dt.bias", "router.scale": "ffn_gate_inp.scale",
            "router.per_expert_scale": "ffn_down_exps.scale"}
_GATE_OR_UP = re.compile(r"\.(gate|up)_proj$")
FUSED_GATE_UP = "fused_gate_up_proj"  # experts' gate and up read as one (`ffn_gate_up_exps`; layout.py splits it)


def gguf_names(model: nn.Module, config: ModelConfig, tensors: dict) -> dict[str, str]:
    """MLX parameter name -> GGUF tensor name, for every parameter the model has (a fused expert
    gate/up stack once, as `...fused_gate_up_proj.*`); a file tensor the model has no place for is
    refused too (as llama.cpp refuses it)."""
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == config.architecture)
    name_map = gguf.get_tensor_name_map(arch, config.n_layers)
    prefix = f"{family_of(config).text_model}." if family_of(config).text_model else ""
    names = {}
    for param, _ in tree_flatten(model.parameters()):
        candidates = _candidates(name_map, param.removeprefix(prefix))
        found = next(((key, tensor) for key, tensor in candidates if tensor in tensors), None)
        if found is None:
            raise ModelLoadError(f"the model file has no tensor for {param} ({candidates[0][1] if candidates else '?'})")
        key, tensor = found
        names[prefix + key] = tensor
    unused = sorted(set(tensors) - set(names.values()) - set(BUILD_TENSORS))
    if unused:
        shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
        raise ModelLoadError(f"mlx-lm's {config.architecture} model has no place for the tensors {shown}")
    return names


def _candidates(name_map: gguf.TensorNameMap, param: str) -> list[tuple[str, str]]:
    """Where one parameter (its name inside the text model) may be in the file, in order of
    preference: (the name it is read as, the GGUF tensor)."""
    module, suffix = param.rsplit(".", 1)
    layer = LAYER_PARAM.search(param)
    rule = EXPLICIT.get(".".join(param.split(".")[-2:]))
    if rule is not None and layer is not None:
        return [(param, f"blk.{layer.group(1)}.{rule}")]
    path = module.replace(".switch_mlp.", ".experts.").replace(".switch_glu.", ".")
    out = []
    if (base := name_map.get_name(path)) is not None:
        out.append((param, f"{base}.{suffix}"))
    if _GATE_OR_UP.search(path) and (base := name_map.get_name(_GATE_OR_UP.sub(".gate_up_proj", path))):
        out.append((f"{_GATE_OR_UP.sub(f'.{FUSED_GATE_UP}', module)}.{suffix}", f"{base}.{suffix}"))
    if (base := name_map.get_name(param)) is not None:  # a bare parameter (gpt-oss's sinks, Qwen3.5's A_log)
        out += [(param, f"{base}.weight"), (param, base)]
    return out
