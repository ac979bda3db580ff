"""Models found by name in the stores of Ollama, LM Studio, the Hugging Face hub and llama.cpp;
`--list`; split GGUFs read as one file; `--chat-template`; load progress.

Every store is faked under a temporary HOME from the tiny family fixtures, laid out as each tool
writes it (Ollama's manifests and `sha256-<hex>` blobs, the hub cache's snapshot symlinks)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest

from lmserve import cli
from lmserve.engine_cpu import CPUEngine
from lmserve.model.catalog import catalog
from lmserve.model.gguf_file import GGUFFile, ModelLoadError
from lmserve.model.loader import load_model
from lmserve.model.resolve import resolve, stores
from tests.conftest import TEMPLATES
from tests.families import Fixture
from tests.server_util import start_server

STORE_VARS = ("OLLAMA_MODELS", "HF_HUB_CACHE", "HF_HOME", "LLAMA_CACHE", "XDG_CACHE_HOME", "XDG_CONFIG_HOME")
PROMPT = [1, 5, 9, 42, 100, 7, 300, 12]


def ollama_model(root: Path, registry: str, namespace: str, model: str, tag: str, file: Path) -> None:
    """A model as `ollama pull` leaves it: the GGUF as blob `sha256-<hex>`, and a manifest naming it."""
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    blob = blobs / f"sha256-{digest}"
    if not blob.exists():
        blob.symlink_to(file)
    template = b"{{ .Prompt }}"
    template_digest = hashlib.sha256(template).hexdigest()
    (blobs / f"sha256-{template_digest}").write_bytes(template)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": "sha256:" + "0" * 64, "size": 2},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
             "size": file.stat().st_size},
            {"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{template_digest}",
             "size": len(template)},
        ],
    }
    path = root / "manifests" / registry / namespace / model / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))


def hub_model(hub: Path, repo: str, files: dict[str, Path], revision: str = "a" * 40) -> None:
    """A repo as huggingface_hub caches it: content-addressed blobs, a snapshot of symlinks to them."""
    folder = hub / ("models--" + repo.replace("/", "--"))
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(revision)
    for rel, file in files.items():
        blob = folder / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        link = folder / "snapshots" / revision / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))


def write_split(source: Path, out: Path) -> list[Path]:
    """`source` rewritten as llama.cpp's gguf-split writes it: all metadata in part 1, the tensors
    spread over 2 parts, `split.no` / `split.count` / `split.tensors.count` in every part."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch, split_max_tensors=-(-len(reader.tensors) // 2))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(out)


def gpt2_model(path: Path) -> Path:
    """A GGUF of an architecture lmserve does not serve."""
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_context_length(1024)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def split_parts(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_split(Fixture("qwen2", "Q4_K_M").path, tmp_path_factory.mktemp("split") / "tiny-qwen2-Q4_K_M.gguf")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, split_parts: list[Path]) -> Path:
    """A HOME with every store filled, and no variable pointing elsewhere."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in STORE_VARS:
        monkeypatch.delenv(name, raising=False)
    ollama = tmp_path / ".ollama" / "models"
    ollama_model(ollama, "registry.ollama.ai", "library", "qwen3-coder", "30b", Fixture("qwen3moe", "Q4_K_M").path)
    ollama_model(ollama, "registry.ollama.ai", "library", "llama3.2", "latest", Fixture("llama3", "Q8_0").path)
    ollama_model(ollama, "hf.co", "org", "repo", "Q4_K_M", Fixture("qwen2", "Q4_K_M").path)
    lms = tmp_path / ".lmstudio" / "models" / "lmstudio-community" / "gemma-3-GGUF"
    lms.mkdir(parents=True)
    for quant in ("Q4_K_M", "Q8_0"):
        (lms / f"tiny-gemma3-{quant}.gguf").symlink_to(Fixture("gemma3", quant).path)
    (lms / "mmproj-gemma3-F16.gguf").symlink_to(Fixture("gemma3", "F16").path)  # a vision projector
    old_lms = tmp_path / ".cache" / "lm-studio" / "models" / "bartowski" / "phi-GGUF"
    old_lms.mkdir(parents=True)
    (old_lms / "tiny-phi3-Q8_0.gguf").symlink_to(Fixture("phi3", "Q8_0").path)
    hub = tmp_path / ".cache" / "huggingface" / "hub"
    hub_model(hub, "unsloth/Mistral-GGUF", {f"tiny-mistral-{q}.gguf": Fixture("mistral", q).path
                                            for q in ("Q4_K_M", "Q8_0")})
    hub_model(hub, "org/Split-GGUF", {f"Q4_K_M/{p.name}": p for p in split_parts})
    llama_cache = tmp_path / ".cache" / "llama.cpp"
    llama_cache.mkdir(parents=True)
    (llama_cache / "ggml-org_gpt-oss-GGUF_tiny-gpt-oss-Q8_0.gguf").symlink_to(Fixture("gpt-oss", "Q8_0").path)
    (llama_cache / "ggml-org_gpt-oss-GGUF_tiny-gpt-oss-Q8_0.gguf.json").write_text("{}")  # llama.cpp's etag file
    gpt2_model(llama_cache / "someone_gpt2-GGUF_gpt2.gguf")
    return tmp_path


@pytest.mark.parametrize(("name", "family", "quant", "store"), [
    ("qwen3-coder:30b", "qwen3moe", "Q4_K_M", ".ollama/models/blobs"),
    ("llama3.2", "llama3", "Q8_0", ".ollama/models/blobs"),  # tag `latest`
    ("llama3.2:latest", "llama3", "Q8_0", ".ollama/models/blobs"),
    ("registry.ollama.ai/library/llama3.2:latest", "llama3", "Q8_0", ".ollama/models/blobs"),
    ("hf.co/org/repo:Q4_K_M", "qwen2", "Q4_K_M", ".ollama/models/blobs"),
    ("lmstudio-community/gemma-3-GGUF:Q8_0", "gemma3", "Q8_0", ".lmstudio/models"),
    ("lmstudio-community/gemma-3-GGUF:q4_k_m", "gemma3", "Q4_K_M", ".lmstudio/models"),
    ("lmstudio-community/gemma-3-GGUF:tiny-gemma3-Q8_0.gguf", "gemma3", "Q8_0", ".lmstudio/models"),
    ("bartowski/phi-GGUF", "phi3", "Q8_0", ".cache/lm-studio/models"),
    ("unsloth/Mistral-GGUF:Q4_K_M", "mistral", "Q4_K_M", ".cache/huggingface/hub/models--unsloth--Mistral-GGUF"),
    ("unsloth/mistral-gguf:Q8_0", "mistral", "Q8_0", ".cache/huggingface/hub/models--unsloth--Mistral-GGUF"),
    ("ggml-org/gpt-oss-GGUF:Q8_0", "gpt-oss", "Q8_0", ".cache/llama.cpp"),
    ("ggml-org_gpt-oss-GGUF_tiny-gpt-oss-Q8_0.gguf", "gpt-oss", "Q8_0", ".cache/llama.cpp"),
])
def test_each_name_form_finds_its_file(home: Path, name: str, family: str, quant: str, store: str) -> None:
    path, found_as = resolve(name)
    assert found_as == name
    assert path.is_relative_to(home / store), path
    assert path.read_bytes() == Fixture(family, quant).path.read_bytes()


def test_an_ollama_blob_is_named_by_the_sha256_of_its_file(home: Path) -> None:
    path, _ = resolve("qwen3-coder:30b")
    assert path.name == "sha256-" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_path_is_a_path(home: Path) -> None:
    fixture = Fixture("qwen2", "F16").path
    assert resolve(str(fixture)) == (fixture, None)
    assert resolve(str(home / "missing.gguf")) == (home / "missing.gguf", None)  # the loader says "not found"


def test_a_split_model_is_found_by_its_first_part(home: Path) -> None:
    path, _ = resolve("org/Split-GGUF")
    assert path.name == "tiny-qwen2-Q4_K_M-00001-of-00002.gguf"


def test_a_name_of_several_files_lists_them(home: Path) -> None:
    with pytest.raises(ModelLoadError) as err:
        resolve("lmstudio-community/gemma-3-GGUF")
    message = str(err.value)
    assert "matches 2 models (LM Studio)" in message and "name one of them" in message
    assert "lmstudio-community/gemma-3-GGUF:Q4_K_M" in message and "lmstudio-community/gemma-3-GGUF:Q8_0" in message
    assert "mmproj" not in message
    with pytest.raises(ModelLoadError, match="matches 2 models"):
        resolve("unsloth/Mistral-GGUF")


def test_a_name_of_nothing_says_where_it_looked(home: Path) -> None:
    with pytest.raises(ModelLoadError) as err:
        resolve("qwen3:8b")
    message = str(err.value)
    assert message.startswith("no model file or stored model named 'qwen3:8b'")
    for store in stores():
        for folder in store.dirs:
            assert str(folder) in message
    assert f"{home / '.cache' / 'llama.cpp'}" in message and "(absent)" not in message
    assert "\n" not in message


def test_a_miss_says_which_folders_do_not_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in STORE_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ModelLoadError) as err:
        resolve("llama3.2")
    assert str(err.value).count("(absent)") == sum(len(store.dirs) for store in stores()) == 5


def test_variables_move_the_stores(home: Path, tmp_path_factory: pytest.TempPathFactory,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    ollama_model(elsewhere / "ollama", "registry.ollama.ai", "library", "moved", "latest", Fixture("qwen2", "Q8_0").path)
    hub_model(elsewhere / "hf" / "hub", "org/moved", {"m-Q8_0.gguf": Fixture("qwen2", "Q8_0").path})
    (elsewhere / "llama").mkdir()
    (elsewhere / "llama" / "org_moved2_m-Q8_0.gguf").symlink_to(Fixture("qwen2", "Q8_0").path)
    monkeypatch.setenv("OLLAMA_MODELS", str(elsewhere / "ollama"))
    monkeypatch.setenv("HF_HOME", str(elsewhere / "hf"))
    monkeypatch.setenv("LLAMA_CACHE", str(elsewhere / "llama"))
    assert resolve("moved")[0].is_relative_to(elsewhere / "ollama")
    assert resolve("org/moved")[0].is_relative_to(elsewhere / "hf" / "hub")
    assert resolve("org/moved2")[0].is_relative_to(elsewhere / "llama")
    with pytest.raises(ModelLoadError, match="no model file"):
        resolve("qwen3-coder:30b")  # the default Ollama folder is no longer searched
    monkeypatch.setenv("HF_HUB_CACHE", str(home / ".cache" / "huggingface" / "hub"))
    assert resolve("unsloth/Mistral-GGUF:Q8_0")[0].is_relative_to(home)


def test_list_shows_every_model_with_its_metadata(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["--list"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    expected = [  # name, store, architecture, quant, context
        ("qwen3-coder:30b", "Ollama", "qwen3moe", "Q4_K_M", "qwen3moe"),
        ("llama3.2:latest", "Ollama", "llama", "Q8_0", "llama3"),
        ("hf.co/org/repo:Q4_K_M", "Ollama", "qwen2", "Q4_K_M", "qwen2"),
        ("lmstudio-community/gemma-3-GGUF:Q4_K_M", "LM Studio", "gemma3", "Q4_K_M", "gemma3"),
        ("lmstudio-community/gemma-3-GGUF:Q8_0", "LM Studio", "gemma3", "Q8_0", "gemma3"),
        ("bartowski/phi-GGUF", "LM Studio", "phi3", "Q8_0", "phi3"),
        ("unsloth/Mistral-GGUF:Q4_K_M", "Hugging Face cache", "llama", "Q4_K_M", "mistral"),
        ("unsloth/Mistral-GGUF:Q8_0", "Hugging Face cache", "llama", "Q8_0", "mistral"),
        ("org/Split-GGUF", "Hugging Face cache", "qwen2", "Q4_K_M", "qwen2"),
        ("ggml-org_gpt-oss-GGUF_tiny-gpt-oss-Q8_0.gguf", "llama.cpp cache", "gpt-oss", "Q8_0", "gpt-oss"),
    ]
    assert lines[0].split()[:3] == ["NAME", "STORE", "SIZE"]
    for name, store, arch, quant, family in expected:
        (line,) = [line for line in lines if line.startswith(name + " ")]
        context = GGUFFile(Fixture(family, quant).path).metadata[f"{arch}.context_length"]
        for cell in (store, f" {arch} ", f" {quant} ", f" {context} ", " yes "):
            assert cell in line, (cell, line)
    (gpt2,) = [line for line in lines if line.startswith("someone_gpt2-GGUF_gpt2.gguf ")]
    assert " gpt2 " in gpt2 and "no (architecture not supported)" in gpt2
    assert len(lines) == 1 + len(expected) + 1 + 1  # header, models, the unsupported one, the folders
    assert "mmproj" not in out and "-00002-of-" not in out
    assert lines[-1].startswith("searched: Ollama: ")


def test_list_sizes_count_every_part_of_a_split_model(home: Path, split_parts: list[Path]) -> None:
    (split,) = [e for e in catalog() if e.found.name == "org/Split-GGUF"]
    assert split.size == sum(p.stat().st_size for p in split_parts)
    assert all(e.problem == "" for e in catalog())


def test_list_shows_a_model_it_cannot_read(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ollama = home / ".ollama" / "models"
    ollama_model(ollama, "registry.ollama.ai", "library", "gone", "latest", Fixture("qwen2", "F16").path)
    digest = hashlib.sha256(Fixture("qwen2", "F16").path.read_bytes()).hexdigest()
    (ollama / "blobs" / f"sha256-{digest}").unlink()  # a pull that was cleaned up half way
    (entry,) = [e for e in catalog() if e.problem]
    assert entry.found.name == "gone:latest"
    cli.main(["--list"])
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith(entry.found.name + " ")]
    assert "no (unreadable)" in line and "not found" in line


def test_listed_names_resolve_to_their_files(home: Path) -> None:
    for entry in catalog():
        assert resolve(entry.found.name)[0] == entry.found.path


# -- split GGUFs --------------------------------------------------------------------------------

def test_split_parts_are_laid_out_as_gguf_split_writes_them(split_parts: list[Path]) -> None:
    first, second = (GGUFFile(p) for p in split_parts)  # each opens the whole set: read the parts raw
    raw = [gguf.GGUFReader(p) for p in split_parts]
    assert [r.fields["split.no"].contents() for r in raw] == [0, 1]
    assert [r.fields["split.count"].contents() for r in raw] == [2, 2]
    assert all(r.fields["split.tensors.count"].contents() == len(first.tensors) for r in raw)
    assert all(len(r.tensors) > 0 for r in raw)
    assert "tokenizer.ggml.tokens" in raw[0].fields and "tokenizer.ggml.tokens" not in raw[1].fields
    assert first.tensors == second.tensors


def test_a_split_model_reads_as_the_whole_file(split_parts: list[Path]) -> None:
    whole, split = GGUFFile(Fixture("qwen2", "Q4_K_M").path), GGUFFile(split_parts[0])
    assert {k: v for k, v in split.metadata.items() if not k.startswith("split.")}.keys() == whole.metadata.keys()
    assert split.tensors.keys() == whole.tensors.keys()
    assert {t.file for t in split.tensors.values()} == set(split_parts)
    for name in whole.tensors:
        assert np.array_equal(split.raw(name), whole.raw(name)), name
    assert split.file_bytes == sum(p.stat().st_size for p in split_parts)
    assert load_model(split_parts[1]).model_id == "tiny-qwen2-Q4_K_M"  # any part opens the set


def test_a_split_model_answers_like_the_whole_file(split_parts: list[Path]) -> None:
    def greedy(path: Path) -> tuple[np.ndarray, list[int]]:
        model = load_model(path)
        engine = CPUEngine(model.gguf, model.config)
        cache = engine.new_cache(32)
        logits = engine.prefill(cache, PROMPT, all_logits=True)
        tokens = [int(np.argmax(logits[-1]))]
        for _ in range(6):
            tokens.append(int(np.argmax(engine.decode([cache], [tokens[-1]])[0])))
        return logits, tokens

    whole_logits, whole_tokens = greedy(Fixture("qwen2", "Q4_K_M").path)
    split_logits, split_tokens = greedy(split_parts[0])
    assert np.array_equal(split_logits, whole_logits)
    assert split_tokens == whole_tokens


def test_the_mlx_engine_reads_tensors_from_every_part(split_parts: list[Path], tmp_path: Path) -> None:
    pytest.importorskip("mlx.core")
    from lmserve.engine_mlx import MLXEngine

    def logits(path: Path) -> np.ndarray:
        model = load_model(path)
        engine = MLXEngine(model.gguf, model.config, cache_dir=tmp_path / path.name)
        return engine.prefill(engine.new_cache(32), PROMPT)

    assert np.array_equal(logits(split_parts[0]), logits(Fixture("qwen2", "Q4_K_M").path))


def test_a_missing_or_misnumbered_part_is_a_clear_error(split_parts: list[Path], tmp_path: Path) -> None:
    first = tmp_path / split_parts[0].name
    first.symlink_to(split_parts[0])
    with pytest.raises(ModelLoadError, match=r"part 2 of 2 is missing \(.*-00002-of-00002\.gguf not found\)"):
        GGUFFile(first)
    (tmp_path / split_parts[1].name).symlink_to(split_parts[0])  # part 1 again, under part 2's name
    with pytest.raises(ModelLoadError, match="should be part 2 of 2 but its metadata says split.no 0"):
        GGUFFile(first)
    renamed = tmp_path / "renamed.gguf"
    renamed.symlink_to(split_parts[0])
    with pytest.raises(ModelLoadError, match="not named like one"):
        GGUFFile(renamed)


# -- chat template and progress -------------------------------------------------------------------

def test_chat_template_file_replaces_the_embedded_one(tmp_path: Path) -> None:
    fixture = Fixture("qwen2", "Q8_0").path
    embedded = load_model(fixture)
    assert embedded.template_origin == "embedded in the GGUF"
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    model = load_model(fixture, chat_template=template)
    assert model.template_origin == str(template)
    assert model.template.render([{"role": "user", "content": "hi"}]) == "<<hi>>"
    template.write_text("{% for m in messages %}")
    with pytest.raises(ModelLoadError, match=rf"--chat-template {template}: chat template does not compile"):
        load_model(fixture, chat_template=template)
    with pytest.raises(ModelLoadError, match="cannot read --chat-template"):
        load_model(fixture, chat_template=tmp_path / "missing.jinja")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_a_few_lines_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = io.StringIO()
    monkeypatch.setattr(sys, "stderr", plain)
    progress = cli.LoadProgress("loading weights", 4 << 30)
    for done in range(1, 101):
        progress(done, 100)
    lines = plain.getvalue().splitlines()
    assert len(lines) == 5 and lines[-1].startswith("loading weights: 100% (4.0 GiB of 4.0 GiB, ")
    assert all("/s" in line for line in lines) and "s left)" in lines[1]
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    progress = cli.LoadProgress("loading weights", 4 << 30)
    for done in range(1, 101):
        progress(done, 100)
    drawn = terminal.getvalue()
    assert "loading weights" in drawn and "4.0/4.0 GiB" in drawn and "\x1b[" in drawn  # rich's bar


# -- end to end -------------------------------------------------------------------------------------

def test_a_service_serves_its_configured_model_by_name(home: Path) -> None:
    """What `brew services start lmserve` does: no arguments, the model named in the config file."""
    config = home / ".config" / "lmserve" / "config.toml"
    config.parent.mkdir(parents=True)
    template = TEMPLATES / "qwen2.5.jinja"
    config.write_text(f'model = "hf.co/org/repo:Q4_K_M"\nengine = "cpu"\nctx = 256\nchat-template = "{template}"\n')
    env = {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "OLLAMA_MODELS": str(home / ".ollama" / "models")}
    with start_server(env=env) as server:
        models = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"]
        assert models[0]["id"] == "hf.co/org/repo:Q4_K_M" and models[0]["loaded"] is True
        assert all(not m["loaded"] for m in models[1:])  # the other stored models, loadable by name
        reply = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0}).json()
        assert reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["usage"]["completion_tokens"] >= 1
        log = server.log()
    assert "hf.co/org/repo:Q4_K_M (" in log and ".ollama/models/blobs/sha256-" in log
    assert re.search(rf"chat template +{re.escape(str(template))}\n", log)
    assert re.search(r"context +256 tokens \(--ctx\)", log)
