"""How this model writes tool calls: the markers around a call and the parser for what is inside.

The family is inferred from the chat template the way mlx-lm infers it, and calls are parsed with
`mlx_lm.tool_parsers` (hermes JSON, Qwen3-Coder XML, ...). Importing mlx_lm pulls in transformers
(about a second), so it happens on the first request that offers tools, not at startup. A template
without tool support gets the hermes section rendered by `core.hermes`, so its calls are hermes JSON.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from lmserve.model.chat_template import ChatTemplate

log = logging.getLogger("lmserve.tools")

HERMES = "json_tools"
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
Parser = Callable[[str, Any], Any]


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ToolFormat:
    """A tool-call family: `start`/`end` delimit one call, `parser` reads its body."""

    family: str
    start: str
    end: str
    parser: Parser

    @property
    def hermes(self) -> bool:
        """Calls are `{"name": ..., "arguments": {...}}` JSON, which the call grammar can enforce."""
        return self.family == HERMES

    def parse(self, body: str, tools: list[dict[str, Any]], names: frozenset[str]) -> list[ParsedCall]:
        """The calls in one call body; ValueError when it is malformed or names a tool not offered."""
        try:
            parsed = self.parser(body, tools)
        except Exception as exc:  # parsers raise whatever their input provokes
            raise ValueError(f"unparseable tool call: {exc}") from None
        calls = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            name = call.get("name") if isinstance(call, dict) else None
            if name not in names:
                raise ValueError(f"call to a tool that was not offered: {name!r}")
            calls.append(ParsedCall(name, json.dumps(_arguments(call.get("arguments", {})), ensure_ascii=False)))
        return calls


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


def _hermes_json(body: str, tools: Any = None) -> Any:
    """hermes bodies where mlx-lm is not installed (Intel Macs): the same JSON read as json_tools."""
    return json.loads(body.strip())


def detect(template: ChatTemplate, vocab: dict[str, int]) -> ToolFormat | None:
    """The model's tool-call format, or None for a family without an end marker (calls stay text)."""
    try:
        from mlx_lm.tokenizer_utils import _infer_tool_parser
    except ImportError:
        return ToolFormat(HERMES, HERMES_START, HERMES_END, _hermes_json)
    family = HERMES
    if template.supports_tools:
        family = _infer_tool_parser(SimpleNamespace(chat_template=template.source, get_vocab=lambda: vocab)) or HERMES
    module = importlib.import_module(f"mlx_lm.tool_parsers.{family}")
    if not module.tool_call_start or not module.tool_call_end:
        log.warning("tool calls of the %s family have no end marker; they are returned as text", family)
        return None
    return ToolFormat(family, module.tool_call_start, module.tool_call_end, module.parse_tool_call)
