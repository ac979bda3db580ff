"""GGUF metadata -> one normalized model configuration shared by every engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmserve.model.gguf_file import GGUFFile, ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# How rotary embeddings pair dimensions. GGUF stores llama-family Q/K rows permuted so that
# ggml's "normal" rope (adjacent pairs) reproduces Hugging Face's rotate-half; qwen uses NeoX.
ROPE_INTERLEAVED = "interleaved"
ROPE_NEOX = "neox"


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

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes one cached position costs: K and V, every layer, every KV head."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ModelConfig:
        md = gguf.metadata
        arch = md.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture '{arch}' in {gguf.path.name}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def key(suffix: str, default: Any = None) -> Any:
            value = md.get(f"{arch}.{suffix}", default)
            if value is None:
                raise ModelLoadError(f"{gguf.path.name} lacks the metadata key {arch}.{suffix}")
            return value

        hidden = int(key("embedding_length"))
        n_heads = int(key("attention.head_count"))
        head_dim = int(md.get(f"{arch}.attention.key_length", hidden // n_heads))
        tensors = gguf.tensors
        vocab = int(md.get(f"{arch}.vocab_size", 0)) or tensors["token_embd.weight"].shape[0]
        return cls(
            architecture=arch,
            name=str(md.get("general.name") or gguf.path.stem),
            n_layers=int(key("block_count")),
            hidden_size=hidden,
            n_heads=n_heads,
            n_kv_heads=int(md.get(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            ffn_size=int(key("feed_forward_length")),
            vocab_size=vocab,
            context_length=int(key("context_length")),
            rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_style=ROPE_INTERLEAVED if arch == "llama" else ROPE_NEOX,
            rms_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            qkv_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            tied_embeddings="output.weight" not in tensors,
            n_params=sum(t.n_elements for t in tensors.values()),
            quant_mix=gguf.quant_mix(),
        )
