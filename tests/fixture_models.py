"""Tiny random-weight Qwen2 and Qwen3 GGUFs, written the way llama.cpp's converter writes them.

The shared fixtures hold only a llama-architecture model; these cover the other two supported
architectures (Qwen2's QKV biases, Qwen3's per-head q/k RMSNorm and a head size unrelated to the
hidden size) and carry a small byte-level BPE tokenizer with Qwen's special tokens, so engine,
tokenizer and template tests can run without downloading a model.

Run as a module from the repository root to write the files: `python -m tests.fixture_models OUT_DIR`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import MODEL_TENSOR, TENSOR_NAMES, GGUFWriter, LlamaFileType, TokenType

from tests.conftest import TEMPLATES

QWEN3_TEMPLATE = TEMPLATES / "qwen3.jinja"
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MERGES = ["Ġ t", "h e", "i n", "Ġ a", "e r", "Ġt he", "o n", "r e", "Ġ s", "o r"]
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
    "<think>", "</think>", "<tool_response>", "</tool_response>",
]
# Random normal weights times these keep attention relevant and logits spread (top token at
# about 10% probability). Output heads are separate: with random tied embeddings a 2-layer
# model only predicts its input token back (SmolLM2 covers tied embeddings).
WEIGHT_SCALE = 0.05
EMBED_SCALE = 0.2
OUTPUT_SCALE = 0.2


@dataclass(frozen=True)
class Shape:
    """The dimensions of one fixture architecture."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int
    qkv_bias: bool
    qk_norm: bool


SHAPES = {
    # Qwen2: biases on Q/K/V.
    "qwen2": Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, layers=2, qkv_bias=True, qk_norm=False),
    # Qwen3: q/k norms, and heads * head_dim (128) != hidden (64), as in Qwen3-0.6B.
    "qwen3": Shape(hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=128, layers=2, qkv_bias=False, qk_norm=True),
}
CONTEXT_LENGTH = 4096
ROPE_THETA = 1_000_000.0
RMS_EPS = 1e-6


def byte_level_alphabet() -> list[str]:
    """GPT-2's 256 byte-level characters in its vocabulary order (printable bytes first)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return [chars[b] for b in [*printable, *extra]]


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens and their types: bytes, merge results, then the control tokens."""
    tokens = byte_level_alphabet() + [merge.replace(" ", "") for merge in MERGES] + SPECIAL_TOKENS
    types = [TokenType.NORMAL] * (len(tokens) - len(SPECIAL_TOKENS)) + [TokenType.CONTROL] * len(SPECIAL_TOKENS)
    return tokens, [int(t) for t in types]


def _name(kind: MODEL_TENSOR, block: int | None = None, suffix: str = "weight") -> str:
    return f"{TENSOR_NAMES[kind].format(bid=block)}.{suffix}"


def _tensors(shape: Shape, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights under llama.cpp's tensor names, NumPy order `[out, in]`."""

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * WEIGHT_SCALE).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return np.ones(size, dtype=np.float32)

    s = shape
    q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = {_name(MODEL_TENSOR.TOKEN_EMBD): (rng.standard_normal((vocab, s.hidden)) * EMBED_SCALE).astype(np.float32)}
    for i in range(s.layers):
        out[_name(MODEL_TENSOR.ATTN_NORM, i)] = norm(s.hidden)
        for kind, rows in ((MODEL_TENSOR.ATTN_Q, q_rows), (MODEL_TENSOR.ATTN_K, kv_rows),
                           (MODEL_TENSOR.ATTN_V, kv_rows)):
            out[_name(kind, i)] = matrix(rows, s.hidden)
            if s.qkv_bias:
                out[_name(kind, i, "bias")] = (rng.standard_normal(rows) * WEIGHT_SCALE).astype(np.float32)
        if s.qk_norm:
            # Not all ones, so that a loader which ignored them would be caught.
            out[_name(MODEL_TENSOR.ATTN_Q_NORM, i)] = (1 + 0.2 * rng.standard_normal(s.head_dim)).astype(np.float32)
            out[_name(MODEL_TENSOR.ATTN_K_NORM, i)] = (1 + 0.2 * rng.standard_normal(s.head_dim)).astype(np.float32)
        out[_name(MODEL_TENSOR.ATTN_OUT, i)] = matrix(s.hidden, q_rows)
        out[_name(MODEL_TENSOR.FFN_NORM, i)] = norm(s.hidden)
        out[_name(MODEL_TENSOR.FFN_GATE, i)] = matrix(s.ffn, s.hidden)
        out[_name(MODEL_TENSOR.FFN_UP, i)] = matrix(s.ffn, s.hidden)
        out[_name(MODEL_TENSOR.FFN_DOWN, i)] = matrix(s.hidden, s.ffn)
    out[_name(MODEL_TENSOR.OUTPUT_NORM)] = norm(s.hidden)
    out[_name(MODEL_TENSOR.OUTPUT)] = (rng.standard_normal((vocab, s.hidden)) * OUTPUT_SCALE).astype(np.float32)
    return out


def write_model(path: Path, arch: str, dtype: str = "F32", seed: int = 0, shape: Shape | None = None) -> Path:
    """Write one fixture. `dtype` "F16" stores matrices as F16 (vectors stay F32, as llama.cpp does);
    `shape`: other dimensions than the architecture's fixture (scripts/bench_hybrid.py)."""
    shape = shape or SHAPES[arch]
    tokens, types = vocabulary()
    writer = GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}-fixture")
    writer.add_file_type(LlamaFileType.MOSTLY_F16 if dtype == "F16" else LlamaFileType.ALL_F32)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    if shape.head_dim != shape.hidden // shape.heads:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(QWEN3_TEMPLATE.read_text() if arch == "qwen3" else CHATML_TEMPLATE)
    for name, tensor in _tensors(shape, len(tokens), np.random.default_rng(seed)).items():
        writer.add_tensor(name, tensor.astype(np.float16) if dtype == "F16" and tensor.ndim == 2 else tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_all(directory: Path) -> dict[str, Path]:
    """Every fixture, keyed like "qwen3-F16"."""
    directory.mkdir(parents=True, exist_ok=True)
    return {f"{arch}-{dtype}": write_model(directory / f"tiny-{arch}-{dtype}.gguf", arch, dtype)
            for arch in SHAPES for dtype in ("F32", "F16")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    for path in write_all(parser.parse_args().out_dir).values():
        print(path)


if __name__ == "__main__":
    main()
