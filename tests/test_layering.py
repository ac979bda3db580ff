"""The package layering of docs/LMSERVER.md holds: imports run one way, HTTP reaches the worker
only through the request handle, engines are used only through their protocol and the runtime
through its own methods."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

PACKAGE = Path(__file__).resolve().parents[1] / "lmserve"
# Top to bottom: each layer may import only from the layers after it.
LAYERS = ["cli|config_file", "http", "pool", "runtime", "settings", "serving", "chat", "engine_cpu|engine_mlx|engine", "core", "model"]
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


# What outer layers may not reach into: the runtime's parts, and an engine's attributes by probing.
RUNTIME_PARTS = ("scheduler", "slots")


def test_nothing_probes_an_engine_or_the_runtime_for_what_it_has():
    """Engines are used through the Engine protocol (its lifecycle included), never by asking
    getattr / hasattr whether this one has a method; outer layers read Runtime.status(), not the
    runtime's scheduler and slot pool."""
    probes, reaches = [], []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "hasattr") and node.args:
                target = ast.unparse(node.args[0])
                if "engine" in target or "runtime" in target:
                    probes.append(f"{path.name}: {ast.unparse(node)}")
            if path.name != "runtime.py" and isinstance(node, ast.Attribute) and node.attr in RUNTIME_PARTS \
                    and ast.unparse(node.value).endswith("runtime"):
                reaches.append(f"{path.name}: {ast.unparse(node)}")
    assert probes == [] and reaches == []


def test_help_names_the_quant_types_the_engines_keep():
    """`--help` and docs/MODELS.md say which types each engine keeps from `families`' lists,
    so that they need not import an engine: these must be the engines' own sets."""
    from gguf import GGMLQuantizationType

    from lmserve.engine_cpu.encodings import encoding_of
    from lmserve.engine_mlx.weights import NATIVE_TYPES
    from lmserve.model.families import CPU_KEPT_TYPES, MLX_NATIVE_TYPES

    assert set(CPU_KEPT_TYPES) == {t.name for t in GGMLQuantizationType if encoding_of(t, 256) is not None}
    assert set(MLX_NATIVE_TYPES) == {t.name for t in NATIVE_TYPES}
