"""GGUF metadata -> one normalized model configuration shared by every engine.

Everything an engine needs to know about a family's shape is read here once, from the GGUF
keys and tensor table, so the engines never look at metadata themselves. Where llama.cpp hard-codes
a family fact the file does not carry (Gemma 3's sliding-window pattern, gpt-oss's alternating
layers and its SwiGLU clamp), `model/families.py` holds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmserve.model import families
from lmserve.model.gguf_file import GGUFFile, ModelLoadError

SUPPORTED_ARCHITECTURES = tuple(families.FAMILIES)

# How rotary embeddings pair dimensions. GGUF stores llama-family Q/K rows permuted so that
# ggml's "normal" rope (adjacent pairs) reproduces Hugging Face's rotate-half; the others use NeoX.
ROPE_INTERLEAVED = "interleaved"
ROPE_NEOX = "neox"

# `<arch>.pooling_type`, llama.cpp's `llama_pooling_type` by value: how an embedding model's
# per-position hidden states become one vector. "none" keeps every position's; "rank" is a
# reranker's (a classifier head on the pooled state), not an embedding.
POOLING_TYPES = ("none", "mean", "cls", "last", "rank")
EMBEDDING_POOLINGS = ("mean", "cls", "last")  # those that give one embedding per input


@dataclass(frozen=True)
class YarnScaling:
    """YaRN context extension (gpt-oss): the rotary frequencies are blended between
    interpolated and original by wavelength, and attention logits are scaled by `mscale`."""

    factor: float
    original_context: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # round the correction range to whole dimensions (HF's default, llama.cpp)


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet, the linear-attention layers of Qwen3.5 / 3.6: a short causal convolution over
    the fused q/k/v projections, then per value head a `head_k_dim x head_v_dim` state updated by
    the gated delta rule. Its state has no position axis, so it cannot be cut back to a prefix the
    way attention keys and values are (see `engine/checkpoints.py`)."""

    conv_kernel: int  # ssm.conv_kernel: taps of the causal conv1d (the state keeps the last kernel - 1 inputs)
    k_heads: int  # ssm.group_count
    v_heads: int  # ssm.time_step_rank; a multiple of k_heads (GGUF stores V heads tiled: head j reads K head j % k_heads)
    head_k_dim: int  # ssm.state_size
    head_v_dim: int  # ssm.inner_size / v_heads

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q and k (k_heads x head_k_dim each), then v."""
        return 2 * self.k_heads * self.head_k_dim + self.v_heads * self.head_v_dim

    def state_bytes(self, conv_dtype_bytes: int = 4) -> int:
        """One layer's recurrent state: the convolution's window (in the compute dtype) and the
        delta-rule state (float32 on both engines)."""
        return ((self.conv_kernel - 1) * self.conv_dim * conv_dtype_bytes
                + self.v_heads * self.head_k_dim * self.head_v_dim * 4)


@dataclass(frozen=True)
class ModelConfig:
    """Everything an engine or the server needs to know about a model's shape."""

    architecture: str
    name: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rope_style: str
    rms_eps: float
    qkv_bias: bool
    qk_norm: bool
    tied_embeddings: bool
    n_params: int
    quant_mix: dict[str, int] = field(default_factory=dict)
    family: str = ""  # human name of the family ("Llama", "Qwen3 MoE", ...)
    rope_dims: int = 0  # rotated dimensions of each head (partial rotary); 0: all of head_dim
    rope_theta_local: float | None = None  # the sliding-window layers' own base (Gemma 3)
    rope_yarn: YarnScaling | None = None
    rope_linear_factor: float = 1.0  # linear scaling: positions divided by it (Gemma 3 4B-27B, global layers)
    has_rope_freqs: bool = False  # Llama 3.x: per-frequency divisors in the `rope_freqs` tensor
    sliding_window: int = 0  # positions a sliding layer attends to (0: no sliding layers)
    sliding_layers: tuple[bool, ...] = ()  # per layer: attends to the sliding window only
    attn_scale: float = 0.0  # attention logit scale; 0: 1/sqrt(head_dim)
    attn_sinks: bool = False  # gpt-oss: a learned per-head logit that takes softmax mass
    o_bias: bool = False  # gpt-oss: the attention output projection has a bias
    post_norms: bool = False  # Gemma 3: RMSNorm after attention and after the FFN too
    embed_scale: float = 1.0  # Gemma: embeddings are multiplied by sqrt(hidden)
    activation: str = families.SILU  # the FFN's gated activation
    fused_qkv: bool = False  # Phi-3: Q, K and V in one `attn_qkv` tensor
    fused_gate_up: bool = False  # Phi-3: gate and up in one `ffn_up` tensor
    n_experts: int = 0  # MoE: experts per layer (0: a dense FFN)
    n_experts_used: int = 0  # MoE: experts each token is routed to
    expert_ffn_size: int = 0
    expert_bias: bool = False  # gpt-oss: router and experts have biases
    router: str = families.ROUTE_SOFTMAX_TOPK  # how router logits become expert weights
    n_active_params: int = 0  # parameters one token reads (MoE: only its experts); = n_params if dense
    # Hybrid models (Qwen3.5 / 3.6): per layer, True for a Gated DeltaNet layer, which caches a
    # recurrent state instead of keys and values; the others are full attention.
    recurrent_layers: tuple[bool, ...] = ()
    linear_attention: LinearAttention | None = None
    attn_output_gate: bool = False  # Qwen3.5: q_proj emits each head's query and a sigmoid gate on its output
    shared_expert_ffn_size: int = 0  # Qwen3.5 MoE: a shared expert beside the routed ones, gated per token
    # Gemma 4: sliding and global layers differ in head size, KV heads and rotary dims.
    layer_head_dims: tuple[int, ...] = ()  # per layer (empty: head_dim everywhere)
    layer_kv_heads: tuple[int, ...] = ()  # per layer (empty: n_kv_heads everywhere)
    rope_dims_local: int = 0  # the sliding layers' rotated dims (0: as rotary_dims)
    values_from_keys: tuple[bool, ...] = ()  # per layer: no V projection, values are the K projection (k_eq_v)
    value_norm: bool = False  # Gemma 4: values RMS-normalized without a weight
    layer_output_scale: bool = False  # Gemma 4: each layer's output times a learned scalar
    final_softcap: float = 0.0  # logits = cap * tanh(logits / cap) (0: none)
    moe_dense_ffn: bool = False  # Gemma 4 MoE: every layer has a dense FFN beside its experts
    # `<arch>.pooling_type` by name (POOLING_TYPES; "unknown (N)" for a value llama.cpp has no
    # name for); None when the file has none, as a generative model's has not.
    pooling: str | None = None

    def head_size(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def kv_heads(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.n_kv_heads

    def layer_rotary_dims(self, layer: int) -> int:
        """Rotated dims of one layer's heads: the sliding layers' own count where the file gives one
        (Gemma 4), else partial rotary's, else the whole head."""
        if self.rope_dims_local and self.sliding_layers and self.sliding_layers[layer]:
            return self.rope_dims_local
        return self.rope_dims or self.head_size(layer)

    def is_recurrent(self, layer: int) -> bool:
        return bool(self.recurrent_layers) and self.recurrent_layers[layer]

    @property
    def attention_layers(self) -> list[int]:
        """The layers that cache keys and values."""
        return [i for i in range(self.n_layers) if not self.is_recurrent(i)]

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a recurrent state: caches cut back only to checkpoints."""
        return any(self.recurrent_layers)

    def kv_bytes_per_token(self, dtype_bytes: float = 4) -> int:
        """Bytes one cached position costs: K and V, every attention layer, every KV head
        (`dtype_bytes` per value: 1.0625 for q8_0's blocks, say)."""
        return math.ceil(sum(2 * self.kv_heads(i) * self.head_size(i) * dtype_bytes for i in self.attention_layers))

    def recurrent_state_bytes(self, conv_dtype_bytes: int = 4) -> int:
        """Bytes of one sequence's recurrent state, all recurrent layers (0 for attention-only
        models): what one checkpoint of a hybrid cache costs, whatever its length."""
        la = self.linear_attention
        return sum(self.recurrent_layers) * la.state_bytes(conv_dtype_bytes) if la is not None else 0

    @property
    def rotary_dims(self) -> int:
        return self.rope_dims or self.head_dim

    @property
    def attention_scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def is_embedding(self) -> bool:
        """The file says it is an embedding model: its pooling gives one vector per input (Qwen3-
        Embedding's converted files say `last`). A generative model's file says nothing."""
        return self.pooling in EMBEDDING_POOLINGS

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ModelConfig:
        md = gguf.metadata
        arch = md.get("general.architecture")
        if arch not in families.FAMILIES:
            raise ModelLoadError(
                f"unsupported architecture '{arch}' in {gguf.path.name}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = families.FAMILIES[arch]

        def key(suffix: str, default: Any = None) -> Any:
            value = md.get(f"{arch}.{suffix}", default)
            if value is None:
                raise ModelLoadError(f"{gguf.path.name} lacks the metadata key {arch}.{suffix}")
            return value

        hidden = int(key("embedding_length"))
        n_heads = _uniform(key("attention.head_count"), "attention.head_count", gguf)
        # Multi-token-prediction blocks (Qwen3.5's `nextn` layers) follow the trunk and are not run.
        n_layers = int(key("block_count")) - int(md.get(f"{arch}.nextn_predict_layers", 0) or 0)
        head_dim = int(md.get(f"{arch}.attention.key_length", hidden // n_heads))
        tensors = gguf.tensors
        vocab = int(md.get(f"{arch}.vocab_size", 0)) or tensors["token_embd.weight"].shape[0]
        window = int(md.get(f"{arch}.attention.sliding_window", 0) or 0)
        n_experts = int(md.get(f"{arch}.expert_count", 0) or 0)
        n_used = int(md.get(f"{arch}.expert_used_count", 0) or 0)
        n_params = sum(t.n_elements for t in tensors.values())
        expert_params = sum(t.n_elements for name, t in tensors.items() if "_exps." in name)
        yarn = None
        if md.get(f"{arch}.rope.scaling.type") == "yarn":
            yarn = YarnScaling(float(key("rope.scaling.factor")), int(key("rope.scaling.original_context_length")),
                               float(md.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                               float(md.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
                               truncate=family.yarn_truncate)
        linear = float(md.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0) \
            if md.get(f"{arch}.rope.scaling.type") == "linear" else 1.0
        rope_dims = int(md.get(f"{arch}.rope.dimension_count", head_dim))
        recurrent = _recurrent_layers(md, arch, n_layers) if family.hybrid else ()
        first = next(i for i in range(n_layers) if not (recurrent and recurrent[i]))  # an attention layer
        blk = f"blk.{first}."
        sliding = _sliding_layers(md, arch, family, n_layers, window)
        per_layer = _PerLayerAttention.read(md, arch, tensors, sliding, head_dim, n_heads, n_layers, gguf)
        _refuse_unsupported(md, arch, gguf)
        return cls(
            architecture=arch,
            name=str(md.get("general.name") or gguf.path.stem),
            n_layers=n_layers,
            hidden_size=hidden,
            n_heads=n_heads,
            n_kv_heads=per_layer.kv_heads[first] if per_layer.kv_heads else
            _uniform(md.get(f"{arch}.attention.head_count_kv", n_heads), "attention.head_count_kv", gguf),
            head_dim=per_layer.head_dims[first] if per_layer.head_dims else head_dim,
            ffn_size=_uniform(key("feed_forward_length", 0 if n_experts else None), "feed_forward_length", gguf),
            vocab_size=vocab,
            context_length=int(key("context_length")),
            rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_style=ROPE_INTERLEAVED if family.rope_interleaved else ROPE_NEOX,
            rms_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            qkv_bias=blk + "attn_q.bias" in tensors,
            qk_norm=blk + "attn_q_norm.weight" in tensors,
            tied_embeddings="output.weight" not in tensors,
            n_params=n_params,
            quant_mix=gguf.quant_mix(),
            family=family.display_name(md),
            rope_dims=rope_dims if rope_dims != head_dim else 0,
            rope_theta_local=float(md.get(f"{arch}.rope.freq_base_swa") or family.local_rope_base or 0) or None,
            rope_yarn=yarn,
            rope_linear_factor=linear,
            has_rope_freqs="rope_freqs.weight" in tensors,
            sliding_window=window if any(sliding) else 0,
            sliding_layers=sliding,
            attn_scale=family.attention_scale(hidden, n_heads, head_dim, n_layers),
            attn_sinks=blk + "attn_sinks.weight" in tensors,
            o_bias=blk + "attn_output.bias" in tensors,
            post_norms=blk + "post_ffw_norm.weight" in tensors,
            embed_scale=hidden ** 0.5 if family.scaled_embedding else 1.0,
            activation=family.activation,
            fused_qkv=blk + "attn_qkv.weight" in tensors,
            fused_gate_up=blk + "ffn_gate.weight" not in tensors and blk + "ffn_up.weight" in tensors,
            n_experts=n_experts,
            n_experts_used=n_used,
            expert_ffn_size=int(md.get(f"{arch}.expert_feed_forward_length", 0) or 0),
            expert_bias=blk + "ffn_gate_inp.bias" in tensors,
            router=family.router,
            recurrent_layers=recurrent,
            linear_attention=_linear_attention(md, arch, gguf) if any(recurrent) else None,
            attn_output_gate=family.attn_output_gate,
            shared_expert_ffn_size=int(md.get(f"{arch}.expert_shared_feed_forward_length", 0) or 0),
            layer_head_dims=per_layer.head_dims,
            layer_kv_heads=per_layer.kv_heads,
            rope_dims_local=int(md.get(f"{arch}.rope.dimension_count_swa", 0) or 0),
            values_from_keys=per_layer.values_from_keys,
            value_norm=family.value_norm,
            layer_output_scale=blk + "layer_output_scale.weight" in tensors,
            final_softcap=float(md.get(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
            moe_dense_ffn=family.moe_dense_ffn and n_experts > 0,
            pooling=_pooling(md.get(f"{arch}.pooling_type")),
            n_active_params=n_params - (expert_params - expert_params * n_used // n_experts if n_experts else 0),
        )


def _listed(value: Any) -> list | None:
    """A per-layer metadata array as a list (the reader gives numeric arrays as NumPy arrays), or
    None for a single value."""
    return [x.item() if isinstance(x, np.generic) else x for x in value] \
        if isinstance(value, list | np.ndarray) else None


def _pooling(value: Any) -> str | None:
    """`<arch>.pooling_type` by name (None where the file has no such key)."""
    if value is None:
        return None
    n = int(value)
    return POOLING_TYPES[n] if 0 <= n < len(POOLING_TYPES) else f"unknown ({n})"


def _uniform(value: Any, name: str, gguf: GGUFFile) -> int:
    """A per-layer array that must hold one value (or that value itself)."""
    if (listed := _listed(value)) is not None:
        value = listed
        if len(set(value)) != 1:
            raise ModelLoadError(f"{gguf.path.name}: per-layer {name} {value} differs between layers, "
                                 "which lmserve does not support for this architecture")
        value = value[0]
    return int(value)


def _recurrent_layers(md: dict[str, Any], arch: str, n_layers: int) -> tuple[bool, ...]:
    """Which layers are Gated DeltaNet: the file's own list, else every layer but each
    `full_attention_interval`-th (llama.cpp's rule)."""
    listed = md.get(f"{arch}.attention.recurrent_layers")
    if listed is not None:
        return tuple(bool(x) for x in list(listed)[:n_layers])
    interval = int(md.get(f"{arch}.full_attention_interval", 4) or 4)
    return tuple((i + 1) % interval != 0 for i in range(n_layers))


def _linear_attention(md: dict[str, Any], arch: str, gguf: GGUFFile) -> LinearAttention:
    def ssm(name: str) -> int:
        value = md.get(f"{arch}.ssm.{name}")
        if value is None:
            raise ModelLoadError(f"{gguf.path.name} lacks the metadata key {arch}.ssm.{name}")
        return int(value)

    v_heads = ssm("time_step_rank")
    return LinearAttention(conv_kernel=ssm("conv_kernel"), k_heads=ssm("group_count"), v_heads=v_heads,
                           head_k_dim=ssm("state_size"), head_v_dim=ssm("inner_size") // v_heads)


def _sliding_layers(md: dict[str, Any], arch: str, family: families.Family, n_layers: int,
                    window: int) -> tuple[bool, ...]:
    """Per layer, whether it attends to the sliding window only: the file's own pattern (Gemma 4's
    `attention.sliding_window_pattern`), else the family's (llama.cpp hard-codes Gemma 3's)."""
    if not window:
        return (False,) * n_layers
    listed = _listed(md.get(f"{arch}.attention.sliding_window_pattern"))
    if listed is not None:
        return tuple(bool(x) for x in listed[:n_layers])
    return tuple(family.sliding(i) for i in range(n_layers)) if family.sliding_pattern else (False,) * n_layers


@dataclass(frozen=True)
class _PerLayerAttention:
    """Gemma 4's per-layer attention shapes (empty tuples where every layer is alike)."""

    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    values_from_keys: tuple[bool, ...]

    @classmethod
    def read(cls, md: dict[str, Any], arch: str, tensors: dict, sliding: tuple[bool, ...], head_dim: int,
             n_heads: int, n_layers: int, gguf: GGUFFile) -> _PerLayerAttention:
        swa_dim = md.get(f"{arch}.attention.key_length_swa")
        head_dims = tuple(int(swa_dim) if s else head_dim for s in sliding) if swa_dim is not None else ()
        kv = _listed(md.get(f"{arch}.attention.head_count_kv", n_heads))
        kv_heads = tuple(int(x) for x in kv[:n_layers]) if kv is not None and len(set(kv)) > 1 else ()
        no_v = tuple(f"blk.{i}.attn_v.weight" not in tensors and f"blk.{i}.attn_k.weight" in tensors
                     for i in range(n_layers))
        return cls(head_dims if len(set(head_dims)) > 1 else (), kv_heads, no_v if any(no_v) else ())


def _refuse_unsupported(md: dict[str, Any], arch: str, gguf: GGUFFile) -> None:
    """Features of the family that no engine here computes: refused by name, never run wrong."""
    if int(md.get(f"{arch}.attention.shared_kv_layers", 0) or 0):
        raise ModelLoadError(f"{gguf.path.name}: layers that share another layer's KV (Gemma 4 E2B / E4B) "
                             "are not supported yet")
    if int(md.get(f"{arch}.embedding_length_per_layer_input", 0) or 0):
        raise ModelLoadError(f"{gguf.path.name}: per-layer input embeddings (Gemma 4 E2B / E4B) "
                             "are not supported yet")
