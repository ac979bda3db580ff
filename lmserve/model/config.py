"""GGUF metadata -> one normalized model configuration shared by every engine.

Everything an engine needs to know about a family's shape is read here once, from the GGUF
keys and tensor table, so the engines never look at metadata themselves. Where llama.cpp hard-codes
a family fact the file does not carry (Gemma 3's sliding-window pattern, gpt-oss's alternating
layers and its SwiGLU clamp), `model/families.py` holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmserve.model import families
from lmserve.model.gguf_file import GGUFFile, ModelLoadError

SUPPORTED_ARCHITECTURES = tuple(families.FAMILIES)

# How rotary embeddings pair dimensions. GGUF stores llama-family Q/K rows permuted so that
# ggml's "normal" rope (adjacent pairs) reproduces Hugging Face's rotate-half; the others use NeoX.
ROPE_INTERLEAVED = "interleaved"
ROPE_NEOX = "neox"


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

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes one cached position costs: K and V, every layer, every KV head."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes

    @property
    def rotary_dims(self) -> int:
        return self.rope_dims or self.head_dim

    @property
    def attention_scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

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
        n_heads = int(key("attention.head_count"))
        n_layers = int(key("block_count"))
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
        return cls(
            architecture=arch,
            name=str(md.get("general.name") or gguf.path.stem),
            n_layers=n_layers,
            hidden_size=hidden,
            n_heads=n_heads,
            n_kv_heads=int(md.get(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            ffn_size=int(key("feed_forward_length")),
            vocab_size=vocab,
            context_length=int(key("context_length")),
            rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_style=ROPE_INTERLEAVED if family.rope_interleaved else ROPE_NEOX,
            rms_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            qkv_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            tied_embeddings="output.weight" not in tensors,
            n_params=n_params,
            quant_mix=gguf.quant_mix(),
            family=family.display_name(md),
            rope_dims=rope_dims if rope_dims != head_dim else 0,
            rope_theta_local=float(md.get(f"{arch}.rope.freq_base_swa") or family.local_rope_base or 0) or None,
            rope_yarn=yarn,
            rope_linear_factor=linear,
            has_rope_freqs="rope_freqs.weight" in tensors,
            sliding_window=window if family.sliding_pattern else 0,
            sliding_layers=tuple(family.sliding(i) for i in range(n_layers)) if window else (False,) * n_layers,
            attn_scale=family.attention_scale(hidden, n_heads, head_dim, n_layers),
            attn_sinks="blk.0.attn_sinks.weight" in tensors,
            o_bias="blk.0.attn_output.bias" in tensors,
            post_norms="blk.0.post_ffw_norm.weight" in tensors,
            embed_scale=hidden ** 0.5 if family.scaled_embedding else 1.0,
            activation=family.activation,
            fused_qkv="blk.0.attn_qkv.weight" in tensors,
            fused_gate_up="blk.0.ffn_gate.weight" not in tensors and "blk.0.ffn_up.weight" in tensors,
            n_experts=n_experts,
            n_experts_used=n_used,
            expert_ffn_size=int(md.get(f"{arch}.expert_feed_forward_length", 0) or 0),
            expert_bias="blk.0.ffn_gate_inp.bias" in tensors,
            router=family.router,
            n_active_params=n_params - (expert_params - expert_params * n_used // n_experts if n_experts else 0),
        )
