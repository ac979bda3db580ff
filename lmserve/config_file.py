"""Settings from a TOML file, so a service started without arguments (`brew services start lmserve`)
serves the model and settings its user chose; and `--print-config`, the settings in force as such
a file would write them.

The file is `--config FILE`, else `$XDG_CONFIG_HOME/lmserve/config.toml` (`~/.config/...`) when it
exists. Its keys are the long flag names without dashes (`kv-slots`, or `kv_slots`), and `model`;
a flag on the command line wins over the file. An unknown key, or a value the flag would refuse,
is an error naming the key and the file (settings.py checks the ranges).

`[models.NAME]` tables name more models a request may ask for (docs/API.md, "Models by name"):
`model` is a path or a stored model's name, and the table may set that model's own `ctx`,
`kv-type`, `temp`, `chat-template`, `kv-slots`, `max-tokens` and `reasoning-budget`:

    [models.coder]
    model = "qwen3-coder:30b"
    ctx = 32768
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

from lmserve.model.gguf_file import ModelLoadError
from lmserve.settings import KEYS, Declared, ModelAlias, Settings, UsageError, check

KINDS = {int: "an integer", float: "a number", str: "a string", Path: "a string", list: "a list of strings"}
MODELS_TABLE = "models"
# The settings a `[models.NAME]` table may give its model.
MODEL_KEYS = ("ctx", "kv-type", "temp", "chat-template", "kv-slots", "max-tokens", "reasoning-budget")


def default_path() -> Path:
    """`$XDG_CONFIG_HOME/lmserve/config.toml`, else `~/.config/lmserve/config.toml`."""
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "lmserve" / "config.toml"


def _table(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"cannot read config file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"config file {path} is not valid TOML: {exc}") from None


def read(path: Path) -> dict[str, Any]:
    """The file's values by setting name, each of the setting's type (ranges are checked later);
    its `[models.NAME]` tables are checked here too (`model_aliases` reads them)."""
    table = _table(path)
    _aliases(table.get(MODELS_TABLE, {}), path)
    values = {}
    for key, value in table.items():
        if key == MODELS_TABLE:
            continue
        item = KEYS.get(key.replace("_", "-")) or KEYS.get(key)
        if item is None:
            raise UsageError(f"unknown key {key!r} in config file {path} "
                             f"(keys are long flag names without dashes: {', '.join(KEYS)})")
        values[item.name] = _typed(item, value, f"{key!r} in config file {path}")
    return values


def model_aliases(path: Path | None) -> dict[str, ModelAlias]:
    """The `[models.NAME]` tables of the config file (none without one)."""
    if path is None or not path.is_file():
        return {}
    return _aliases(_table(path).get(MODELS_TABLE, {}), path)


def _aliases(tables: Any, path: Path) -> dict[str, ModelAlias]:
    if not isinstance(tables, dict):
        raise UsageError(f"{MODELS_TABLE!r} in config file {path} must be tables: [models.NAME] with model = ...")
    out = {}
    for name, table in tables.items():
        where = f"[models.{name}] in config file {path}"
        if not isinstance(table, dict) or not isinstance(table.get("model"), str) or not table["model"]:
            raise UsageError(f"{where} needs model = \"a path or a stored model's name\"")
        overrides = {}
        for key, value in table.items():
            if key == "model":
                continue
            if key.replace("_", "-") not in MODEL_KEYS:
                raise UsageError(f"unknown key {key!r} in {where} (a model's own keys: {', '.join(MODEL_KEYS)})")
            item = KEYS[key.replace("_", "-")]
            typed = _typed(item, value, f"{key!r} in {where}")
            check(item, typed, f"{key!r} in {where}")
            overrides[item.name] = typed
        out[name] = ModelAlias(table["model"], overrides)
    return out


def _typed(item: Declared, value: Any, where: str) -> Any:
    if item.kind is bool:  # an on/off flag; `no-kv-reuse = true` turns kv_reuse off
        if not isinstance(value, bool):
            raise UsageError(f"{where} must be true or false")
        return value != item.spec.inverted
    if item.kind is list:
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in items):
            raise UsageError(f"{where} must be a string or {KINDS[list]}, not {value!r}")
        return items
    accepted = (int, float) if item.kind is float else str if item.kind is Path else item.kind
    if isinstance(value, bool) or not isinstance(value, accepted):
        raise UsageError(f"{where} must be {KINDS[item.kind]}, not {value!r}")
    return item.kind(value)


def effective(settings: Settings, model_file: str) -> str:
    """The settings in force, as a config file would write them (unset ones as comments)."""
    source = (f"the command line over {settings.config}" if settings.config
              else f"the command line (no {default_path()})")
    lines = [f"# lmserve settings from {source}"]
    for key, item in KEYS.items():
        value = getattr(settings, item.name)
        if item.kind is bool:
            lines.append(f"{key} = {json.dumps(value != item.spec.inverted)}")
        elif value is None or value == []:
            lines.append(f"# {key} is not set")
        elif key == "api-key":
            lines.append(f'{key} = "(set, not shown)"')
        else:
            lines.append(f"{key} = {_toml(value)}")
    lines.append(f"# model file: {model_file}")
    return "\n".join(lines)


def model_file_line(settings: Settings) -> str:
    """What `# model file:` says: the file a name resolves to, or the embedded default."""
    from lmserve.model.default_model import default_model_path
    from lmserve.model.resolve import resolve

    try:
        if not settings.model:
            return f"{default_model_path()} (the embedded default model)"
        return str(resolve(settings.model)[0])
    except ModelLoadError as exc:
        return f"none ({exc})"


def _toml(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a TOML basic string
