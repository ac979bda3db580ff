"""A fast, memory-mapped GGUF reader.

`gguf.GGUFReader` builds a NumPy view for every part of every metadata field; on a 50k-token
vocabulary that takes seconds, most of the startup budget. This reader parses the header, the
metadata and the tensor table in one pass over a memory map (string arrays are sliced straight
out of the map), and leaves tensor data in place until asked. Dequantization is the `gguf`
package's own (`gguf.quants.dequantize`), so every quant type it knows is supported here.
"""

from __future__ import annotations

import hashlib
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


class ModelLoadError(Exception):
    """A model file that cannot be served; the message is one line meant for the user."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file. `shape` is in NumPy order (GGUF's dims reversed)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


class GGUFFile:
    """Metadata and tensor table of one GGUF file, over a read-only memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():  # a directory or a FIFO (whose open would block) is refused here
            problem = "is not a regular file" if self.path.exists() else "not found"
            raise ModelLoadError(f"model file {problem}: {self.path}")
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read model file {self.path}: {exc}") from None
        self._buf = memoryview(self._map)
        if bytes(self._buf[:4]) != GGUF_MAGIC:
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
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, self._pos)
            self._pos += 8 * n_dims
            qtype = GGMLQuantizationType(self._scalar("I"))
            offset = self._scalar("Q")
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape)) if shape else 1
            nbytes = n // block * type_size
            start = data_start + offset
            if start + nbytes > len(self._map):
                raise ModelLoadError(f"truncated GGUF file {self.path}: tensor {name} runs past the end")
            self.tensors[name] = TensorInfo(name, shape, qtype, start, nbytes)
        del self._pos

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("Q")
        text = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8", errors="replace")
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
                arr = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos).copy()
                self._pos += arr.nbytes
                return arr
            return [self._value(item_type) for _ in range(count)]
        if vtype in _SCALAR_FORMATS:
            return self._scalar(_SCALAR_FORMATS[vtype])
        raise ValueError(f"unknown metadata value type {vtype}")

    def _string_array(self, count: int) -> list[str]:
        buf, pos, out = self._buf, self._pos, []
        unpack = struct.Struct("<Q").unpack_from
        append = out.append
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self._pos = pos
        return out

    # -- tensors -----------------------------------------------------------------------------

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (a view into the memory map, no copy)."""
        info = self.tensors[name]
        return self._map[info.offset:info.offset + info.nbytes]

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
        """SHA-256 of everything before the tensor data (metadata and tensor table): a fingerprint
        of the model that changes when the file is replaced, computed without reading weights."""
        end = min((t.offset for t in self.tensors.values()), default=len(self._map))
        return hashlib.sha256(self._buf[:end]).hexdigest()

    def quant_mix(self) -> dict[str, int]:
        """Number of tensors per storage type, for the startup banner."""
        mix: dict[str, int] = {}
        for info in self.tensors.values():
            mix[info.qtype.name] = mix.get(info.qtype.name, 0) + 1
        return dict(sorted(mix.items(), key=lambda kv: -kv[1]))

    def close(self) -> None:
        self._buf.release()
        self._map._mmap.close()  # type: ignore[attr-defined]
