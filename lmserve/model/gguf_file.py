"""A fast, memory-mapped GGUF reader.

`gguf.GGUFReader` builds a NumPy view for every part of every metadata field; on a 50k-token
vocabulary that takes seconds, most of the startup budget. This reader parses the header, the
metadata and the tensor table in one pass over a memory map (string arrays are sliced straight
out of the map), and leaves tensor data in place until asked. Dequantization is the `gguf`
package's own (`gguf.quants.dequantize`), so every quant type it knows is supported here.

A split model (llama.cpp's `gguf-split`: `name-00001-of-00003.gguf` ...) reads as one file: part 1
holds the metadata, every part a share of the tensors, and each tensor records the part it is in.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format of one scalar.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# gguf-split's metadata and file names (llama.cpp's llama_split_path: "%s-%05d-of-%05d.gguf").
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


class ModelLoadError(Exception):
    """A model file that cannot be served; the message is one line meant for the user."""

    reported = False  # already printed (each rank of a distributed group says it before exiting)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file. `shape` is in NumPy order (GGUF's dims reversed)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in `file`
    nbytes: int
    file: Path  # the file that holds it: the model's, or one part of a split model


    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


def model_stem(path: Path) -> str:
    """The model's name in a file name: `m.gguf` and the split parts `m-00001-of-00002.gguf` -> `m`."""
    return SPLIT_NAME.sub("", path.name) if SPLIT_NAME.search(path.name) else path.stem


def split_part_paths(path: Path, count: int) -> list[Path]:
    """The paths of all `count` parts of the split model that `path` is one part of."""
    if not SPLIT_NAME.search(path.name):
        raise ModelLoadError(f"{path.name} is one of {count} parts of a split model but is not named like one "
                             f"(NAME-00001-of-{count:05d}.gguf), so its other parts cannot be found")
    return [path.with_name(f"{model_stem(path)}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class GGUFFile:
    """Metadata and tensor table of a GGUF model, over read-only memory maps: one file, or all
    the parts of a split model (given any one of them), which then read as one file."""

    def __init__(self, path: str | Path) -> None:
        part = _Part(Path(path))
        count = int(part.metadata.get(SPLIT_COUNT, 1))
        parts = [part]
        if count > 1:
            paths = split_part_paths(part.path, count)
            parts = [part if p == part.path else _open_part(p, i, count) for i, p in enumerate(paths)]
            for i, each in enumerate(parts):
                _check_part(each, i, count, paths[0])
        self.path = parts[0].path
        self.version = parts[0].version
        self.metadata = parts[0].metadata
        self.tensors: dict[str, TensorInfo] = {}
        for part in parts:
            for info in part.tensors:
                if info.name in self.tensors:
                    raise ModelLoadError(f"split model {self.path.name}: tensor {info.name} is in two parts")
                self.tensors[info.name] = info
        expected = int(self.metadata.get(SPLIT_TENSORS, len(self.tensors)))
        if count > 1 and len(self.tensors) != expected:
            raise ModelLoadError(f"split model {self.path.name}: its {count} parts hold {len(self.tensors)} "
                                 f"tensors, {SPLIT_TENSORS} says {expected}")
        self._parts = parts
        self._maps = {part.path: part.map for part in parts}

    @property
    def file_bytes(self) -> int:
        """Bytes on disk, all parts together."""
        return sum(len(part.map) for part in self._parts)

    # -- tensors -----------------------------------------------------------------------------

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (a view into the memory map, no copy)."""
        info = self.tensors[name]
        return self._maps[info.file][info.offset:info.offset + info.nbytes]

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in NumPy order, whatever its storage type."""
        info = self.tensors[name]
        raw = self.raw(name)
        if info.qtype == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(info.shape).copy()
        if info.qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(info.shape).astype(np.float32)
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        rows = raw.reshape(-1, info.shape[-1] // block * type_size)
        return gguf_quants.dequantize(rows, info.qtype).reshape(info.shape).astype(np.float32, copy=False)

    def header_digest(self) -> str:
        """SHA-256 of everything before the tensor data (metadata and tensor table) of every part:
        a fingerprint of the model that changes when the file is replaced, computed without reading
        weights."""
        digest = hashlib.sha256()
        for part in self._parts:
            digest.update(part.buf[:min((t.offset for t in part.tensors), default=len(part.map))])
        return digest.hexdigest()

    def quant_mix(self) -> dict[str, int]:
        """Number of tensors per storage type, for the startup banner."""
        mix: dict[str, int] = {}
        for info in self.tensors.values():
            mix[info.qtype.name] = mix.get(info.qtype.name, 0) + 1
        return dict(sorted(mix.items(), key=lambda kv: -kv[1]))

    def close(self) -> None:
        for part in self._parts:
            part.close()


def _open_part(path: Path, index: int, count: int) -> _Part:
    if not path.is_file():
        raise ModelLoadError(f"split model {model_stem(path)}: part {index + 1} of {count} is missing ({path} not found)")
    return _Part(path)


def _check_part(part: _Part, index: int, count: int, first: Path) -> None:
    """A part must say it is part `index` (0-based) of `count`, as gguf-split numbers them."""
    said = (part.metadata.get(SPLIT_NO), part.metadata.get(SPLIT_COUNT))
    if said != (index, count):
        raise ModelLoadError(f"split model {first.name}: {part.path.name} should be part {index + 1} of {count} "
                             f"but its metadata says {SPLIT_NO} {said[0]}, {SPLIT_COUNT} {said[1]}")


class _Part:
    """One GGUF file: its header, metadata and tensor table parsed over a read-only memory map."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():  # a directory or a FIFO (whose open would block) is refused here
            problem = "is not a regular file" if self.path.exists() else "not found"
            raise ModelLoadError(f"model file {problem}: {self.path}")
        try:
            self.map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read model file {self.path}: {exc}") from None
        self.buf = memoryview(self.map)
        if bytes(self.buf[:4]) != GGUF_MAGIC:
            raise ModelLoadError(f"not a GGUF file (bad magic number): {self.path}")
        try:
            self._parse()
        except (struct.error, IndexError, ValueError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"corrupt or truncated GGUF file {self.path}: {exc}") from None

    # -- parsing -----------------------------------------------------------------------------

    def _parse(self) -> None:
        self._pos = 4
        self.version = self._scalar("I")
        if self.version < 2:
            raise ModelLoadError(f"GGUF version {self.version} is not supported (2 or newer): {self.path}")
        n_tensors = self._scalar("Q")
        n_kv = self._scalar("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("I")
            dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self._pos)
            self._pos += 8 * n_dims
            qtype = GGMLQuantizationType(self._scalar("I"))
            offset = self._scalar("Q")
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: list[TensorInfo] = []
        for name, shape, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape)) if shape else 1
            nbytes = n // block * type_size
            start = data_start + offset
            if start + nbytes > len(self.map):
                raise ModelLoadError(f"truncated GGUF file {self.path}: tensor {name} runs past the end")
            self.tensors.append(TensorInfo(name, shape, qtype, start, nbytes, self.path))
        del self._pos

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("Q")
        text = bytes(self.buf[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return text

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type = self._scalar("I")
            count = self._scalar("Q")
            if item_type == _STRING:
                return self._string_array(count)
            if item_type in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[item_type]).newbyteorder("<")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self._pos).copy()
                self._pos += arr.nbytes
                return arr
            return [self._value(item_type) for _ in range(count)]
        if vtype in _SCALAR_FORMATS:
            return self._scalar(_SCALAR_FORMATS[vtype])
        raise ValueError(f"unknown metadata value type {vtype}")

    def _string_array(self, count: int) -> list[str]:
        buf, pos, out = self.buf, self._pos, []
        unpack = struct.Struct("<Q").unpack_from
        append = out.append
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self._pos = pos
        return out

    def close(self) -> None:
        self.buf.release()
        self.map._mmap.close()  # type: ignore[attr-defined]
