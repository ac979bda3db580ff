"""Converted weights on disk, so that only the first start of a K-quant model pays for conversion.

One folder per (GGUF file, compute dtype), named after the GGUF and keyed by its size,
modification time and a hash of its header (metadata and tensor table): a file replaced under
the same name gets a new key, and the stale folder is removed when the new one is written. The
folder holds one safetensors file per part of the model (`base`: what is outside the layers; then
`layer-N`), so that a distributed rank converts, caches and reads only what it keeps: a pipeline
rank its layers, a tensor-parallel rank one layer at a time. `mx.load` reads lazily: a part's
arrays are read when evaluated.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import mlx.core as mx

from lmserve.engine_mlx.weights import Choice
from lmserve.model.gguf_file import GGUFFile

FORMAT = "lmserve-mlx-weights-2"  # bump when the conversion changes what it produces

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/lmserve`, else `~/.cache/lmserve`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lmserve"


def part_name(layer: int | None) -> str:
    """The file a part is cached in: `base` (outside the layers), or `layer-N`."""
    return "base" if layer is None else f"layer-{layer}"


class Entry:
    """One model's cached parts."""

    def __init__(self, gguf: GGUFFile, dtype: mx.Dtype, cache_dir: Path) -> None:
        stat = gguf.path.stat()
        key = f"{FORMAT}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}|{gguf.header_digest()}"
        self.stem = gguf.path.stem
        self.path = cache_dir / "mlx" / f"{self.stem}.{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        self._stale_dropped = False  # by the first part written

    def load(self, layer: int | None) -> tuple[dict[str, mx.array], dict[str, Choice]] | None:
        """A part's arrays and choices, or None when absent or unreadable."""
        path = self.path / f"{part_name(layer)}.safetensors"
        if not path.is_file():
            return None
        try:
            arrays, metadata = mx.load(str(path), return_metadata=True)
            if metadata.get("format") != FORMAT:
                return None
            choices = {k: Choice(*v) for k, v in json.loads(metadata["choices"]).items()}
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable weight cache %s: %s", path, exc)
            return None
        return arrays, choices

    def save(self, layer: int | None, arrays: dict[str, mx.array], choices: dict[str, Choice]) -> None:
        """Write a part atomically, dropping older folders of the same model; a failure only logs."""
        metadata = {"format": FORMAT,
                    "choices": json.dumps({k: [c.source, c.bits, c.group_size, c.how, c.mode] for k, c in choices.items()})}
        path = self.path / f"{part_name(layer)}.safetensors"
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
        try:
            if not self._stale_dropped:
                self._drop_stale()
                self._stale_dropped = True
            self.path.mkdir(parents=True, exist_ok=True)
            with tmp.open("wb") as f:
                mx.save_safetensors(f, arrays, metadata)
            os.replace(tmp, path)
        except (OSError, RuntimeError) as exc:
            log.warning("could not cache converted weights in %s: %s", self.path, exc)
            tmp.unlink(missing_ok=True)

    def _drop_stale(self) -> None:
        """Other keys' folders of this model (and files of the one-file format before it)."""
        for old in self.path.parent.glob(f"{glob.escape(self.stem)}.*"):
            if old != self.path and old.name.removesuffix(".safetensors").rsplit(".", 1)[0] == self.stem:
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink(missing_ok=True)
