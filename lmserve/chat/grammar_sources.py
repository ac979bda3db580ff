"""Request -> llguidance grammar source: structured-output formats and the hermes tool-call shape.

JSON is held to one layout, the one `json.dumps` writes and chat templates render tool calls in
(", " and ": ", no other whitespace): models have seen it most, and a small model given free
whitespace can wander off into blank lines until max_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import llguidance

from lmserve.chat.grammar import GrammarError
from lmserve.core.types import OutputFormat, Tool

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def output_grammar(fmt: OutputFormat) -> str:
    """The grammar for response_format / text.format / output_config.format and the extensions."""
    try:
        if fmt.kind in ("json_schema", "json_object"):
            schema = fmt.source if fmt.kind == "json_schema" else ANY_OBJECT
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        return llguidance.grammar_from("gbnf" if fmt.kind == "gbnf" else fmt.kind, fmt.source)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def _arguments_schema(tool: Tool) -> dict[str, Any]:
    """A tool's arguments: its schema when strict, any JSON object otherwise, in the fixed layout."""
    schema = dict(tool.parameters or ANY_OBJECT) if tool.strict else dict(ANY_OBJECT)
    options = {**JSON_LAYOUT, "lenient": tool.lenient} if tool.strict else JSON_LAYOUT
    schema["x-guidance"] = {**options, **(schema.get("x-guidance") or {})}
    return schema


def call_grammar(tools: list[Tool], marker: Callable[[str], str], start: str, end: str) -> str:
    """One hermes call, `<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>`, one alternative
    per tool so the name is always an offered one and A follows that tool's schema.
    `marker` spells a marker in Lark (a special token or a quoted literal)."""
    rules = [f'start: {marker(start)} {json.dumps(chr(10) + "{")} call "}}\\n" {marker(end)}',
             "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        head = json.dumps(f'"name": {json.dumps(tool.name)}, "arguments": ')
        rules.append(f"call_{i}: {head} %json {json.dumps(_arguments_schema(tool))}")
    return llguidance.LLMatcher.grammar_from_lark("\n".join(rules))
