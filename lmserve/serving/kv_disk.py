"""The disk tier of the KV slot pool: spilled caches that survive restarts.

One file per spilled slot: a magic line, a JSON header (the model's fingerprint, KV geometry,
token ids, payload size, and a SHA-256 digest of all of them with the payload) and the engine's
own saved cache as payload. Files are written in a temporary folder and renamed into place, so a
crash never leaves a half-written file under a real name (and the folders a killed server left
are swept at the next start); a file that is truncated, corrupt or edited (its digest no longer
matches: one token id changed in its header would otherwise serve its KV for another prompt) is
skipped with a warning and never served, and so is anything in the directory that is not a
regular file (a dangling link, a FIFO that would block a read forever).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lmserve.engine.protocol import Engine, KVCache

log = logging.getLogger("lmserve.kv")

MAGIC = b"LMSERVE-KV 1\n"
SUFFIX = ".lmkv"
MIN_SPILL_TOKENS = 16  # shorter prefixes are cheaper to recompute than to keep on disk
TEMP_PREFIX = "lmkv-tmp-"  # a spill's or restore's working folder
STALE_TEMP_S = 600  # such a folder untouched this long was left by a server that died mid-spill


@dataclass
class DiskEntry:
    path: Path
    tokens: tuple[int, ...]
    payload_offset: int
    payload_size: int
    digest: str  # SHA-256 of the model, geometry, token ids and payload (`_digest`)
    shared: int = 0  # filled in by best_match for the prompt at hand


class DiskTier:
    """Index of this model's spilled caches in one directory, least recently used beyond `max_files`."""

    def __init__(self, directory: Path, fingerprint: str, geometry: list, max_files: int = 8) -> None:
        self.dir = Path(directory)
        self.fingerprint = fingerprint
        self.geometry = geometry
        self.max_files = max(1, max_files)
        self.dir.mkdir(parents=True, exist_ok=True)
        if not os.access(self.dir, os.W_OK):
            raise PermissionError(f"KV cache directory is not writable: {self.dir}")
        self._entries: dict[Path, DiskEntry] = {}
        self._scan()

    def __len__(self) -> int:
        return len(self._entries)

    # -- index -------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Sweep stale working folders, then index this model's files: others are ignored, broken
        ones and anything that is not a regular file skipped with a warning."""
        found: list[tuple[float, Path]] = []
        for path in self.dir.iterdir():
            try:
                info = path.lstat()
            except OSError:
                continue
            if path.name.startswith(TEMP_PREFIX) and stat.S_ISDIR(info.st_mode):
                if time.time() - info.st_mtime > STALE_TEMP_S:
                    shutil.rmtree(path, ignore_errors=True)
                    log.warning("removed %s, left by a server stopped while spilling a KV cache", path)
            elif path.suffix == SUFFIX and not stat.S_ISREG(info.st_mode):
                log.warning("skipping KV cache entry %s: not a regular file", path)
            elif path.suffix == SUFFIX:
                found.append((info.st_mtime, path))
        for _, path in sorted(found):
            entry = self._read_header(path)
            if entry is not None:
                self._entries[path] = entry
        self._trim()

    def _digest(self, tokens: list[int] | tuple[int, ...]) -> hashlib._Hash:
        """A digest of this model's file for `tokens`, its payload still to be fed to it."""
        digest = hashlib.sha256()
        digest.update(json.dumps([self.fingerprint, self.geometry, list(tokens)]).encode())
        return digest

    def _read_header(self, path: Path) -> DiskEntry | None:
        try:
            if not stat.S_ISREG(path.lstat().st_mode):
                raise ValueError("not a regular file")
            with open(path, "rb") as f:
                if f.readline() != MAGIC:
                    raise ValueError("bad magic")
                header = json.loads(f.readline())
                offset = f.tell()
            if header["fingerprint"] != self.fingerprint or header["geometry"] != self.geometry:
                return None  # another model's cache: not ours to serve or delete
            size = int(header["payload_size"])
            if path.stat().st_size != offset + size:
                raise ValueError(f"truncated: expected {offset + size} bytes")
            return DiskEntry(path, tuple(int(t) for t in header["tokens"]), offset, size, str(header["digest"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("skipping unreadable KV cache file %s: %s", path, exc)
            return None

    def best_match(self, prompt: list[int]) -> DiskEntry | None:
        """The file sharing the longest prefix with `prompt` (its `shared` set), if any shares one."""
        best: DiskEntry | None = None
        for entry in self._entries.values():
            n = 0
            for a, b in zip(entry.tokens, prompt, strict=False):
                if a != b:
                    break
                n += 1
            if n and (best is None or n > best.shared):
                entry.shared = n
                best = entry
        return best

    # -- spill and restore -------------------------------------------------------------------

    def spill(self, cache: KVCache, tokens: list[int], engine: Engine) -> None:
        """Write a slot's cache; failures only log (the slot is reset either way)."""
        if len(tokens) < MIN_SPILL_TOKENS or cache.length != len(tokens):
            return
        name = hashlib.sha256(f"{self.fingerprint}|{tokens}".encode()).hexdigest()[:24] + SUFFIX
        path = self.dir / name
        if path in self._entries:
            os.utime(path)
            return
        try:
            with tempfile.TemporaryDirectory(dir=self.dir, prefix=TEMP_PREFIX) as tmp:
                payload = Path(tmp) / "payload"
                engine.save_cache(cache, payload)
                digest = self._digest(tokens)
                with open(payload, "rb") as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                header = {"fingerprint": self.fingerprint, "geometry": self.geometry, "tokens": tokens,
                          "payload_size": payload.stat().st_size, "digest": digest.hexdigest()}
                partial = Path(tmp) / name
                with open(partial, "wb") as out, open(payload, "rb") as src:
                    out.write(MAGIC + json.dumps(header).encode() + b"\n")
                    shutil.copyfileobj(src, out)
                os.replace(partial, path)
        except OSError as exc:
            log.warning("could not spill a KV cache to %s: %s", self.dir, exc)
            return
        entry = self._read_header(path)
        if entry is not None:
            self._entries[path] = entry
        self._trim()

    def load(self, entry: DiskEntry, engine: Engine, max_tokens: int) -> KVCache | None:
        """The cache stored in `entry`, or None (and the entry dropped) when it cannot be read."""
        try:
            with tempfile.TemporaryDirectory(dir=self.dir, prefix=TEMP_PREFIX) as tmp:
                payload = Path(tmp) / "payload"
                digest = self._digest(entry.tokens)
                with open(entry.path, "rb") as src, open(payload, "wb") as out:
                    src.seek(entry.payload_offset)
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
                if payload.stat().st_size != entry.payload_size:
                    raise ValueError("truncated payload")
                if digest.hexdigest() != entry.digest:
                    raise ValueError("its digest does not match its token ids and payload (edited or damaged)")
                cache = engine.load_cache(payload, max_tokens)
            if cache.length != len(entry.tokens):
                raise ValueError(f"holds {cache.length} positions, header says {len(entry.tokens)}")
        except Exception as exc:  # a damaged file must never take a request down
            log.warning("skipping unreadable KV cache file %s: %s", entry.path, exc)
            self._entries.pop(entry.path, None)
            return None
        os.utime(entry.path)
        self._entries[entry.path] = self._entries.pop(entry.path)  # most recent last
        return cache

    def _trim(self) -> None:
        while len(self._entries) > self.max_files:
            oldest = next(iter(self._entries))
            self._entries.pop(oldest)
            try:
                oldest.unlink()
            except OSError as exc:
                log.warning("could not remove old KV cache file %s: %s", oldest, exc)
