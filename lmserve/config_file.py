"""Flags from a TOML file, so a service started without arguments (`brew services start lmserve`)
serves the model and settings its user chose.

The file is `--config FILE`, else `$XDG_CONFIG_HOME/lmserve/config.toml` (`~/.config/...`) when it
exists. Its keys are the long flag names without dashes (`kv-slots`, or `kv_slots`), and `model`;
their values become the flags' defaults, so a flag on the command line wins. An unknown key, or a
value the flag would refuse, is an error naming the key and the file.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from pathlib import Path
from typing import Any

from lmserve.model.gguf_file import ModelLoadError
from lmserve.model.resolve import resolve

# Flags that act rather than set: not config keys.
ACTIONS = {"help", "version", "config", "list", "print_config"}
KINDS = {int: "an integer", float: "a number", str: "a string"}


def default_path() -> Path:
    """`$XDG_CONFIG_HOME/lmserve/config.toml`, else `~/.config/lmserve/config.toml`."""
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "lmserve" / "config.toml"


def settings(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Config key (the long flag name without dashes; a positional's name) -> its flag."""
    out = {}
    for action in parser._actions:
        if action.dest not in ACTIONS:
            longs = [s[2:] for s in action.option_strings if s.startswith("--")]
            out[longs[0] if longs else action.dest] = action
    return out


def parse_args_with_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse `argv` over the config file's values; `args.config` is the file read (None: none).
    With --print-config, print the effective settings and exit."""
    args = parser.parse_args(argv)
    path = args.config or default_path()
    if args.config is not None or path.is_file():
        values = read(path, settings(parser))
        parser.set_defaults(**values)
        args = parser.parse_args(argv)
        for dest, items in values.items():  # a repeatable flag given on the command line replaces the file's
            if isinstance(items, list) and len(getattr(args, dest)) > len(items):
                setattr(args, dest, getattr(args, dest)[len(items):])
        args.config = path
    if args.print_config:
        print(effective(parser, args))
        raise SystemExit(0)
    return args


def read(path: Path, known: dict[str, argparse.Action]) -> dict[str, Any]:
    """The file's values as argparse defaults (dest -> value), checked as the flags check theirs."""
    try:
        table = tomllib.loads(path.read_text())
    except OSError as exc:
        raise SystemExit(f"lmserve: cannot read config file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SystemExit(f"lmserve: config file {path} is not valid TOML: {exc}") from None
    values = {}
    for key, value in table.items():
        action = known.get(key.replace("_", "-")) or known.get(key)
        if action is None:
            raise SystemExit(f"lmserve: unknown key {key!r} in config file {path} "
                             f"(keys are long flag names without dashes: {', '.join(known)})")
        values[action.dest] = _value(action, value, f"{key!r} in config file {path}")
    return values


def _value(action: argparse.Action, value: Any, where: str) -> Any:
    if action.nargs == 0:  # an on/off flag (store_true, or store_false as --no-kv-reuse)
        if not isinstance(value, bool):
            raise SystemExit(f"lmserve: {where} must be true or false")
        return action.const if value else action.default
    if isinstance(action, argparse._AppendAction):
        return [_scalar(action, item, where) for item in (value if isinstance(value, list) else [value])]
    return _scalar(action, value, where)


def _scalar(action: argparse.Action, value: Any, where: str) -> Any:
    """One value converted and checked by the flag's own type and choices."""
    kind = action.type if action.type in (int, float) else str
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
        raise SystemExit(f"lmserve: {where} must be {KINDS[kind]}, not {value!r}")
    converted = action.type(value) if callable(action.type) else value
    if action.choices is not None and converted not in action.choices:
        raise SystemExit(f"lmserve: {where} must be one of {', '.join(map(str, action.choices))}, not {value!r}")
    return converted


def effective(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The settings in force, as a config file would write them (unset ones as comments)."""
    source = f"the command line over {args.config}" if args.config else f"the command line (no {default_path()})"
    lines = [f"# lmserve settings from {source}"]
    for key, action in settings(parser).items():
        value = getattr(args, action.dest)
        if action.nargs == 0:
            lines.append(f"{key} = {json.dumps(value == action.const)}")
        elif value is None or value == []:
            lines.append(f"# {key} is not set")
        elif key == "api-key":
            lines.append(f'{key} = "(set, not shown)"')
        else:
            lines.append(f"{key} = {_toml(value)}")
    if args.model:
        try:
            lines.append(f"# model file: {resolve(args.model)[0]}")
        except ModelLoadError as exc:
            lines.append(f"# model file: none ({exc})")
    return "\n".join(lines)


def _toml(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a TOML basic string
