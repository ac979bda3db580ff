"""The package layering of docs/LMSERVER.md holds: imports run one way, and HTTP reaches the
worker only through the request handle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lmserve"
# Top to bottom: each layer may import only from the layers after it.
LAYERS = ["cli|config_file", "http", "runtime", "serving", "chat", "engine_cpu|engine_mlx|engine", "core", "model"]
# What HTTP may use of the layers beneath the runtime: the handle and the events it carries.
HTTP_MAY_USE = {"lmserve.serving.handle"}


def layer_of(module: str) -> int:
    part = module.split(".")[1] if module.count(".") else ""
    return next(i for i, names in enumerate(LAYERS) if part in names.split("|"))


def imports() -> list[tuple[str, str]]:
    """(importing module, imported lmserve module) for every import in the package."""
    out = []
    for path in PACKAGE.rglob("*.py"):
        module = "lmserve." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmserve."):
                out += [(module, node.module)]
            elif isinstance(node, ast.Import):
                out += [(module, a.name) for a in node.names if a.name.startswith("lmserve.")]
    return out


def test_imports_run_one_way():
    upward = [(a, b) for a, b in imports()
              if a.count(".") and b.count(".") and a.split(".")[1] != b.split(".")[1] and layer_of(a) > layer_of(b)]
    assert upward == []


def test_http_holds_requests_only_through_their_handle():
    reach = sorted({(a, b) for a, b in imports() if a.startswith("lmserve.http.")
                    and b.split(".")[1] in ("serving", "engine", "engine_cpu", "engine_mlx")
                    and b not in HTTP_MAY_USE})
    assert reach == []
