"""Converted weights on disk, so that only the first start of a K-quant model pays for conversion.

One safetensors file per (GGUF file, compute dtype), named after the GGUF and keyed by its size,
modification time and a hash of its header (metadata and tensor table): a file replaced under
the same name gets a new key, and the stale entry is removed when the new one is written.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from pathlib import Path

import mlx.core as mx

from lmserve.engine_mlx.weights import Choice
from lmserve.model.gguf_file import GGUFFile

FORMAT = "lmserve-mlx-weights-1"  # bump when the conversion changes what it produces

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/lmserve`, else `~/.cache/lmserve`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lmserve"


def cache_path(gguf: GGUFFile, dtype: mx.Dtype, cache_dir: Path, part: str = "") -> Path:
    """Where the file's converted weights go; `part` names a subset (a pipeline rank's layers),
    cached apart from the whole file's."""
    stat = gguf.path.stat()
    key = f"{FORMAT}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}|{gguf.header_digest()}" + (f"|{part}" if part else "")
    stem = f"{gguf.path.stem}.{part}" if part else gguf.path.stem
    return cache_dir / "mlx" / f"{stem}.{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"


def load(path: Path) -> tuple[dict[str, mx.array], dict[str, Choice]] | None:
    """The cached arrays and choices, or None when absent or unreadable."""
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


def save(path: Path, arrays: dict[str, mx.array], choices: dict[str, Choice]) -> None:
    """Write atomically and drop older entries for the same model; a failure only logs."""
    metadata = {"format": FORMAT,
                "choices": json.dumps({k: [c.source, c.bits, c.group_size, c.how, c.mode] for k, c in choices.items()})}
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as f:
            mx.save_safetensors(f, arrays, metadata)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        log.warning("could not cache converted weights in %s: %s", path.parent, exc)
        tmp.unlink(missing_ok=True)
        return
    stem = path.name.removesuffix(".safetensors").rsplit(".", 1)[0]
    for old in path.parent.glob(f"{glob.escape(stem)}.*.safetensors"):
        if old != path and old.name.removesuffix(".safetensors").rsplit(".", 1)[0] == stem:
            old.unlink(missing_ok=True)
