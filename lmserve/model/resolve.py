"""Find a model by the name people already know it by, in the stores of the tools that downloaded it.

`lmserve-mac NAME` serves a model Ollama, LM Studio, the Hugging Face hub or llama.cpp already put on
this disk, without a network and without copying it. The stores are searched in this order and the
first that knows the name answers:

- Ollama (`$OLLAMA_MODELS`, else `~/.ollama/models`): names as Ollama spells them (`qwen3-coder:30b`,
  `llama3.2` for `:latest`, `hf.co/org/repo:Q4_K_M`); the manifest names the GGUF blob.
- LM Studio (`~/.lmstudio/models`, the older `~/.cache/lm-studio/models`): `publisher/repo[:QUANT]`.
- the Hugging Face hub cache: `org/repo[:QUANT]`.
- llama.cpp's cache (what `llama-server -hf` downloaded): `org/repo[:QUANT]` or the file's name.

QUANT picks a file of the repo by a word of its name, in any case (`q4_k_m`); a file's own name picks
exactly it. A split model (`m-00001-of-00003.gguf`, ...) is one model, found by its first part.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from lmserve.model.gguf_file import SPLIT_NAME, ModelLoadError

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"


@dataclass(frozen=True)
class Found:
    """One model in a store."""

    name: str  # as the user types it: it names this model alone
    path: Path  # the GGUF (a split model's first part)
    store: str  # the store's label
    key: str  # what a name is matched against: Ollama's full name, else the repo ("" in llama.cpp's cache)
    file: str  # the file's path inside its repo folder (llama.cpp's cache: its name)


class Store:
    """One tool's model folders, and how its names select among their models."""

    label = ""

    def __init__(self, *dirs: Path) -> None:
        self.dirs = dirs

    def models(self) -> list[Found]:
        return [found for root in self.dirs if root.is_dir() for found in self.scan(root)]

    def scan(self, root: Path) -> list[Found]:
        raise NotImplementedError

    def select(self, name: str, models: list[Found]) -> list[Found]:
        raise NotImplementedError


class OllamaStore(Store):
    """`manifests/<registry>/<namespace>/<model>/<tag>` (JSON) names the blob `blobs/sha256-<hex>`
    of its layer of type application/vnd.ollama.image.model, which is the GGUF."""

    label = "Ollama"

    def scan(self, root: Path) -> list[Found]:
        out = []
        for manifest in sorted((root / "manifests").glob("*/*/*/*")):
            blob = _ollama_blob(manifest)
            if blob is not None:
                host, namespace, model, tag = manifest.relative_to(root / "manifests").parts
                out.append(Found(_ollama_name(host, namespace, model, tag), root / "blobs" / blob, self.label,
                                 f"{host}/{namespace}/{model}:{tag}".lower(), ""))
        return out

    def select(self, name: str, models: list[Found]) -> list[Found]:
        key = _ollama_key(name)
        return [m for m in models if m.key == key]


class RepoStore(Store):
    """Folders of GGUFs grouped by repo (`org/repo`), named `org/repo` or `org/repo:QUANT`."""

    def select(self, name: str, models: list[Found]) -> list[Found]:
        repo, _, tag = name.removeprefix("hf.co/").partition(":")
        return _by_tag(tag, [m for m in models if m.key.lower() == repo.lower()])

    def named(self, repo: str, files: dict[str, Path]) -> list[Found]:
        """Each file of one repo (relative path -> path) named `repo` when it is the only one, else
        `repo:TAG` with the first of its quant word, file name and path that picks it alone."""
        plain = [Found(repo, path, self.label, repo, rel) for rel, path in sorted(files.items())]
        if len(plain) == 1:
            return plain
        out = []
        for m in plain:
            for tag in (_quant_word(m.file), Path(m.file).name, m.file):
                if _by_tag(tag, plain) == [m]:
                    out.append(Found(f"{repo}:{tag}", m.path, m.store, m.key, m.file))
                    break
        return out


class LMStudioStore(RepoStore):
    """`<publisher>/<repo>/*.gguf`."""

    label = "LM Studio"

    def scan(self, root: Path) -> list[Found]:
        out = []
        for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
            files = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*.gguf") if _is_model(p)}
            if files:
                out += self.named(f"{folder.parent.name}/{folder.name}", files)
        return out


class HubCacheStore(RepoStore):
    """`models--org--repo/snapshots/<revision>/...gguf`, symlinks into `../../blobs`. A file kept in
    several snapshots is taken from the one `refs/main` names, else from the newest."""

    label = "Hugging Face cache"

    def scan(self, root: Path) -> list[Found]:
        out = []
        for folder in sorted(root.glob("models--*--*")):
            org, repo = folder.name.removeprefix("models--").split("--", 1)
            main = folder / "refs" / "main"
            main_rev = main.read_text().strip() if main.is_file() else ""
            snapshots = sorted((folder / "snapshots").glob("*"),
                               key=lambda s: (s.name == main_rev, s.stat().st_mtime))
            files: dict[str, Path] = {}
            for snapshot in snapshots:  # later ones (main last) win
                files.update({p.relative_to(snapshot).as_posix(): p for p in snapshot.rglob("*.gguf") if _is_model(p)})
            if files:
                out += self.named(f"{org}/{repo}", files)
        return out


class LlamaCacheStore(Store):
    """Files named `org_repo_file.gguf` in one folder: named by that file name, or by `org/repo[:QUANT]`."""

    label = "llama.cpp cache"

    def scan(self, root: Path) -> list[Found]:
        return [Found(p.name, p, self.label, "", p.name) for p in sorted(root.glob("*.gguf")) if _is_model(p)]

    def select(self, name: str, models: list[Found]) -> list[Found]:
        if "/" not in name:
            return [m for m in models if name.lower() in (m.file.lower(), Path(m.file).stem.lower())]
        repo, _, tag = name.removeprefix("hf.co/").partition(":")
        prefix = repo.replace("/", "_").lower() + "_"
        return _by_tag(tag, [m for m in models if m.file.lower().startswith(prefix)])


def stores() -> list[Store]:
    """The stores in lookup order, at the folders their tools use (and the variables that move them)."""
    home = Path.home()
    cache = _env_dir("XDG_CACHE_HOME") or home / ".cache"
    hf_home = _env_dir("HF_HOME") or cache / "huggingface"
    mac = sys.platform == "darwin"
    return [
        OllamaStore(_env_dir("OLLAMA_MODELS") or home / ".ollama" / "models"),
        LMStudioStore(home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"),
        HubCacheStore(_env_dir("HF_HUB_CACHE") or hf_home / "hub"),
        LlamaCacheStore(_env_dir("LLAMA_CACHE") or (home / "Library" / "Caches" if mac else cache) / "llama.cpp"),
    ]


def resolve(arg: str, searched: list[Store] | None = None, names_only: bool = False) -> tuple[Path, str | None]:
    """The GGUF that `arg` names, and the name it was found by (None when `arg` is a path).
    `names_only`: a path is no name (a request's `model` must not open any file it likes)."""
    path = Path(arg).expanduser()
    if path.is_file() or _looks_like_path(arg):
        if names_only:
            raise ModelLoadError(f"{arg!r} is a path, not a model's name")
        return path, None
    searched = stores() if searched is None else searched
    for store in searched:
        models = store.select(arg, store.models())
        if len(models) == 1:
            return models[0].path, arg
        if models:
            listed = ", ".join(f"{m.name} ({m.path})" for m in models)
            raise ModelLoadError(f"{arg!r} matches {len(models)} models ({store.label}): {listed}; "
                                 "name one of them")
    where = "; ".join(f"{s.label}: " + ", ".join(str(d) + ("" if d.is_dir() else " (absent)") for d in s.dirs)
                      for s in searched)
    raise ModelLoadError(f"no model file or stored model named {arg!r}; looked in {where} "
                         "(`lmserve-mac --list` shows every stored model)")


def _looks_like_path(arg: str) -> bool:
    """A path that does not exist (reported as such by the loader) rather than a name to look up."""
    return (os.path.isabs(arg) or arg.startswith(("./", "../", "~"))
            or (arg.lower().endswith(".gguf") and "/" in arg and ":" not in arg))


def _env_dir(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def _is_model(path: Path) -> bool:
    """A GGUF to serve: not a vision projector, not a later part of a split model, not a broken link
    (an unfinished download)."""
    split = SPLIT_NAME.search(path.name)
    return path.is_file() and not path.name.lower().startswith("mmproj") and (split is None or split[1] == "00001")


def _by_tag(tag: str, models: list[Found]) -> list[Found]:
    """The models a `:TAG` picks: those whose file it names exactly, else those with it as a word of
    their file's path (bounded by non-alphanumerics), in any case; all of them for no tag."""
    if not tag:
        return models
    tag = tag.lower()
    exact = ([m for m in models if m.file.lower() == tag]
             or [m for m in models if Path(m.file).name.lower() == tag])
    if exact:
        return exact
    word = re.compile(rf"(?<![a-z0-9]){re.escape(tag)}(?![a-z0-9])")
    return [m for m in models if word.search(m.file.lower())]


def _quant_word(file: str) -> str:
    """The last word of a file's name, its quant by convention (`Qwen3-8B-Q4_K_M.gguf` -> `Q4_K_M`)."""
    stem = SPLIT_NAME.sub("", Path(file).name).removesuffix(".gguf")
    return re.split(r"[-.]", stem)[-1]


OLLAMA_DIGEST = re.compile(r"sha256[:-][0-9a-f]{64}")


def _ollama_blob(manifest: Path) -> str | None:
    """The blob file name of a manifest's model layer (None: not a readable model manifest)."""
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, StopIteration):
        return None
    # Only a well-formed digest names a blob: a crafted one ("sha256:../../x") must not reach outside blobs/.
    return str(digest).replace(":", "-") if OLLAMA_DIGEST.fullmatch(str(digest)) else None


def _ollama_key(name: str) -> str:
    """`[registry/][namespace/]model[:tag]` completed with Ollama's defaults, lower case."""
    parts = name.lower().partition("@")[0].split("/")
    if len(parts) > 3:
        return ""
    registry, namespace = [OLLAMA_REGISTRY, OLLAMA_NAMESPACE][:3 - len(parts)] + parts[:-1]
    model, _, tag = parts[-1].partition(":")
    return f"{registry}/{namespace}/{model}:{tag or OLLAMA_TAG}"


def _ollama_name(registry: str, namespace: str, model: str, tag: str) -> str:
    """The name as `ollama list` shows it: defaults left out, the tag always there."""
    if registry != OLLAMA_REGISTRY:
        return f"{registry}/{namespace}/{model}:{tag}"
    return f"{model}:{tag}" if namespace == OLLAMA_NAMESPACE else f"{namespace}/{model}:{tag}"
