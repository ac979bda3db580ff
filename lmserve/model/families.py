"""What each supported model family is, beyond what its GGUF metadata says.

llama.cpp hard-codes a few facts per architecture that files do not carry (Gemma 3's one global
layer in six, gpt-oss's alternating sliding layers, its clamped SwiGLU and router); they live here,
next to each family's human name and its recommended sampling settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

SILU = "silu"  # SwiGLU: silu(gate) * up
GELU_TANH = "gelu_tanh"  # GeGLU with the tanh approximation (Gemma)
SWIGLU_OAI = "swiglu_oai"  # gpt-oss: clamped gate * sigmoid(1.702 gate) * (up + 1)

ROUTE_SOFTMAX_TOPK = "softmax_topk"  # softmax over all experts, keep the top k, renormalize (Qwen3 MoE)
ROUTE_TOPK_SOFTMAX = "topk_softmax"  # keep the top k logits, softmax over those (gpt-oss)
# Gemma 4: the router reads its input RMS-normalized and scaled per channel (`ffn_gate_inp.scale`),
# keeps the top k logits, softmaxes them and scales each by its expert's own weight.
ROUTE_GEMMA4 = "gemma4"


@dataclass(frozen=True)
class RecommendedSampling:
    """A model's recommended sampling settings; None: the API's own default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    source: str = ""

    def values(self) -> dict[str, float | int]:
        """The recommended fields, by SamplingParams' names."""
        return {name: value for name, value in (
            ("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k),
            ("min_p", self.min_p), ("repeat_penalty", self.repeat_penalty)) if value is not None}

    def with_temperature(self, temperature: float) -> RecommendedSampling:
        """The server's `--temp` in place of the recommended temperature (other fields kept)."""
        source = f"{self.source}; temperature from --temp" if self.source else "--temp"
        return replace(self, temperature=temperature, source=source)

    def describe(self) -> str:
        parts = [f"{name} {value:g}" for name, value in self.values().items()]
        return (", ".join(parts) or "the API defaults") + (f" ({self.source})" if self.source else "")


@dataclass(frozen=True)
class Family:
    architecture: str
    name: str
    rope_interleaved: bool = False  # llama: GGUF permutes Q/K rows for adjacent-pair RoPE
    sliding_pattern: int = 0  # every n-th layer is global, the others slide (0: none slide)
    activation: str = SILU
    router: str = ROUTE_SOFTMAX_TOPK
    scaled_embedding: bool = False
    local_rope_base: float | None = None  # the sliding layers' RoPE base when the file does not say
    yarn_truncate: bool = True  # gpt-oss's config (and OpenAI's code) leave YaRN's range unrounded
    hybrid: bool = False  # Qwen3.5: Gated DeltaNet layers beside full attention (config.recurrent_layers)
    attn_output_gate: bool = False  # Qwen3.5: attention output times sigmoid(a gate q_proj emits)
    value_norm: bool = False  # Gemma 4: values RMS-normalized (no weight)
    moe_dense_ffn: bool = False  # Gemma 4: a MoE layer runs a dense FFN beside its experts
    fixed_scale: float = 0.0  # the attention scale, when the family fixes it (Gemma 4: 1, its q/k norms scale)
    # (substring of the model's name, lower case) -> its recommendation; the first match wins,
    # "" matches every model of the family.
    sampling: tuple[tuple[str, RecommendedSampling], ...] = field(default=())
    scale: Callable[[int, int, int, int], float] | None = None

    def sliding(self, layer: int) -> bool:
        return bool(self.sliding_pattern) and (layer + 1) % self.sliding_pattern != 0

    def attention_scale(self, hidden: int, heads: int, head_dim: int, layers: int) -> float:
        if self.fixed_scale:
            return self.fixed_scale
        return self.scale(hidden, heads, head_dim, layers) if self.scale else 0.0

    def display_name(self, metadata: dict[str, Any]) -> str:
        name = str(metadata.get("general.basename") or metadata.get("general.name") or "").lower()
        if self.architecture == "llama":
            for marker, label in (("mistral", "Mistral"), ("devstral", "Devstral"), ("smollm", "SmolLM")):
                if marker in name:
                    return label
        return self.name

    def recommended_sampling(self, model_name: str) -> RecommendedSampling:
        name = model_name.lower()
        return next((s for marker, s in self.sampling if marker in name), RecommendedSampling())


def _gemma3_scale(hidden: int, heads: int, head_dim: int, layers: int) -> float:
    """Gemma 3 27B (62 layers) scales queries by hidden/heads, the others by head_dim (as llama.cpp)."""
    return (hidden / heads if layers == 62 else head_dim) ** -0.5


QWEN3_THINKING = RecommendedSampling(0.6, 0.95, 20, 0.0, source="Qwen3 model card, thinking mode")
# The Qwen3.5 / 3.6 model cards' thinking mode for precise coding tasks (the general-task rows add a
# presence penalty of 1.5, which recommended defaults here do not carry).
QWEN35_THINKING = RecommendedSampling(0.6, 0.95, 20, 0.0, source="Qwen3.5 model card, thinking mode for coding")
# The embedded SmolLM2-135M answers a first question best at its most likely tokens: sampled as its
# card says (0.2 / 0.9), "What is the capital of France?" went wrong in 2 of 5 fresh tries.
EMBEDDED_DEMO = RecommendedSampling(0.0, source="greedy: the embedded demo model answers best so")
QWEN_CODER = RecommendedSampling(0.7, 0.8, 20, None, 1.05, source="Qwen3-Coder / Qwen2.5 generation_config.json")

FAMILIES: dict[str, Family] = {f.architecture: f for f in (
    Family("llama", "Llama", rope_interleaved=True, sampling=(
        ("smollm", RecommendedSampling(0.2, 0.9, source="SmolLM2 model card")),
        ("devstral", RecommendedSampling(0.15, source="Devstral model card")),
        ("mistral", RecommendedSampling(0.15, source="Mistral Small 3.x model card")),
        ("llama", RecommendedSampling(0.6, 0.9, source="Llama 3.x generation_config.json")),
    )),
    Family("qwen2", "Qwen2", sampling=(
        ("", RecommendedSampling(0.7, 0.8, 20, None, 1.05, source="Qwen2.5 generation_config.json")),)),
    Family("qwen3", "Qwen3", sampling=(("coder", QWEN_CODER), ("", QWEN3_THINKING))),
    Family("qwen3moe", "Qwen3 MoE", sampling=(("coder", QWEN_CODER), ("", QWEN3_THINKING))),
    Family("gemma3", "Gemma 3", sliding_pattern=6, activation=GELU_TANH, scaled_embedding=True,
           local_rope_base=10000.0,  # older Gemma 3 files lack rope.freq_base_swa; llama.cpp's value
           scale=_gemma3_scale, sampling=(
               ("", RecommendedSampling(1.0, 0.95, 64, 0.0, source="Gemma 3 recommended settings")),)),
    Family("phi3", "Phi-3"),
    Family("qwen35", "Qwen3.5", hybrid=True, attn_output_gate=True, sampling=(("", QWEN35_THINKING),)),
    Family("qwen35moe", "Qwen3.5 MoE", hybrid=True, attn_output_gate=True, sampling=(("", QWEN35_THINKING),)),
    Family("gemma4", "Gemma 4", activation=GELU_TANH, scaled_embedding=True, router=ROUTE_GEMMA4,
           value_norm=True, moe_dense_ffn=True, fixed_scale=1.0, sampling=(
               ("", RecommendedSampling(1.0, 0.95, 64, source="Gemma 4 model card")),)),
    Family("gpt-oss", "gpt-oss", sliding_pattern=2, activation=SWIGLU_OAI, router=ROUTE_TOPK_SOFTMAX,
           yarn_truncate=False,
           sampling=(("", RecommendedSampling(1.0, 1.0, source="OpenAI gpt-oss model card")),)),
)}

GGUF_SAMPLING_KEYS = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
                      "top_k": "general.sampling.top_k", "min_p": "general.sampling.min_p",
                      "repeat_penalty": "general.sampling.penalty_repeat"}


def recommended_sampling(architecture: str, metadata: dict[str, Any]) -> RecommendedSampling:
    """The file's own `general.sampling.*` keys when it has any, else the family's table."""
    found = {field_: metadata[key] for field_, key in GGUF_SAMPLING_KEYS.items() if key in metadata}
    if found:
        return RecommendedSampling(**{k: (int(v) if k == "top_k" else float(v)) for k, v in found.items()},
                        source="the GGUF's general.sampling keys")
    family = FAMILIES.get(architecture)
    name = str(metadata.get("general.name") or metadata.get("general.basename") or "")
    return family.recommended_sampling(name) if family else RecommendedSampling()


# How each engine computes a weight of each GGUF type (see docs/MODELS.md). The engines hold the
# authoritative sets (engine_cpu.encodings.encoding_of, engine_mlx.weights.NATIVE_TYPES); a test
# keeps these names equal to them, so `--help` can say it without importing either engine.
CPU_KEPT_TYPES = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                  "IQ4_NL", "IQ4_XS", "MXFP4")
MLX_NATIVE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "MXFP4")


def support_summary() -> str:
    """The families and quant types served, for `--help`."""
    names = ", ".join(f"{f.name} ({f.architecture})" for f in FAMILIES.values())
    return (f"families: {names}.\n"
            f"weights: MLX loads {', '.join(MLX_NATIVE_TYPES)} natively and re-quantizes other types "
            f"once (cached); the NumPy engine computes {', '.join(CPU_KEPT_TYPES)} matrices (MoE experts "
            f"too) in their own values (4-bit types as packed nibbles) and holds other types and norms as float32.\n"
            f"speculation (ngram) is on by default where verifying is cheap, off on MLX's CPU backend.")
