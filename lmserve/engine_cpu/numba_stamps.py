"""A cached kernel is compiled again when a kernel it calls changes, not only when its own file does.

Numba keys a cache file on the source of the one module that defines the function (a hash of
that file). But a caller's cached code holds its own copies of the kernels it calls in other
modules (`numba_linking`), and their constants. So after an edit or a `git pull` that changed
only `int8_kernels.py`, `decode_layer_kernel`'s cached decode layer still ran the old products:
other arithmetic than the same code compiled fresh. Here the stamp of a file of this package also
covers the package's modules that it imports, transitively.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

from numba.core.caching import _SourceFileBackedLocatorMixin

_PACKAGE = "lmserve.engine_cpu"
_HERE = Path(__file__).resolve().parent


def imported_siblings(path: Path) -> set[Path]:
    """The files beside `path` that it imports as modules of this package (by absolute name)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.ImportFrom) and node.module == _PACKAGE:
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(_PACKAGE + "."):
            names.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            names |= {alias.name.split(".")[2] for alias in node.names if alias.name.startswith(_PACKAGE + ".")}
    return {sibling for name in names if (sibling := path.parent / f"{name}.py").is_file()}


def source_stamp(path: Path) -> bytes:
    """A hash of `path` and of every sibling it imports, directly or through another sibling."""
    seen, todo = set(), [path]
    while todo:
        file = todo.pop()
        if file not in seen:
            seen.add(file)
            todo.extend(imported_siblings(file))
    digest = hashlib.sha256()
    for file in sorted(seen):
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.digest()


_numba_stamp = _SourceFileBackedLocatorMixin.get_source_stamp


@functools.cache
def _stamp_of(py_file: str) -> bytes:
    return source_stamp(Path(py_file))


def _get_source_stamp(self: _SourceFileBackedLocatorMixin) -> object:
    """This package's files get `source_stamp` (once a process: every kernel asks at its import);
    any other Numba's own."""
    py_file = Path(self._py_file).resolve()  # noqa: SLF001
    return _stamp_of(str(py_file)) if py_file.parent == _HERE else _numba_stamp(self)


_SourceFileBackedLocatorMixin.get_source_stamp = _get_source_stamp
