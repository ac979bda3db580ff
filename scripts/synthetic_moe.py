"""Write a Qwen3-MoE GGUF of random weights a few hundred MB large, for benchmarks.

The tests' qwen3moe fixture (made by llama.cpp from a transformers model) is 4 experts of 256 in
two layers: too small to time a step. This keeps its metadata (tokenizer, chat template) and
writes the same architecture scaled up, in Q4_K_M's mix of types (Q4_K, with Q6_K for V, the
experts' down projection and the output head), with random quants and small scales: llama-server
and lmserve both load it, and the replies are noise of the right cost.

    python scripts/synthetic_moe.py OUT.gguf [--layers 12] [--hidden 1024] [--experts 32] [--used 4]
                                             [--expert-ffn 512]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

Q = GGMLQuantizationType
FIXTURE = Path(__file__).resolve().parents[1] / "tests/data/fixtures/arch/qwen3moe/tiny-qwen3moe-Q4_K_M.gguf"
HEAD_DIM, HEADS, KV_HEADS = 64, 16, 4
# Byte offsets of each type's float16 scales, set small so that activations stay finite.
SCALES = {Q.Q4_K: ((0, 0.0005), (2, 0.0002)), Q.Q6_K: ((208, 0.0005),)}


def random_blocks(rows: int, columns: int, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * columns // block, size), dtype=np.uint8)
    for start, value in SCALES[qtype]:
        raw[:, start:start + 2] = np.array([value], np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write(out: Path, layers: int, hidden: int, experts: int, used: int, expert_ffn: int, seed: int = 0) -> None:
    fixture = GGUFReader(FIXTURE)
    arch = "qwen3moe"
    sizes = {"block_count": layers, "embedding_length": hidden, "feed_forward_length": expert_ffn,
             "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS, "expert_count": experts,
             "expert_used_count": used, "attention.key_length": HEAD_DIM, "attention.value_length": HEAD_DIM,
             "expert_feed_forward_length": expert_ffn, "context_length": 32768}
    writer = GGUFWriter(out, arch)
    for field in fixture.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture" or name.removeprefix(f"{arch}.") in sizes:
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    for key, value in sizes.items():
        writer.add_uint32(f"{arch}.{key}", value)
    vocab = len(fixture.fields["tokenizer.ggml.tokens"].data)
    q_rows, kv_rows = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes: dict[str, tuple[tuple[int, ...], GGMLQuantizationType]] = {
        "token_embd.weight": ((vocab, hidden), Q.Q4_K), "output_norm.weight": ((hidden,), Q.F32),
        "output.weight": ((vocab, hidden), Q.Q6_K)}
    for i in range(layers):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": ((hidden,), Q.F32), b + "ffn_norm.weight": ((hidden,), Q.F32),
                   b + "attn_q_norm.weight": ((HEAD_DIM,), Q.F32), b + "attn_k_norm.weight": ((HEAD_DIM,), Q.F32),
                   b + "attn_q.weight": ((q_rows, hidden), Q.Q4_K), b + "attn_k.weight": ((kv_rows, hidden), Q.Q4_K),
                   b + "attn_v.weight": ((kv_rows, hidden), Q.Q6_K), b + "attn_output.weight": ((hidden, q_rows), Q.Q4_K),
                   b + "ffn_gate_inp.weight": ((experts, hidden), Q.F32),
                   b + "ffn_gate_exps.weight": ((experts, expert_ffn, hidden), Q.Q4_K),
                   b + "ffn_up_exps.weight": ((experts, expert_ffn, hidden), Q.Q4_K),
                   b + "ffn_down_exps.weight": ((experts, hidden, expert_ffn), Q.Q6_K)}
    for name, (shape, qtype) in shapes.items():
        if qtype == Q.F32:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, (shape, qtype) in shapes.items():
        if qtype != Q.F32:
            data = random_blocks(int(np.prod(shape[:-1])), shape[-1], qtype, rng)
        elif "ffn_gate_inp" in name:  # router logits of either sign: every expert gets chosen
            data = rng.standard_normal(shape).astype(np.float32) * 0.05
        else:
            data = np.ones(shape, np.float32)
        writer.write_tensor_data(data)
    writer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--used", type=int, default=4)
    p.add_argument("--expert-ffn", type=int, default=512)
    a = p.parse_args()
    partial = a.out.with_suffix(".partial")
    write(partial, a.layers, a.hidden, a.experts, a.used, a.expert_ffn)
    partial.rename(a.out)
    print(f"{a.out}: {a.out.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
