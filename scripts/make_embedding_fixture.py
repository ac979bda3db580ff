"""Make tests/data/fixtures/embedding: a tiny random-weight Qwen3 embedding model, by llama.cpp itself.

The model is made as Qwen3-Embedding ships: a transformers `Qwen3Model` (no output head) with a
small config in Qwen3-Embedding-0.6B's shape (hidden 64, 2 layers, 4 query heads of 32 over 2 KV
heads, so heads x head_dim is twice the hidden size as there; tied embeddings), seeded random
weights rounded to float16 values (so the F16 file holds exactly the model the reference runs), a
512-token Qwen byte-level BPE (scripts/fixtures/toy_tokenizer.py) with Qwen3's chat template, and
sentence-transformers' metadata beside it: modules.json naming 1_Pooling, whose config.json says
`pooling_mode_lasttoken`, then a Normalize module. llama.cpp's own convert_hf_to_gguf.py reads
that into `qwen3.pooling_type` = 3 (last) and writes the F16 file; llama-quantize makes Q8_0.

`references.json` records, for a few fixed token-id lists (each ending in <|endoftext|>, which
Qwen3-Embedding's tokenizer appends):
- `transformers`: the float32 model's final hidden state (after the final norm) at the last
  position, L2-normalized, per list, and every position's hidden state of the longest list;
- `llama_server`: llama.cpp's llama-server `/v1/embeddings` on each file (`--embedding --pooling
  last`; it L2-normalizes), the token ids POSTed as `input`, with the prompt_tokens it counted.

    PYTHON scripts/make_embedding_fixture.py [--llama-dir DIR] [--out DIR] [--work DIR]

PYTHON is the venv with torch that scripts/make_arch_fixtures.py's docstring describes
(torch 2.13.0, transformers 5.24.0, numpy, sentencepiece, tokenizers, safetensors, protobuf).
`--llama-dir` is the output of shared/tools/build-llama-server.sh (default ~/.cache/lmserve-peers):
bin/llama-server, bin/llama-quantize, lib/, and src/ with the matching convert_hf_to_gguf.py,
gguf-py, conversion/ and models/templates. A few seconds on 2 cores; everything is seeded, so the
same llama.cpp and transformers give the same files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixtures import toy_tokenizer  # noqa: E402
from fixtures.families import TOKEN_IDS  # noqa: E402
from make_arch_fixtures import run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STEM = "tiny-qwen3-embedding"
SEED = 3
TEMPLATE = "Qwen-Qwen3-0.6B.jinja"  # Qwen3-Embedding's tokenizer carries Qwen3's chat template

# Qwen3's added tokens, in its order (ids 0..8 here); <think> and its kin are not special.
ADDED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>",
         "<tool_response>", "</tool_response>")
PLAIN = {"<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"}
END = ADDED.index("<|endoftext|>")  # what Qwen3-Embedding's tokenizer appends to every input

CONFIG = {
    "vocab_size": toy_tokenizer.VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 192,  # 3x hidden, as 0.6B's 3072 over 1024
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "tie_word_embeddings": True,
    "attention_bias": False,
    "eos_token_id": ADDED.index("<|im_end|>"),
    "pad_token_id": END,
}
TEXTS = ("What is the capital of France?", "The capital of France is Paris, a city on the Seine.")

MODULES = [  # sentence-transformers' modules.json, as Qwen3-Embedding's
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]
POOLING = {
    "word_embedding_dimension": CONFIG["hidden_size"],
    "pooling_mode_cls_token": False,
    "pooling_mode_mean_tokens": False,
    "pooling_mode_max_tokens": False,
    "pooling_mode_mean_sqrt_len_tokens": False,
    "pooling_mode_weightedmean_tokens": False,
    "pooling_mode_lasttoken": True,
    "include_prompt": True,
}
NOTE = ("token_ids: the inputs (each ends in <|endoftext|>, as Qwen3-Embedding's tokenizer appends); "
        "transformers: float32 Qwen3Model, final hidden state at the last position, L2-normalized "
        "(the weights are float16 values: the F16 file's exactly); hidden_longest: its every position's "
        "final hidden state (after the output norm) for the longest list; llama_server: llama-server "
        "/v1/embeddings --pooling last on each file (L2-normalized by llama-server)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-dir", type=Path, default=Path.home() / ".cache" / "lmserve-peers")
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "fixtures" / "embedding")
    parser.add_argument("--work", type=Path, help="keep the Hugging Face model here (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = (args.work or Path(tmp)) / "hf"  # the converter names the model after it: general.name "Hf"
        make(args.llama_dir, hf_dir, args.out)


def make(llama_dir: Path, hf_dir: Path, out: Path) -> None:
    shutil.rmtree(hf_dir, ignore_errors=True)
    tokenizer = save_hf_model(llama_dir / "src" / "models" / "templates" / TEMPLATE, hf_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(hf_dir / "config.json", out / "hf-config.json")
    files = [out / f"{STEM}-F16.gguf", out / f"{STEM}-Q8_0.gguf"]
    convert(llama_dir / "src", hf_dir, files[0])
    run([str(llama_dir / "bin" / "llama-quantize"), str(files[0]), str(files[1]), "Q8_0"],
        env=os.environ | {"LD_LIBRARY_PATH": str(llama_dir / "lib")})

    lists = [[END], *([*tokenizer.encode(text, add_special_tokens=False), END] for text in TEXTS),
             [*TOKEN_IDS[1:], END]]
    hidden = reference_hidden(hf_dir, lists)
    reference = [normalized(h[-1]) for h in hidden]
    served = {f.name: llama_server_embeddings(llama_dir, f, lists) for f in files}
    doc = {
        "token_ids": lists,
        "pooling": "last",
        "note": NOTE,
        "transformers": [rounded(e) for e in reference],
        "hidden_longest": [rounded(row) for row in hidden[-1]],
        "llama_server": {name: {"embeddings": [rounded(e) for e in got["embeddings"]],
                                "prompt_tokens": got["prompt_tokens"]} for name, got in served.items()},
    }
    (out / "references.json").write_text(json.dumps(doc) + "\n")

    print("pairwise cosines between the lists' transformers embeddings (how far apart inputs are):")
    print(np.round(np.array(reference) @ np.array(reference).T, 4))
    for name, got in served.items():
        cosines = [float(np.dot(a, b)) for a, b in zip(got["embeddings"], reference, strict=True)]
        print(f"{name}: llama-server vs transformers cosine per list {[f'{c:.7f}' for c in cosines]}; "
              f"prompt_tokens {got['prompt_tokens']} for lengths {[len(ids) for ids in lists]}")
    for f in sorted(out.iterdir()):
        print(f"{f.name}: {f.stat().st_size} bytes")


def save_hf_model(template: Path, hf_dir: Path) -> transformers.PreTrainedTokenizerBase:
    """The random-weight model, its tokenizer and sentence-transformers' pooling metadata."""
    torch.manual_seed(SEED)
    model = transformers.Qwen3Model(transformers.Qwen3Config(**CONFIG)).eval()
    randomize(model)
    model.save_pretrained(hf_dir)
    (hf_dir / "modules.json").write_text(json.dumps(MODULES, indent=2) + "\n")
    (hf_dir / "1_Pooling").mkdir()
    (hf_dir / "1_Pooling" / "config.json").write_text(json.dumps(POOLING, indent=2) + "\n")
    (hf_dir / "2_Normalize").mkdir()
    tokenizer = toy_tokenizer.byte_level_qwen3(ADDED, PLAIN, eos="<|im_end|>", pad="<|endoftext|>")
    tokenizer.chat_template = template.read_text()
    tokenizer.save_pretrained(hf_dir)
    return tokenizer


def randomize(model: torch.nn.Module) -> None:
    """Every parameter drawn (norm weights too, which transformers would leave at 1), at a scale
    where each layer's attention and FFN move the residual stream as much as the embedding does
    (so the last position's state depends on the whole input), then rounded to float16 values."""
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                value = 0.5 + torch.rand(tensor.shape, generator=gen)
            elif name.endswith("embed_tokens.weight"):
                value = torch.randn(tensor.shape, generator=gen)
            else:  # a projection keeping activations at unit scale
                value = torch.randn(tensor.shape, generator=gen) / math.sqrt(tensor.shape[-1])
            tensor.copy_(value.half().float())


def convert(llama_src: Path, hf_dir: Path, gguf: Path) -> None:
    """F16 GGUF by llama.cpp's converter, its byte-level BPE's pre-tokenizer pinned to Qwen's `qwen2`
    (a toy vocabulary's hash is unknown to it: scripts/fixtures/convert.py)."""
    helper = Path(__file__).resolve().parent / "fixtures" / "convert.py"
    run([sys.executable, str(helper), str(llama_src), "--pre", "qwen2", "--",
         str(hf_dir), "--outtype", "f16", "--outfile", str(gguf)])


def reference_hidden(hf_dir: Path, lists: list[list[int]]) -> list[np.ndarray]:
    """transformers' float32 final hidden states `[len(ids), hidden]` of each list, alone."""
    model = transformers.Qwen3Model.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).last_hidden_state[0].float().numpy() for ids in lists]


def normalized(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def rounded(v: np.ndarray | list[float]) -> list[float]:
    return [round(float(x), 8) for x in v]


def llama_server_embeddings(llama_dir: Path, gguf: Path, lists: list[list[int]]) -> dict[str, list]:
    """llama-server's /v1/embeddings of each list (one request each), and its prompt_tokens."""
    embeddings, counted = [], []
    with llama_server(llama_dir, gguf) as url:
        for ids in lists:
            body = json.dumps({"input": ids, "encoding_format": "float"}).encode()
            request = urllib.request.Request(f"{url}/v1/embeddings", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                reply = json.load(response)
            (item,) = reply["data"]
            embeddings.append(np.array(item["embedding"], dtype=np.float64))
            counted.append(reply["usage"]["prompt_tokens"])
    return {"embeddings": embeddings, "prompt_tokens": counted}


@contextlib.contextmanager
def llama_server(llama_dir: Path, gguf: Path) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [str(llama_dir / "bin" / "llama-server"), "-m", str(gguf), "--embedding", "--pooling", "last",
               "--host", "127.0.0.1", "--port", str(port), "-c", "256", "-np", "1", "-t", "2"]
    env = os.environ | {"LD_LIBRARY_PATH": str(llama_dir / "lib")}
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    sys.exit(f"llama-server did not come up:\n{log.read().decode(errors='replace')[-4000:]}")
                with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    main()
