"""Which models one server serves by name, and which file and settings each name means.

A request's `model` picks among (docs/API.md, "Models by name"), in this order:
- nothing, or the startup model's own id or name: the startup model;
- a `[models.NAME]` alias of the config file: its model, with the alias's own settings;
- a GGUF of `--models-dir DIR`, by its file name without `.gguf`;
- any model of the stores `--list` shows (Ollama, LM Studio, Hugging Face and llama.cpp caches);
- a hosted model's name (`claude-*`, `gpt-*`, `o1`-`o4*`, ...) that none of the above knows: the
  startup model, so clients configured for a hosted API work unchanged;
- anything else is unknown: 404 `model_not_found`.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmserve.core.errors import RequestError
from lmserve.model.catalog import file_quant
from lmserve.model.config import ModelConfig
from lmserve.model.families import FAMILIES
from lmserve.model.gguf_file import GGUFFile, ModelLoadError, model_stem
from lmserve.model.resolve import Store, resolve, stores
from lmserve.settings import ModelAlias

LOOKUP_SECONDS = 10.0  # how long a name's lookup in the stores is reused
HOSTED = re.compile(r"(claude|gpt|chatgpt|o[1-9]|text-|davinci|babbage|codex)", re.IGNORECASE)


@dataclass(frozen=True)
class ModelChoice:
    """A model to serve: the id clients see, its file and its own settings (field name -> value)."""

    name: str
    path: Path
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """One resident runtime per file and settings: two names for them share it."""
        return f"{self.path.resolve()}|{sorted(self.overrides.items())}"


class ModelDirectory:
    """Names to models, as the module says; `stores` is the store list `resolve` would search."""

    def __init__(self, default: ModelChoice, aliases: dict[str, ModelAlias], models_dir: Path | None = None,
                 store_list: list[Store] | None = None, default_names: tuple[str, ...] = ()) -> None:
        self.default = default
        self.aliases = aliases
        self.models_dir = models_dir
        self._stores = store_list
        self._default_names = {n.lower() for n in (default.name, *default_names) if n}
        self._looked_up: dict[tuple[str, bool], tuple[float, ModelChoice | None]] = {}

    def find(self, name: str | None, hosted_is_default: bool = True) -> ModelChoice:
        """The model `name` means; RequestError 404 `model_not_found` when none."""
        if not name or name.lower() in self._default_names:
            return self.default
        if name in self.aliases:
            alias = self.aliases[name]
            return ModelChoice(name, self._target(alias.target, name).path, alias.overrides)
        found = self._file(name)
        if found is not None:
            return found
        if hosted_is_default and HOSTED.match(name):
            return self.default
        raise RequestError(f"model {name!r} is not served here: not the served model, an alias of the config file, "
                           "a file of --models-dir or a stored model (GET /v1/models lists them)",
                           404, "model", "model_not_found")

    def _target(self, target: str, alias: str) -> ModelChoice:
        found = self._file(target, names_only=False)  # the config file may name a path
        if found is None:
            raise RequestError(f"model {alias!r} is an alias of {target!r}, which is no file or stored model",
                               404, "model", "model_not_found")
        return found

    def _file(self, name: str, names_only: bool = True) -> ModelChoice | None:
        """A --models-dir file or a stored model by that name (None: neither); a path only when not
        `names_only`. Remembered for LOOKUP_SECONDS: a client that names a hosted model on every
        request does not rescan the stores each time."""
        key = (name, names_only)
        now = time.monotonic()
        if key in self._looked_up and now - self._looked_up[key][0] < LOOKUP_SECONDS:
            return self._looked_up[key][1]
        found = self._lookup(name, names_only)
        self._looked_up[key] = (now, found)
        return found

    def _lookup(self, name: str, names_only: bool) -> ModelChoice | None:
        if self.models_dir is not None:
            for path in self._dir_files():
                if model_stem(path).lower() == name.lower() or path.name == name:
                    return self._same_as_default(ModelChoice(model_stem(path), path))
        try:
            path, _ = resolve(name, self._stores, names_only)
        except ModelLoadError:
            return None
        return self._same_as_default(ModelChoice(name, path)) if path.is_file() else None

    def _same_as_default(self, choice: ModelChoice) -> ModelChoice:
        return self.default if choice.key == self.default.key else choice

    def _dir_files(self) -> list[Path]:
        if self.models_dir is None or not self.models_dir.is_dir():
            return []
        return sorted(p for p in self.models_dir.glob("*.gguf") if p.is_file())

    def listing(self) -> list[ModelChoice]:
        """Every model a request may name: the startup model, the aliases, --models-dir, the stores."""
        out = [self.default]
        for name, alias in self.aliases.items():
            found = self._file(alias.target, names_only=False)
            if found is not None:
                out.append(ModelChoice(name, found.path, alias.overrides))
        out += [self._same_as_default(ModelChoice(model_stem(p), p)) for p in self._dir_files()]
        for store in self._stores if self._stores is not None else stores():
            out += [ModelChoice(found.name, found.path) for found in store.models()]
        unique: dict[str, ModelChoice] = {}
        for choice in out:
            unique.setdefault(choice.name, choice)
        return list(unique.values())


def file_header(path: Path) -> dict[str, Any]:
    """What /v1/models says of a model not loaded: its family, architecture and trained context,
    from the GGUF header (read once per file version)."""
    try:
        stat = path.stat()
    except OSError:
        return {}
    return _header(str(path), stat.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _header(path: str, mtime_ns: int) -> dict[str, Any]:
    try:
        gguf = GGUFFile(path)
    except ModelLoadError as exc:
        return {"problem": str(exc), "modified": mtime_ns // 10**9}
    try:
        md = gguf.metadata
        arch = str(md.get("general.architecture", ""))
        family = FAMILIES.get(arch)
        context = md.get(f"{arch}.context_length")
        try:
            parameters: int | None = ModelConfig.from_gguf(gguf).n_params
        except (ModelLoadError, KeyError, ValueError):  # an architecture lmserve does not serve
            parameters = None
        return {"family": family.name if family else None, "architecture": arch,
                "trained_context": None if context is None else int(context), "file_bytes": gguf.file_bytes,
                "modified": mtime_ns // 10**9, "parameters": parameters, "quant": file_quant(gguf),
                "pooling": md.get(f"{arch}.pooling_type"), "template": str(md.get("tokenizer.chat_template") or "")}
    finally:
        gguf.close()
