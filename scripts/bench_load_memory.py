"""Peak resident memory of loading a model, against the size of its file.

Writes a llama-shaped GGUF of random quantized weights (1-2 GB at the default shape) into a
temporary directory, then loads it in a fresh Python per engine and reports the peak RSS over the
file size: both the whole process's peak and what loading added to the peak of the interpreter
with its imports. The peak is the kernel's VmHWM of the child: on Linux `ru_maxrss` carries the
parent's high-water mark across fork and exec, which here (the parent wrote the file) can exceed
the child's own. A model whose every tensor MLX reads natively (Q8_0,
Q4_0) takes `mx.load`; a K-quant file is converted (cold, writing the weight cache) and then
loaded from that cache (warm). Fixture files can be measured too (`--file`).

    python scripts/bench_load_memory.py [--quant Q8_0|Q4_0|Q4_K] [--layers 22] [--engine mlx cpu]
                                        [--mlx-dtype float16] [--file GGUF ...] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_quant_blocks import HALF_FIELDS  # noqa: E402  (each type's float16 fields)

Q = GGMLQuantizationType
CHILD = """
import json, sys, time
from pathlib import Path

def status(key):  # bytes; VmHWM: this process image's own peak (ru_maxrss inherits the parent's)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

engine_name, path, cache, dtype = sys.argv[1:5]
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile
if engine_name == "mlx":
    import mlx.core as mx
    from lmserve.engine_mlx import MLXEngine as Engine
    from lmserve.engine_mlx import engine as engine_module
    if dtype != "auto":  # what a GPU would choose (float16 scales), on this machine's backend
        engine_module.compute_dtype = lambda gguf: getattr(mx, dtype)
    kwargs = {"cache_dir": Path(cache)}
else:
    from lmserve.engine_cpu import CPUEngine as Engine
    kwargs = {}
gguf = GGUFFile(path)
config = ModelConfig.from_gguf(gguf)
before = status("VmHWM")
start = time.perf_counter()
engine = Engine(gguf, config, **kwargs)
seconds = time.perf_counter() - start
peak, now = status("VmHWM"), status("VmRSS")
source = getattr(engine, "weights_from", engine.device)
print(json.dumps({"before": before, "peak": peak, "after": now, "seconds": seconds,
                  "weights": engine.weight_bytes, "source": source}))
"""

# Types a synthetic file can be written in (the NumPy engine keeps each in its own encoding).
QUANTS = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "MXFP4", "F16", "BF16"]
# A TinyLlama-1.1B-shaped model: 22 layers, 1.1 B parameters.
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 2048, 5632, 32, 4, 32000


def random_blocks(rows: int, cols: int, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Stored bytes of a `rows x cols` matrix of `qtype` with random quants, and float16 scale
    fields small and finite as a real file's (the NumPy engine keeps the legacy types' scales as
    float16, refusing any that would not be exact)."""
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for start in HALF_FIELDS.get(qtype, ()):
        halves = rng.uniform(-0.05, 0.05, size=len(blocks)).astype(np.float16)
        blocks[:, start:start + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_model(path: Path, qtype: GGMLQuantizationType, layers: int, seed: int = 0) -> None:
    """Streamed one tensor at a time, so the writer never holds the model."""
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                   f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
                   f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
                   f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN), f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
                   f"blk.{i}.ffn_up.weight": (FFN, HIDDEN), f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)}
    shapes |= {"output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN)}
    writer = GGUFWriter(path, "llama")
    for key, value in (("block_count", layers), ("context_length", 2048), ("embedding_length", HIDDEN),
                       ("feed_forward_length", FFN), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("vocab_size", VOCAB)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            byte_shape = (shape[0], shape[1] // block * size)  # what the writer expects of raw blocks
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for shape in shapes.values():
        data = np.ones(shape, np.float32) if len(shape) == 1 else random_blocks(*shape, qtype, rng)
        writer.write_tensor_data(data)
    writer.close()


def measure(engine: str, path: Path, cache: Path, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, engine, str(path), str(cache), dtype], check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    return json.loads(out.stdout.splitlines()[-1])


def report(label: str, size: int, m: dict) -> None:
    mb = 1 << 20
    print(f"{label:<40} file {size / mb:7.1f} MiB  peak {m['peak'] / mb:7.1f} MiB "
          f"(imports {m['before'] / mb:5.1f})  peak/file {m['peak'] / size:5.2f}  "
          f"added/file {(m['peak'] - m['before']) / size:5.2f}  weights/file {m['weights'] / size:5.2f}  held after {m['after'] / mb:7.1f} MiB  "
          f"{m['seconds']:5.1f} s  [{m['source'][:60]}]", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", choices=QUANTS, nargs="*", default=["Q8_0", "Q4_K"])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--engine", choices=["mlx", "cpu"], nargs="+", default=["mlx"])
    parser.add_argument("--file", type=Path, nargs="*", default=[], help="also measure these GGUF files")
    parser.add_argument("--mlx-dtype", default="auto", choices=["auto", "float16", "float32"],
                        help="the MLX engine's compute dtype (auto: the device's; float16 is a GPU's)")
    parser.add_argument("--keep", type=Path, help="write the synthetic files here and keep them")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.keep or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        files = list(args.file)
        for quant in args.quant:
            path = directory / f"synthetic-llama-{args.layers}L-{quant}.gguf"
            if not path.exists():  # written under another name first: a kept file is always whole
                partial = path.with_suffix(".partial")
                write_model(partial, Q[quant], args.layers)
                partial.rename(path)
            files.append(path)
        for path in files:
            size = path.stat().st_size
            for engine in args.engine:
                cache = Path(tmp) / f"cache-{path.stem}"
                label = f"{path.name} {engine}" + (f" {args.mlx_dtype}" if engine == "mlx" else "")
                report(label, size, measure(engine, path, cache, args.mlx_dtype))
                if engine == "mlx" and any(p.exists() for p in cache.rglob("*.safetensors")):
                    report(f"{label} (warm)", size, measure(engine, path, cache, args.mlx_dtype))


if __name__ == "__main__":
    main()
