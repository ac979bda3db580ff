"""Ollama's model routes' payloads: `/api/tags` (every servable model), `/api/ps` (the resident
ones), `/api/show` (one model's details, template and capabilities), from GGUF headers.

A `digest` is the SHA-256 of the file's path, size and modification time: stable while the file
is, and cheap (Ollama's is its blob's hash, which would mean reading every file whole)."""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path
from typing import Any

from lmserve.http.ollama import timestamp
from lmserve.pool.directory import ModelChoice, file_header
from lmserve.pool.residents import Resident

# Ollama's `expires_at` for a model that stays: its own far-future stand-in.
NEVER = "2318-08-27T00:00:00Z"


def details(header: dict[str, Any]) -> dict[str, Any]:
    arch = header.get("architecture") or ""
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else None,
            "parameter_size": _count(header.get("parameters")), "quantization_level": header.get("quant", "")}


def _count(n: int | None) -> str:
    if not n:
        return ""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def digest(path: Path) -> str:
    try:
        stat = path.stat()
    except OSError:
        return ""
    return hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()


def tag(choice: ModelChoice) -> dict[str, Any]:
    header = file_header(choice.path)
    return {"name": choice.name, "model": choice.name, "modified_at": timestamp(header.get("modified", 0)),
            "size": header.get("file_bytes", 0), "digest": digest(choice.path), "details": details(header)}


def running(resident: Resident, keep_alive: float) -> dict[str, Any]:
    """One `/api/ps` entry: when it would be unloaded (never for the startup model)."""
    header = file_header(resident.choice.path)
    stays = resident.pinned or math.isinf(keep_alive)
    expires = NEVER if stays else timestamp(time.time() + keep_alive - (time.monotonic() - resident.last_used))
    size = resident.bytes
    on_gpu = resident.runtime.engine.name == "mlx"
    return {**tag(resident.choice), "name": resident.runtime.model.model_id, "model": resident.runtime.model.model_id,
            "size": size, "size_vram": size if on_gpu else 0, "expires_at": expires,
            "context_length": resident.runtime.ctx, "details": details(header)}


def show(choice: ModelChoice, parameters: str) -> dict[str, Any]:
    header = file_header(choice.path)
    template = header.get("template", "")
    arch = header.get("architecture") or ""
    capabilities = ["completion"] if not header.get("pooling") else ["embedding"]
    if "tools" in template:
        capabilities.append("tools")
    if "think" in template or "reasoning" in template:
        capabilities.append("thinking")
    info = {"general.architecture": arch, "general.parameter_count": header.get("parameters"),
            f"{arch}.context_length": header.get("trained_context")}
    return {"license": "", "modelfile": f"# lmserve serves this GGUF as it is\nFROM {choice.path}\n",
            "parameters": parameters, "template": template, "details": details(header), "model_info": info,
            "capabilities": capabilities, "modified_at": timestamp(header.get("modified", 0))}
