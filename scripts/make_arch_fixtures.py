"""Make the tiny random-weight fixture models of tests/data/fixtures/arch, by llama.cpp itself.

For each family (scripts/fixtures/families.py): a transformers model with a small config in the
real model's shape and seeded random weights, saved with a toy tokenizer of the family's kind
(scripts/fixtures/toy_tokenizer.py) and the family's real chat template; converted to F16 by
llama.cpp's own convert_hf_to_gguf.py; quantized to Q8_0 and Q4_K_M by llama.cpp's llama-quantize;
then scored on 64 fixed token ids by transformers (float32, the original model: `reference`) and
by llama.cpp on each file (scripts/fixtures/llama_logits.c, compiled here: `llama_cpp`).

    PYTHON scripts/make_arch_fixtures.py [FAMILY ...] [--llama-dir DIR] [--llama-src DIR]
        [--out DIR] [--work DIR]

FAMILY: qwen35, qwen35moe, gemma4, gemma4-dense (default: all four, about a minute on 2 cores).
PYTHON is a venv outside the project's that has torch (the project's has none), made with
    python3 -m venv /work/fixvenv && . /work/fixvenv/bin/activate
    pip install torch==2.13.0 transformers==5.24.0 numpy sentencepiece tokenizers safetensors protobuf
(torch 2.13.0 is the CPU build; transformers 5.24 has these families' model classes and
tokenizers; the converter needs the rest). Also needed:
- `--llama-dir`: the output of shared/tools/build-llama-server.sh (default ~/.cache/lmserve-peers):
  bin/llama-quantize, lib/libllama.so, and src/ with the matching convert_hf_to_gguf.py, gguf-py,
  conversion/ and models/templates (the chat templates are read from there);
- `--llama-src`: llama.cpp sources of the same version, only for llama.h and ggml's headers
  (default: the ones in the llama-cpp-python sdist the build script builds, fetched from the
  package index into the work folder), and a C compiler (`cc`, or $CC).
Everything is seeded: the same llama.cpp and transformers give the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixtures.families import FAMILIES, Family  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QUANTS = ("Q8_0", "Q4_K_M")
NOTE = ("reference: transformers f32 on the original Hugging Face model (hf-config.json); llama_cpp: "
        "llama.cpp's logits on each file (quantized activations, so close, not identical)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", metavar="FAMILY", help=f"{', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--llama-dir", type=Path, default=Path.home() / ".cache" / "lmserve-peers")
    parser.add_argument("--llama-src", type=Path, help="llama.cpp's sources (default: fetched, see above)")
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "fixtures" / "arch")
    parser.add_argument("--work", type=Path,
                        help="keep the Hugging Face models here (default: a temporary folder)")
    args = parser.parse_args()
    if unknown := sorted(set(args.families) - set(FAMILIES)):
        parser.error(f"unknown families: {', '.join(unknown)}")
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        logits_tool = compile_logits_tool(args.llama_dir, args.llama_src or fetch_sources(work), work)
        for name in args.families or FAMILIES:
            make_family(FAMILIES[name], args.llama_dir, logits_tool, args.out / name, work / name)


def make_family(family: Family, llama_dir: Path, logits_tool: Path, out: Path, work: Path) -> None:
    """Every file of one family's folder, from nothing."""
    print(f"== {family.name}", flush=True)
    hf_dir = work / "hf"  # the converter names the model after it: general.name "Hf", as the others
    shutil.rmtree(hf_dir, ignore_errors=True)
    save_hf_model(family, llama_dir / "src" / "models" / "templates" / family.template, hf_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(hf_dir / "config.json", out / "hf-config.json")

    files = [out / f"tiny-{family.name}-F16.gguf"]
    convert(family, llama_dir / "src", hf_dir, files[0])
    for quant in QUANTS:
        files.append(out / f"tiny-{family.name}-{quant}.gguf")
        run([str(llama_dir / "bin" / "llama-quantize"), str(files[0]), str(files[-1]), quant])

    ids = family.token_ids
    reference = summarize(reference_logits(family, hf_dir, ids))
    ours = {f.name: summarize(llama_cpp_logits(logits_tool, llama_dir, f, ids)) for f in files}
    doc = {"token_ids": ids, "note": NOTE, "reference": reference, "llama_cpp": ours}
    (out / "logits.json").write_text(json.dumps(doc))
    for fname, got in ours.items():
        agree = sum(a == b for a, b in zip(got["top1"], reference["top1"], strict=True))
        print(f"{fname}: top-1 agrees with transformers at {agree}/{len(ids)} positions", flush=True)


def save_hf_model(family: Family, template: Path, hf_dir: Path) -> None:
    """The random-weight model and its tokenizer, as a Hugging Face checkpoint folder."""
    model_class = getattr(transformers, family.hf_class)
    torch.manual_seed(family.seed)
    model = model_class(model_class.config_class(**family.config)).eval()
    randomize(model, family)
    model.save_pretrained(hf_dir)
    config_path = hf_dir / "config.json"
    config = json.loads(config_path.read_text()) | family.config_json_extra
    for key in family.config_json_drop:
        del config[key]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer = family.tokenizer()
    tokenizer.chat_template = template.read_text()
    tokenizer.save_pretrained(hf_dir)


def randomize(model: torch.nn.Module, family: Family) -> None:
    """Draw every weight, and every saved buffer (Gemma 4's layer_scalar), by the family's rule.

    named_parameters lists a tied weight once, under its first name (the embedding).
    """
    saved = set(model.state_dict())
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in saved)]
    gen = torch.Generator().manual_seed(family.seed)
    with torch.no_grad():
        for name, tensor in tensors:
            tensor.copy_(family.init(name, tensor, gen))


def convert(family: Family, llama_src: Path, hf_dir: Path, gguf: Path) -> None:
    """F16 GGUF by llama.cpp's converter (through fixtures/convert.py: it may pin the pre-tokenizer)."""
    helper = Path(__file__).resolve().parent / "fixtures" / "convert.py"
    pre = ["--pre", family.pinned_pre] if family.pinned_pre else []
    run([sys.executable, str(helper), str(llama_src), *pre, "--",
         str(hf_dir), "--outtype", "f16", "--outfile", str(gguf), *family.convert_args])


def reference_logits(family: Family, hf_dir: Path, ids: list[int]) -> np.ndarray:
    """transformers' float32 logits `[len(ids), vocab]` of the saved checkpoint."""
    model = getattr(transformers, family.hf_class).from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


LLAMA_CPP_PYTHON = "0.3.36"  # the sdist shared/tools/build-llama-server.sh builds llama.cpp from


def fetch_sources(work: Path) -> Path:
    """llama.cpp's sources as vendored in the llama-cpp-python sdist of the build (for its headers)."""
    work.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
         "-d", str(work), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"])
    archive = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    shutil.unpack_archive(archive, work)
    return work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def compile_logits_tool(llama_dir: Path, llama_src: Path, work: Path) -> Path:
    """Build fixtures/llama_logits.c against the libllama of `llama_dir`."""
    headers = [llama_src / "include", llama_src / "ggml" / "include"]
    if not (headers[0] / "llama.h").is_file():
        sys.exit(f"no llama.h under {headers[0]}: "
                 "pass --llama-src, llama.cpp's sources of the build's version")
    work.mkdir(parents=True, exist_ok=True)
    tool = work / "llama_logits"
    source = Path(__file__).resolve().parent / "fixtures" / "llama_logits.c"
    lib = llama_dir / "lib"
    run([os.environ.get("CC", "cc"), "-O2", "-o", str(tool), str(source), *(f"-I{h}" for h in headers),
         f"-L{lib}", f"-Wl,-rpath-link,{lib}", "-lllama", "-lggml", "-lggml-base"])
    return tool


def llama_cpp_logits(tool: Path, llama_dir: Path, gguf: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits `[len(ids), vocab]` of one file, every position from one prefill."""
    with tempfile.NamedTemporaryFile(suffix=".f32") as raw:
        # libllama's own run path points into its build folder: give the loader its lib/ instead
        env = os.environ | {"LD_LIBRARY_PATH": str(llama_dir / "lib")}
        run([str(tool), str(gguf), raw.name, *map(str, ids)], env=env)
        return np.fromfile(raw.name, dtype=np.float32).reshape(len(ids), -1)


def summarize(logits: np.ndarray) -> dict[str, list]:
    """top-1 and top-5 ids at every position, and the full logits at the last (5 decimals)."""
    order = np.argsort(-logits, axis=-1, kind="stable")
    return {
        "top1": order[:, 0].tolist(),
        "top5": order[:, :5].tolist(),
        "last_logits": [round(float(x), 5) for x in logits[-1]],
    }


def run(command: list[str], env: dict[str, str] | None = None) -> None:
    """Run a tool quietly; on failure show what it said and stop."""
    done = subprocess.run(command, capture_output=True, text=True, errors="replace", env=env)
    if done.returncode != 0:
        said = done.stdout[-4000:] + done.stderr[-4000:]
        sys.exit(f"{' '.join(command[:3])} ... failed ({done.returncode}):\n{said}")


if __name__ == "__main__":
    main()
