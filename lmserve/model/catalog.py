"""`lmserve-mac --list`: every model in the stores `resolve` searches, described from its GGUF header.

Only metadata and the tensor table are read (a memory map, no tensor data), so listing a store of
many large models takes a moment, not minutes.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import LlamaFileType

from lmserve.model.families import FAMILIES
from lmserve.model.gguf_file import GGUFFile, ModelLoadError
from lmserve.model.resolve import Found, Store, stores


@dataclass(frozen=True)
class Entry:
    """One stored model and what its header says."""

    found: Found
    size: int = 0  # bytes on disk, all parts of a split model together
    architecture: str = ""
    quant: str = ""
    context: int | None = None
    problem: str = ""  # why the file cannot be read ("" when it can)

    @property
    def supported(self) -> bool:
        return self.architecture in FAMILIES


def describe(found: Found) -> Entry:
    """What the GGUF's header says of the model: architecture, quant, trained context, size."""
    try:
        gguf = GGUFFile(found.path)
    except ModelLoadError as exc:
        return Entry(found, problem=str(exc))
    try:
        md = gguf.metadata
        arch = str(md.get("general.architecture", ""))
        context = md.get(f"{arch}.context_length")
        return Entry(found, gguf.file_bytes, arch, file_quant(gguf), None if context is None else int(context))
    finally:
        gguf.close()


def file_quant(gguf: GGUFFile) -> str:
    """The quant the file says it is (`general.file_type`), else its most common matrix type."""
    try:
        return LlamaFileType(int(gguf.metadata["general.file_type"])).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (KeyError, ValueError):
        matrices = [t.qtype.name for t in gguf.tensors.values() if len(t.shape) >= 2]
        return max(set(matrices), key=matrices.count) if matrices else ""


def catalog(searched: list[Store] | None = None) -> list[Entry]:
    """Every model in the stores, in lookup order."""
    return [describe(found) for store in (searched or stores()) for found in store.models()]


def listing() -> str:
    """What `--list` prints."""
    searched = stores()
    return render(catalog(searched), searched)


def render(entries: list[Entry], searched: list[Store]) -> str:
    """A table of the entries, then the folders that were searched."""
    header = ("NAME", "STORE", "SIZE", "ARCH", "QUANT", "CONTEXT", "SERVES", "PATH")
    rows = [header] + [
        (e.found.name, e.found.store, _size(e.size) if not e.problem else "", e.architecture or "?",
         e.quant, "" if e.context is None else str(e.context),
         "no (unreadable)" if e.problem else "yes" if e.supported else "no (architecture not supported)",
         f"{e.found.path} ({e.problem})" if e.problem else str(e.found.path))
        for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
             for row in rows] if entries else ["no stored models found"]
    lines.append("searched: " + "; ".join(f"{s.label}: " + ", ".join(map(str, s.dirs)) for s in searched))
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"
