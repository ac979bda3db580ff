"""Every server setting, declared once: its flag, config-file key, type, default, range and help.

`Settings` is the one typed object the rest of the server reads. The command line (argparse is
built from its fields here), the config file (config_file.py) and `--print-config` all go through
`parse_settings`, which checks every value against its declared range wherever it came from,
before any model is resolved or loaded. A bad value is a `UsageError`: one line naming the flag,
or the key and the file, and what is allowed; the CLI exits 2 with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmserve import __version__
from lmserve.core.duration import parse_duration
from lmserve.engine.kv_types import KV_TYPE_NAMES
from lmserve.serving.scheduler import PREFILL_CHUNK
from lmserve.serving.speculate import DEFAULT_MODE, MODES

DEFAULT_KV_SLOTS = 4  # resident KV caches when --kv-slots is not given (or --batch, when more)
BYTES_PER_CONTEXT_TOKEN = 16  # the least body room a context token needs (text + JSON escaping)


class UsageError(Exception):
    """A setting the server cannot run with: one line for the user, exit status 2."""


@dataclass(frozen=True)
class ModelAlias:
    """A config file's `[models.NAME]` table: the model it serves (a path or a stored model's name)
    and that model's own settings, by field name."""

    target: str
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Spec:
    """How one setting is given and what values it allows."""

    help: str
    flag: str | None = ""  # the long flag without dashes ("" : the field name with dashes; None: positional)
    low: float | None = None  # the least value allowed
    high: float | None = None  # the most
    above: float | None = None  # values must be more than this
    choices: tuple[str, ...] | None = None
    const: str | None = None  # the value of a bare `--flag` whose value is optional
    metavar: str | None = None
    inverted: bool = False  # an on/off flag that turns the setting off (`--no-kv-reuse`)
    must_be: str | None = None  # "file" or "dir": a path checked before anything loads
    key: bool = True  # also a config-file key (not for actions such as --list)


def setting(default: Any, help: str, **spec: Any) -> Any:
    """A `Settings` field with its `Spec`."""
    meta = {"spec": Spec(help, **spec)}
    if isinstance(default, list):
        return field(default_factory=list, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Settings:
    model: str | None = setting(
        None, "path to a .gguf file, or the name of a model in Ollama, LM Studio, the Hugging Face cache or "
              "llama.cpp's cache (see --list; default: embedded SmolLM2-135M-Instruct)", flag=None)
    host: str = setting("127.0.0.1", "address to listen on (default 127.0.0.1)")
    port: int = setting(8080, "port to listen on (default 8080; 0: any free port)", low=0, high=65535)
    ctx: int | None = setting(
        None, "context size in tokens (default: the model's trained context when one full KV slot of it fits "
              "in memory, else the largest multiple of 4096 that fits)", low=16, high=1 << 24)
    models_dir: Path | None = setting(
        None, "also serve the GGUF files in this folder, each by its file name without .gguf", metavar="DIR",
        must_be="dir")
    max_models: int = setting(
        0, "models resident at once; loading another unloads the least recently used idle one (default 0: as "
           "many as fit in memory)", low=0, metavar="N")
    keep_alive: str = setting(
        "5m", "unload a model loaded on demand after it has been idle this long: 30s, 5m, 1h, 0 (at once), -1 "
              "(never); the model the server started with stays (default 5m, as Ollama's)", metavar="DURATION")
    engine: str = setting("auto", "auto: MLX when it has a GPU, else the NumPy engine",
                          choices=("auto", "cpu", "mlx"))
    cpu_dots: str = setting(
        "auto", "how the NumPy engine multiplies activations with quantized weights: int8 quantizes them to "
                "int8 per block and multiplies integers, as llama.cpp does (one-row products 1.3-2.4x faster, logits "
                "within about 1% of float32's); float32 multiplies the file's values in float32, the same "
                "result on every CPU (default auto: int8 where the CPU has AVX-512 VNNI or AVX2, else float32; env "
                "LMSERVE_CPU_DOTS)", choices=("auto", "int8", "float32"))
    distributed: str | None = setting(
        None, "shard the model across the ranks mlx.launch starts: tensor (the default) or pipeline parallel "
              "(see docs/DISTRIBUTED.md)", choices=("tensor", "pipeline"), const="tensor")
    queue: int = setting(16, "requests that may wait for the worker (default 16)", low=1)
    batch: int = setting(1, "sequences decoded together (default 1)", low=1, high=256)
    prefill_chunk: int = setting(
        PREFILL_CHUNK, f"prompt tokens prefilled between two decode steps of the running streams "
                       f"(default {PREFILL_CHUNK}; 0: whole prompts at once)", low=0, metavar="N")
    speculate: str | None = setting(
        None, f"speculative decoding, the reply unchanged: ngram drafts from the prompt and reply so far, "
              f"draft from the --draft model; off decodes one token per step (default {DEFAULT_MODE} where the "
              f"engine verifies cheaply, off on MLX's CPU backend; draft with --draft)", choices=MODES)
    draft: Path | None = setting(
        None, "a small model with the same tokenizer that drafts tokens for the served one to verify",
        metavar="GGUF", must_be="file")
    max_tokens: int | None = setting(
        None, "reply budget of a request that sets none (default: the rest of the context)", low=1, metavar="N")
    reasoning_budget: int = setting(
        -1, "tokens a reply may reason when its request sets no budget (default -1: no budget of its own, at "
            "most 3/4 of the reply; 0: reasoning off)", low=-1, metavar="N")
    temp: float | None = setting(
        None, "temperature of a request that sets none (default: the model's recommended one)",
        low=0, high=2, metavar="T")
    sse_keepalive: float = setting(
        5.0, "a stream silent this long (queued, long prefill) gets a ping or SSE comment (default 5)",
        above=0, high=3600, metavar="SECONDS")
    kv_slots: int = setting(
        DEFAULT_KV_SLOTS, f"resident KV caches reused across requests (default {DEFAULT_KV_SLOTS}, or --batch when "
                       "more; at least --batch)", low=1)
    kv_slots_force: bool = setting(False, "keep --kv-slots even when the RAM guard finds they do not fit")
    kv_reuse: bool = setting(
        True, "prefill every prompt whole, reusing no cached prefix (to measure what reuse saves)",
        flag="no-kv-reuse", inverted=True)
    kv_type: str = setting(
        "auto", "what the KV cache stores keys and values as, llama-server's -ctk/-ctv names: q8_0 takes about "
                "half of f16's memory, q4_0 about a third (default auto: float32 on the NumPy engine, the "
                "compute dtype on MLX, which takes f32 or f16 only when that is its dtype)", choices=KV_TYPE_NAMES)
    kv_cache_dir: Path | None = setting(
        None, "spill evicted KV slots to files here; they survive restarts (off by default)", must_be="dir")
    kv_disk_slots: int = setting(8, "KV cache files kept on disk (default 8)", low=1)
    kv_checkpoints: int = setting(
        8, "hybrid models (Qwen3.5 / 3.6): recurrent-state checkpoints each KV slot keeps, the prefixes it can "
           "resume from (default 8; each costs one recurrent state)", low=1, high=256, metavar="N")
    conns: int = setting(32, "concurrent connections; beyond, 503 (default 32)", low=1)
    read_timeout: float = setting(
        30.0, "the most seconds a request's headers may take, and its body between two of its parts; "
              "beyond, 408 (default 30)",
        above=0, high=3600, metavar="SECONDS")
    api_key: str | None = setting(
        None, "require this key (Authorization: Bearer or x-api-key); env LMSERVE_API_KEY")
    allow_host: list[str] = setting(
        [], "accept this Host header on a loopback bind (repeatable)", metavar="HOST")
    max_body: int | None = setting(
        None, "largest request body in bytes; beyond, 413 (default: sized for the context, at least 4 MiB)",
        low=1024)
    cors: list[str] = setting([], "allow cross-origin requests from ORIGIN (repeatable; off by default)",
                              metavar="ORIGIN")
    chat_template: Path | None = setting(
        None, "a Jinja chat template to use instead of the one in the GGUF", metavar="FILE", must_be="file")
    config: Path | None = setting(
        None, "read settings from this TOML file (default: $XDG_CONFIG_HOME/lmserve/config.toml or "
              "~/.config/lmserve/config.toml, when it exists); the command line wins", metavar="FILE", key=False)
    list_models: bool = setting(
        False, "list the models in Ollama, LM Studio, the Hugging Face cache and llama.cpp's cache, and exit",
        flag="list", key=False)
    print_config: bool = setting(
        False, "check and print the settings in force (config file and command line), and exit", key=False)

    def with_resolved(self, **values: Any) -> Settings:
        """A copy with defaults that needed the loaded model filled in (ctx, speculate)."""
        return dataclasses.replace(self, **values)


@dataclass(frozen=True)
class Declared:
    """One field of `Settings` with its spec and value type."""

    name: str
    spec: Spec
    kind: type  # int, float, str, Path, bool or list (of str)
    default: Any

    @property
    def flag(self) -> str | None:
        if self.spec.flag is None:
            return None
        return "--" + (self.spec.flag or self.name.replace("_", "-"))

    @property
    def key(self) -> str:
        """The config-file key: the long flag without dashes (a positional: its name)."""
        return self.flag[2:] if self.flag else self.name


def _kind(hint: Any) -> type:
    """`int | None` -> int, `list[str]` -> list."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin is list:
        return list
    return _kind(args[0]) if args else hint


def declared() -> list[Declared]:
    hints = typing.get_type_hints(Settings)
    out = []
    for f in dataclasses.fields(Settings):
        default = [] if f.default_factory is list else f.default  # type: ignore[comparison-overlap]
        out.append(Declared(f.name, f.metadata["spec"], _kind(hints[f.name]), default))
    return out


DECLARED = declared()
BY_NAME = {d.name: d for d in DECLARED}
KEYS = {d.key: d for d in DECLARED if d.spec.key}


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _range_text(spec: Spec) -> str:
    if spec.choices:
        return "one of " + ", ".join(spec.choices)
    high = f" and at most {_number(spec.high)}" if spec.high is not None else ""
    if spec.above is not None:
        return f"more than {_number(spec.above)}{high}"
    if spec.low is not None and spec.high is not None:
        return f"from {_number(spec.low)} to {_number(spec.high)}"
    return f"at least {_number(spec.low)}" if spec.low is not None else f"at most {_number(spec.high)}"


def check(item: Declared, value: Any, where: str) -> None:
    """Refuse a value outside the declared range, naming `where` it came from."""
    spec = item.spec
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, list):
        for one in value:
            check(item, one, where)
        return
    wrong = (spec.choices is not None and value not in spec.choices
             or isinstance(value, float) and not math.isfinite(value)
             or isinstance(value, (int, float)) and (
                 spec.low is not None and value < spec.low or spec.high is not None and value > spec.high
                 or spec.above is not None and value <= spec.above))
    if wrong:
        raise UsageError(f"{where} must be {_range_text(spec)}, not {value!r}")
    if spec.must_be == "file" and not Path(value).expanduser().is_file():
        raise UsageError(f"{where} {value}: no such file")
    if spec.must_be == "dir" and Path(value).expanduser().exists() and not Path(value).expanduser().is_dir():
        raise UsageError(f"{where} {value}: exists and is not a directory")
    if item.kind is str and not value:
        raise UsageError(f"{where} must not be empty")


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are a UsageError (one line), not usage text and exit."""

    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(f"{message} (see lmserve-mac --help)")


def build_parser() -> argparse.ArgumentParser:
    """The command line, from the declarations. Defaults are suppressed, so the namespace holds
    only what was typed (the config file's values and the declared defaults go under it)."""
    p = _Parser(prog="lmserve-mac", argument_default=argparse.SUPPRESS,
                formatter_class=argparse.RawDescriptionHelpFormatter, description=(
        "Serve one GGUF model behind the OpenAI Chat Completions, OpenAI Responses and Anthropic Messages\n"
        "APIs. Without a model, serves the embedded SmolLM2-135M-Instruct."), epilog=_families_epilog())
    for item in DECLARED:
        spec = item.spec
        help_text = spec.help.replace("%", "%%")  # argparse expands `%` specifiers: "1% of" failed --help
        if item.flag is None:
            p.add_argument(item.name, nargs="?", help=help_text)
        elif item.kind is bool:
            p.add_argument(item.flag, dest=item.name, action="store_false" if spec.inverted else "store_true",
                           help=help_text)
        else:
            kwargs: dict[str, Any] = {"dest": item.name, "help": help_text, "metavar": spec.metavar,
                                      "type": _converter(item)}
            if spec.choices:
                kwargs |= {"choices": spec.choices, "metavar": None}
            if spec.const is not None:
                kwargs |= {"nargs": "?", "const": spec.const}
            if item.kind is list:
                kwargs["action"] = "append"
            p.add_argument(item.flag, **kwargs)
    p.add_argument("--version", action="version", version=f"lmserve {__version__}")
    return p


NUMBER_NAMES = {int: "an integer", float: "a number"}


def _converter(item: Declared) -> Any:
    """The flag's text to its type; a number that does not parse is refused with the range."""
    if item.kind not in NUMBER_NAMES:
        return str if item.kind is list else item.kind

    def convert(text: str) -> Any:
        try:
            return item.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {NUMBER_NAMES[item.kind]} {_range_text(item.spec)}, not {text!r}") from None
    return convert


def _families_epilog() -> str:
    from lmserve.model.families import support_summary

    return "\n\n".join(textwrap.fill(paragraph, 100) for paragraph in support_summary().split("\n"))


def parse_settings(argv: list[str] | None = None, env: dict[str, str] | None = None) -> Settings:
    """The settings in force: declared defaults, under the config file's, under the command line's;
    every value checked (naming its flag or its key and file) before anything is resolved."""
    from lmserve import config_file

    env = os.environ if env is None else env
    typed = vars(build_parser().parse_args(argv))
    path = typed.get("config") or config_file.default_path()
    values: dict[str, Any] = {"api_key": env.get("LMSERVE_API_KEY") or None}
    where: dict[str, str] = {}
    if "config" in typed or path.is_file():
        from_file = config_file.read(path)
        values |= from_file
        where |= {name: f"{BY_NAME[name].key!r} in config file {path}" for name in from_file}
        typed["config"] = path
    values |= typed  # the command line wins, and is what an error then names
    where |= {name: BY_NAME[name].flag or name for name in typed}
    for name, value in values.items():
        check(BY_NAME[name], value, where.get(name, BY_NAME[name].flag or name))
    settings = Settings(**values)
    return _cross_checked(settings, set(where), lambda name: where.get(name, BY_NAME[name].flag or name))


def _cross_checked(settings: Settings, given: set[str], where: typing.Callable[[str], str]) -> Settings:
    """Rules between settings: slots for every batched sequence; a body that holds the context."""
    if "kv_slots" not in given:
        settings = dataclasses.replace(settings, kv_slots=max(DEFAULT_KV_SLOTS, settings.batch))
    elif settings.kv_slots < settings.batch:
        raise UsageError(f"{where('kv_slots')} {settings.kv_slots} must be at least {where('batch')} "
                         f"{settings.batch}: each sequence decoded together holds a KV slot")
    if settings.max_body is not None and settings.ctx is not None:
        need = settings.ctx * BYTES_PER_CONTEXT_TOKEN
        if settings.max_body < need:
            raise UsageError(f"{where('max_body')} {settings.max_body} cannot hold a prompt of {where('ctx')} "
                             f"{settings.ctx} tokens: at least {need} bytes ({BYTES_PER_CONTEXT_TOKEN} per token)")
    try:
        parse_duration(settings.keep_alive)
    except ValueError as exc:
        raise UsageError(f"{where('keep_alive')} {exc}") from None
    if settings.distributed and settings.engine == "cpu":
        raise UsageError(f"{where('distributed')} runs on the MLX engine (not {where('engine')} cpu)")
    if settings.distributed and (settings.draft is not None or settings.kv_cache_dir is not None):
        raise UsageError(f"{where('distributed')} does not support --draft or --kv-cache-dir yet")
    if (settings.speculate == "draft") != (settings.draft is not None) and settings.speculate is not None:
        raise UsageError(f"{where('speculate')} draft and {where('draft')} go together (--draft alone implies it)")
    return settings
