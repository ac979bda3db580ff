"""How this model writes tool calls: what opens a call, where it ends, and the parser for its body.

The family comes from markers in the chat template (our own table, in the spirit of mlx-lm's
template sniffing): hermes `<tool_call>` JSON (Qwen2.5, Qwen3, and every template without tools,
which gets the hermes section from `chat/hermes.py`; a bare `{"name": ..., "arguments": ...}` where
the answer starts or a call just ended is a call too, as Qwen2.5-Coder leaves the markers out at
times), Qwen3-Coder's `<function=...>` XML (also Qwen3.5 / 3.6's), Mistral's
`[TOOL_CALLS]name[ARGS]{...}`, Llama 3.x's bare `{"name": ..., "parameters": ...}` JSON, Gemma 4's
`<|tool_call>call:name{...}<tool_call|>` notation (`chat/gemma4.py`) and gpt-oss's harmony channels
(routed by `chat/harmony.py`). Bodies are parsed with `mlx_lm.tool_parsers` where it has the format
right (hermes, Qwen3-Coder, Mistral, and the other families it knows, parse-only); Llama, Gemma 4 and
harmony parsing is ours. The parser modules are loaded without mlx_lm's package `__init__`
(`parser_module`), which imports transformers: about a second of Python that, run in the server's
warm-up thread, held the GIL from the first reply's decode steps (figures: docs/PERFORMANCE.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from lmserve.chat import gemma4
from lmserve.model.chat_template import ChatTemplate

log = logging.getLogger("lmserve.tools")

HERMES = "json_tools"  # the mlx_lm.tool_parsers module names, where mlx-lm has the format
QWEN3_CODER = "qwen3_coder"
MISTRAL = "mistral"
LLAMA3 = "llama3_json"
HARMONY = "harmony"
GEMMA4 = "gemma4"
GRAMMAR_FAMILIES = frozenset({HERMES, QWEN3_CODER, MISTRAL, LLAMA3, HARMONY, GEMMA4})  # forced calls compile for these
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
HERMES_LEAD = '{"name"'  # what opens a hermes call written without its markers
MISTRAL_START, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
PYTHON_TAG = "<|python_tag|>"
Parser = Callable[[str, Any], Any]

# Template markers -> family, first match wins (every marker of a row must appear). The order follows
# mlx-lm's own sniffing, so families it knows are told apart the same way; ours are added.
TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (HARMONY, ("<|channel|>", "<|call|>")),
    ("minimax_m2", ("<minimax:tool_call>",)),
    (GEMMA4, (gemma4.CALL_OPEN, gemma4.CALL_CLOSE)),
    ("function_gemma", ("<start_function_call>",)),
    ("longcat", ("<longcat_tool_call>",)),
    ("glm47", ("<arg_key>",)),
    ("pythonic", ("<|tool_call_start|>",)),
    (QWEN3_CODER, ("<tool_call>\n<function=",)),
    (QWEN3_CODER, ("<tool_call>\\n<function=",)),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("minicpm5", ('<function name="', '<param name="')),
    (MISTRAL, (MISTRAL_START,)),
    ("muse_spark", ("<atem:function_calls>",)),
    (LLAMA3, (PYTHON_TAG,)),
    (LLAMA3, ('{"name": function name, "parameters"',)),
    (HERMES, (HERMES_START,)),
)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ToolFormat:
    """A tool-call family. `start` opens a call anywhere in the answer; `lead` opens one only where
    the answer starts or a call just ended, and belongs to the body (Llama's `{`, hermes's bare
    `{"name"`): such a call ends where its JSON does. `end` closes a call opened by `start`, or is
    "" when a call ends where its JSON does (Mistral, Llama). `parser` reads a body."""

    family: str
    start: str
    end: str
    parser: Parser
    lead: str = ""
    call_id: bool = False  # Mistral Small 3.2's `[CALL_ID]id` between the name and `[ARGS]`
    listed: bool = False  # older Mistral templates: `[TOOL_CALLS] [{"name": ..., "arguments": ...}]`

    @property
    def hermes(self) -> bool:
        """Calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` JSON."""
        return self.family == HERMES

    @property
    def grammar(self) -> bool:
        """A call grammar exists for this family (forced calls, the guard under auto)."""
        return self.family in GRAMMAR_FAMILIES

    def scanner(self, led: bool = False) -> CallScanner:
        """Finds where a call that just opened ends, fed its body as it grows; `led`: it opened by
        its lead, so it is one JSON value, whatever closes a call opened by `start`."""
        if led:
            return JsonEnd()
        if self.family == GEMMA4:
            return QuotedMarkerEnd(self.end, gemma4.QUOTE)
        if self.end:
            return MarkerEnd(self.end)
        return MistralEnd() if self.family == MISTRAL else JsonEnd()

    def parse(self, body: str, tools: list[dict[str, Any]], names: frozenset[str],
              bare: bool = False) -> list[ParsedCall]:
        """The calls in one call body; ValueError when it is malformed or names a tool not offered.
        `bare`: it opened by its lead, so only its shape says it is a call: a hermes one must hold
        "arguments" (an answer that is JSON about a tool, its definition say, stays text)."""
        try:
            parsed = self.parser(body, tools)
        except Exception as exc:  # parsers raise whatever their input provokes
            raise ValueError(f"unparseable tool call: {exc}") from None
        items = parsed if isinstance(parsed, list) else [parsed]
        if bare and self.hermes and not all(isinstance(c, dict) and "arguments" in c for c in items):
            raise ValueError("bare JSON that is not a hermes call")
        calls = [parsed_call(c.get("name") if isinstance(c, dict) else None,
                             c.get("arguments", {}) if isinstance(c, dict) else None, names)
                 for c in items]
        if not calls:
            raise ValueError("no tool call in the body")
        return calls


def parsed_call(name: Any, arguments: Any, names: frozenset[str]) -> ParsedCall:
    """A call to an offered tool with object arguments; ValueError otherwise (also for a number
    no JSON can carry, such as 1e999, which reads as infinity)."""
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"call to a tool that was not offered: {name!r}")
    return ParsedCall(name, json.dumps(_arguments(arguments), ensure_ascii=False, allow_nan=False))


def _arguments(value: Any) -> dict[str, Any]:
    """Arguments as a JSON object; some models write them as a JSON string holding the object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError("tool call arguments are not JSON") from None
    if not isinstance(value, dict):
        raise ValueError("tool call arguments are not a JSON object")
    return value


# -- where a call ends ---------------------------------------------------------------------------------


class CallScanner:
    """Fed the body of an open call (everything after its opener, growing); `end` returns how much
    of it is the call, end marker included, once the call is complete, else None."""

    def end(self, body: str) -> int | None:
        raise NotImplementedError


class MarkerEnd(CallScanner):
    def __init__(self, marker: str) -> None:
        self._marker = marker
        self._seen = 0

    def end(self, body: str) -> int | None:
        at = body.find(self._marker, max(0, self._seen - len(self._marker) + 1))
        self._seen = len(body)
        return None if at == -1 else at + len(self._marker)


class QuotedMarkerEnd(CallScanner):
    """The end marker outside quoted strings: Gemma 4's `<|"|>` strings may hold `<tool_call|>`
    (the call grammar allows it there, and the parser reads it as text)."""

    def __init__(self, marker: str, quote: str) -> None:
        self._marker, self._quote = marker, quote
        self._longest = max(len(marker), len(quote))
        self._at = 0  # next character to scan
        self._quoted = False

    def end(self, body: str) -> int | None:
        at = self._at
        while at < len(body):
            rest = body[at:at + self._longest]
            if rest.startswith(self._quote):
                self._quoted = not self._quoted
                at += len(self._quote)
                continue
            if not self._quoted and rest.startswith(self._marker):
                return at + len(self._marker)
            if len(rest) < self._longest and (self._quote.startswith(rest) or self._marker.startswith(rest)):
                break  # may still become a marker
            at += 1
        self._at = at
        return None


class JsonEnd(CallScanner):
    """The call is one JSON value, after optional whitespace; it ends where that value closes.
    A body that does not start with `{` or `[` ends at once (and fails to parse)."""

    def __init__(self) -> None:
        self._at = 0  # next character to scan
        self._started = False
        self._depth = 0
        self._string = False
        self._escape = False

    def start_at(self, offset: int) -> None:
        """Scan from `offset` on (Mistral: after the header)."""
        self._at = max(self._at, offset)

    def end(self, body: str) -> int | None:
        for i in range(self._at, len(body)):
            ch = body[i]
            if not self._started:
                if ch.isspace():
                    continue
                if ch not in "{[":
                    return i + 1
                self._started = True
            if self._string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._string = False
            elif ch == '"':
                self._string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        self._at = len(body)
        return None


class MistralEnd(CallScanner):
    """`name[ARGS]{...}` (with `[CALL_ID]id` before `[ARGS]` on Mistral Small 3.2) or the older
    `[{"name": ..., "arguments": ...}, ...]` list: the call ends where its JSON does."""

    def __init__(self) -> None:
        self._json = JsonEnd()
        self._header_done = False

    def end(self, body: str) -> int | None:
        if not self._header_done:
            head = body.lstrip()
            if head.startswith("[") and not head.startswith(MISTRAL_ARGS) and not head.startswith(MISTRAL_CALL_ID):
                self._header_done = True  # the list form: the JSON starts right here
            elif (at := body.find(MISTRAL_ARGS)) != -1:
                self._header_done = True
                self._json.start_at(at + len(MISTRAL_ARGS))
            else:
                return None
        return self._json.end(body)


# -- parsers mlx-lm lacks ---------------------------------------------------------------------------


def _json_body(body: str, tools: Any = None) -> Any:
    """A body that is one JSON value: hermes where mlx-lm is not installed (Intel Macs; the same
    read as json_tools), a harmony call's arguments."""
    return json.loads(body.strip())


def _llama_json(body: str, tools: Any = None) -> Any:
    """Llama 3.x: `{"name": N, "parameters": {...}}` (some fine-tunes write "arguments")."""
    call = json.loads(body.strip())
    if not isinstance(call, dict):
        raise ValueError("a Llama tool call is a JSON object")
    return {"name": call.get("name"), "arguments": call.get("parameters", call.get("arguments", {}))}


_CALL_ID = re.compile(re.escape(MISTRAL_CALL_ID) + r"\s*[\w-]*")


def _mistral(parse: Parser) -> Parser:
    """mlx-lm's Mistral parser, after dropping Mistral Small 3.2's `[CALL_ID]id` (it would take the
    id for the function name)."""
    return lambda body, tools=None: parse(_CALL_ID.sub("", body), tools)


# -- detection -----------------------------------------------------------------------------------


def family_of(template: ChatTemplate, vocab: dict[str, int] | None = None) -> str:
    """The template's call family, from its markers (no import): hermes for a template without tools."""
    if not template.supports_tools:
        return HERMES
    source = template.source
    for family, markers in TEMPLATE_MARKERS:
        if all(m in source for m in markers):
            return family
    if vocab and "<|tool_call_start|>" in vocab and "<|tool_call_end|>" in vocab:
        return "pythonic"  # LFM2 conversions carry the tokens without naming them in the template
    return HERMES


PARSERS_PACKAGE = "lmserve._mlx_lm_tool_parsers"  # mlx_lm/tool_parsers/ loaded under this name


def parser_module(family: str) -> ModuleType:
    """`mlx_lm.tool_parsers.<family>`, loaded from mlx-lm's files as a module of PARSERS_PACKAGE:
    the parsers import only the standard library, `regex` and each other, not mlx_lm's package
    `__init__` (transformers). ImportError where mlx-lm is not installed or has no such parser."""
    if PARSERS_PACKAGE not in sys.modules:
        spec = importlib.util.find_spec("mlx_lm")  # finds, does not import, a top-level package
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("mlx-lm is not installed")
        folder = Path(next(iter(spec.submodule_search_locations))) / "tool_parsers"
        package_spec = importlib.util.spec_from_file_location(
            PARSERS_PACKAGE, folder / "__init__.py", submodule_search_locations=[str(folder)])
        if package_spec is None or package_spec.loader is None:
            raise ImportError(f"no mlx-lm tool parsers in {folder}")
        package = importlib.util.module_from_spec(package_spec)
        sys.modules[PARSERS_PACKAGE] = package
        package_spec.loader.exec_module(package)
    return importlib.import_module(f"{PARSERS_PACKAGE}.{family}")


def detect(template: ChatTemplate, vocab: dict[str, int]) -> ToolFormat | None:
    """The model's tool-call format, or None for a family that cannot be parsed here (calls stay text)."""
    family = family_of(template, vocab)
    if family == LLAMA3:
        return ToolFormat(LLAMA3, PYTHON_TAG, "", _llama_json, lead="{")
    if family == HARMONY:
        return ToolFormat(HARMONY, "", "", _json_body)  # the body is the arguments; harmony.py names the call
    if family == GEMMA4:
        return ToolFormat(GEMMA4, gemma4.CALL_OPEN, gemma4.CALL_CLOSE, gemma4.parse_call)
    try:
        module = parser_module(family)
    except ImportError:
        if family == HERMES:
            return ToolFormat(HERMES, HERMES_START, HERMES_END, _json_body, lead=HERMES_LEAD)
        log.warning("mlx-lm is not installed: tool calls of the %s family are returned as text", family)
        return None
    if family == MISTRAL:
        return ToolFormat(MISTRAL, module.tool_call_start, "", _mistral(module.parse_tool_call),
                          call_id=MISTRAL_CALL_ID in template.source, listed=MISTRAL_ARGS not in template.source)
    if not module.tool_call_start or not module.tool_call_end:
        log.warning("tool calls of the %s family have no end marker; they are returned as text", family)
        return None
    return ToolFormat(family, module.tool_call_start, module.tool_call_end, module.parse_tool_call,
                      lead=HERMES_LEAD if family == HERMES else "")
