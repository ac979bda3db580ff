"""Request -> llguidance grammar source: structured-output formats and each family's tool-call shape.

JSON is held to one layout, the one `json.dumps` writes and chat templates render tool calls in
(", " and ": ", no other whitespace): models have seen it most, and a small model given free
whitespace can wander off into blank lines until max_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import llguidance

from lmserve.chat.gemma4 import CALL_PREFIX, QUOTE
from lmserve.chat.grammar import GrammarError
from lmserve.chat.grammar_check import empty_gbnf, empty_lark, empty_schema
from lmserve.chat.harmony import CALL, CHANNEL, CONSTRAIN, END, FUNCTIONS, MESSAGE, RECIPIENT, START
from lmserve.chat.tool_format import (
    GEMMA4,
    HARMONY,
    HERMES,
    LLAMA3,
    MISTRAL,
    MISTRAL_ARGS,
    MISTRAL_CALL_ID,
    QWEN3_CODER,
    ToolFormat,
)
from lmserve.core.types import OutputFormat, Tool

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def output_grammar(fmt: OutputFormat) -> str:
    """The grammar for response_format / text.format / output_config.format and the extensions."""
    refuse_empty(fmt.kind, fmt.source)
    try:
        if fmt.kind in ("json_schema", "json_object"):
            schema = fmt.source if fmt.kind == "json_schema" else ANY_OBJECT
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if fmt.kind == "choice":  # exactly one of the strings
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(_lit(c) for c in fmt.source))
        return llguidance.grammar_from("gbnf" if fmt.kind == "gbnf" else fmt.kind, fmt.source)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def refuse_empty(kind: str, source: Any) -> None:
    """GrammarError for a grammar or schema no string satisfies: the reply could never finish."""
    if kind == "json_schema" and empty_schema(source):
        raise GrammarError("no JSON value satisfies this schema: a required property, item or every choice "
                           "leads back into itself ($ref), so a reply could never finish")
    rule = empty_lark(source) if kind == "lark" else empty_gbnf(source) if kind == "gbnf" else None
    if rule is not None:
        raise GrammarError(f"the grammar's language is empty: rule {rule!r} can never end (every alternative "
                           "recurses), so a reply could never finish")


def _json_options(tool: Tool) -> dict[str, Any]:
    return {**JSON_LAYOUT, "lenient": tool.lenient} if tool.strict else JSON_LAYOUT


def _arguments_schema(tool: Tool) -> dict[str, Any]:
    """A tool's arguments: its schema when strict, any JSON object otherwise, in the fixed layout."""
    if tool.strict and tool.parameters:
        refuse_empty("json_schema", tool.parameters)
    schema = dict(tool.parameters or ANY_OBJECT) if tool.strict else dict(ANY_OBJECT)
    schema["x-guidance"] = {**_json_options(tool), **(schema.get("x-guidance") or {})}
    return schema


def _lit(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)


def _arguments(tool: Tool) -> str:
    """The arguments object as a `%json` subgrammar."""
    return f"%json {json.dumps(_arguments_schema(tool))}"


def _alternatives(bodies: list[str]) -> list[str]:
    """`call: call_0 | call_1 | ...`, one body per tool."""
    return ["call: " + " | ".join(f"call_{i}" for i in range(len(bodies))),
            *(f"call_{i}: {body}" for i, body in enumerate(bodies))]


Marker = Callable[[str], str]
NAME_KEY, ARGUMENTS_KEY, PARAMETERS_KEY = '"name": ', '"arguments": ', '"parameters": '


def _hermes(tools: list[Tool], marker: Marker, fmt: ToolFormat, forced: bool) -> list[str]:
    """`<tool_call>\n{"name": N, "arguments": A}\n</tool_call>`; under auto also the bare object
    without the markers, which the router reads as a call where one may start."""
    bodies = [f"{_lit(json.dumps(t.name) + ', ' + ARGUMENTS_KEY)} {_arguments(t)}" for t in tools]
    marked = f"{marker(fmt.start)} {_lit(chr(10) + '{' + NAME_KEY)} call {_lit('}' + chr(10))} {marker(fmt.end)}"
    start = marked if forced else f"{marked} | {_lit('{' + NAME_KEY)} call {_lit('}')}"
    return [f"start: {start}", *_alternatives(bodies)]


# Qwen3-Coder: <tool_call>\n<function=N>\n<parameter=P>\nvalue\n</parameter>\n...</function>\n</tool_call>
PARAMETER_END = "\n</parameter>\n"
_JSON_TYPES = {"integer", "number", "null", "object", "array"}


def _text_value(rule: str, lo: int = 0, hi: int | None = None) -> str:
    """Free text up to the first `\n</parameter>\n` (included), `lo`..`hi` characters."""
    count = "*" if not lo and hi is None else f"{{{lo},{'' if hi is None else hi}}}"
    return f"{rule}[suffix={_lit(PARAMETER_END)}]: /(?s:.{count})/"


def _xml_value(rule: str, schema: Any, tool: Tool) -> str:
    """One parameter's value up to and including `\n</parameter>\n`, as mlx-lm's qwen3_coder
    parser reads it back by the declared type: strings verbatim, the rest JSON. Booleans as JSON
    writes them or as the templates do (Qwen3-Coder's and Qwen3.5's `| string` gives Python's
    `True`); the parser reads either. A value of no single type (unions, anyOf) is free text,
    which the parser reads as it can."""
    schema = schema if isinstance(schema, dict) else {}
    kind, enum = schema.get("type"), schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum) and kind in (None, "string"):
        return f"{rule}: ({' | '.join(_lit(v) for v in enum)}) {_lit(PARAMETER_END)}"
    if kind == "boolean":
        return f'{rule}: ("true" | "false" | "True" | "False") {_lit(PARAMETER_END)}'
    if kind in _JSON_TYPES:
        sub = {**schema, "x-guidance": {**_json_options(tool), **(schema.get("x-guidance") or {})}}
        return f"{rule}: %json {json.dumps(sub)} {_lit(PARAMETER_END)}"
    if kind == "string":
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        return _text_value(rule, int(lo) if isinstance(lo, int) else 0, int(hi) if isinstance(hi, int) else None)
    return _text_value(rule)


def _xml_function(i: int, tool: Tool) -> tuple[str, list[str]]:
    """One function's body and its parameter rules: the declared parameters in their order (the
    optional ones may be left out) when strict, else any parameters with text values."""
    head = _lit(f"{tool.name}>\n")
    properties = (tool.parameters or {}).get("properties") if tool.strict else None
    if not isinstance(properties, dict):
        return f"{head} any_parameter*", []
    required = set((tool.parameters or {}).get("required") or [])
    parts, rules = [head], []
    for j, (name, schema) in enumerate(properties.items()):
        rule = f"p_{i}_{j}"
        rules += [f"{rule}: {_lit(f'<parameter={name}>' + chr(10))} {rule}_v", _xml_value(f"{rule}_v", schema, tool)]
        parts.append(rule if name in required else f"{rule}?")
    return " ".join(parts), rules


def _qwen3_coder(tools: list[Tool], marker: Marker, fmt: ToolFormat) -> list[str]:
    bodies, rules = [], []
    for i, tool in enumerate(tools):
        body, more = _xml_function(i, tool)
        bodies.append(body)
        rules += more
    return [f"start: {marker(fmt.start)} {_lit(chr(10) + '<function=')} call {_lit('</function>' + chr(10))} "
            f"{marker(fmt.end)}", *_alternatives(bodies), *rules,
            'any_parameter: "<parameter=" /[^\\s<>=]+/ ">\\n" any_value', _text_value("any_value")]


def _mistral(tools: list[Tool], marker: Marker, fmt: ToolFormat, forced: bool) -> list[str]:
    """`[TOOL_CALLS]N[ARGS]{...}` (Mistral Small 3.2: `[TOOL_CALLS]N[CALL_ID]id[ARGS]{...}`), or the
    older `[TOOL_CALLS] [{"name": N, "arguments": {...}}, ...]`. Forced: one call, in the form the
    template renders; under auto either form."""
    call_id = f" {marker(MISTRAL_CALL_ID)} /[a-zA-Z0-9]{{9}}/" if fmt.call_id else ""
    bodies = [f"{_lit(t.name)}{call_id} {marker(MISTRAL_ARGS)} {_arguments(t)}" for t in tools]
    items = [f"{_lit(json.dumps(t.name) + ', ' + ARGUMENTS_KEY)} {_arguments(t)}" for t in tools]
    listed = ['listed: " "? "[" item ("," " " item)* "]"', f"item: {_lit('{' + NAME_KEY)} item_call {_lit('}')}",
              "item_call: " + " | ".join(f"call_{len(tools) + i}" for i in range(len(items))),
              *(f"call_{len(tools) + i}: {item}" for i, item in enumerate(items))]
    if forced and fmt.listed:
        return [f"start: {marker(fmt.start)} \" \"? \"[\" item \"]\"", *listed[1:]]
    start = f"start: {marker(fmt.start)} call" if forced else f"start: {marker(fmt.start)} (call | listed)"
    return [start, *_alternatives(bodies), *([] if forced else listed)]


def _llama(tools: list[Tool], marker: Marker, fmt: ToolFormat, forced: bool) -> list[str]:
    """`{"name": N, "parameters": {...}}`, after `<|python_tag|>` or alone (forced: alone, as the
    template renders a call)."""
    bodies = [f"{_lit(json.dumps(t.name) + ', ' + PARAMETERS_KEY)} {_arguments(t)} {_lit('}')}" for t in tools]
    tag = "" if forced else f"{marker(fmt.start)}? "
    return [f"start: {tag}{_lit('{' + NAME_KEY)} call", *_alternatives(bodies)]


# Gemma 4: <|tool_call>call:N{key:value,...}<tool_call|>, values as the template's format_argument
# writes them. Numbers, booleans and null are the same text as in JSON, so they are JSON subgrammars.
GEMMA4_ANY = [
    'g_value: g_string | g_object | g_array | g_number | "true" | "false" | "null"',
    f"g_string: {_lit(QUOTE)} g_text",
    f"g_text[suffix={_lit(QUOTE)}]: /(?s:.*)/",
    'g_object: "{" (g_pair ("," g_pair)*)? "}"',
    'g_pair: /[^\\s:,{}\\[\\]<>|"]+/ ":" g_value',
    'g_array: "[" (g_value ("," g_value)*)? "]"',
    "g_number: /-?(0|[1-9][0-9]{0,15})(\\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?/",  # always a finite float
]


class _GemmaArguments:
    """A tool's arguments in Gemma 4's notation, held to its schema as far as the notation allows:
    types, `enum` / `const`, `anyOf` / `oneOf`, declared properties (in the template's order: it
    sorts keys, case-insensitively, with `dictsort`; optional ones may be left out, undeclared ones
    may not), array items, string lengths; numbers' bounds through their JSON subgrammar. A value
    of a shape it cannot hold (`$ref`, `allOf`, ...) is any value."""

    def __init__(self, tool: Tool, prefix: str) -> None:
        self.rules: list[str] = []
        self._options = _json_options(tool)
        self._prefix = prefix

    def _rule(self, body: str) -> str:
        name = f"{self._prefix}_{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def value(self, schema: Any) -> str:
        """A Lark expression for one value of `schema`."""
        if not isinstance(schema, dict):
            return "g_value"
        choices = [schema["const"]] if "const" in schema else schema.get("enum")
        if isinstance(choices, list) and choices and all(not isinstance(c, dict | list) for c in choices):
            return "(" + " | ".join(_lit(f"{QUOTE}{c}{QUOTE}" if isinstance(c, str) else json.dumps(c))
                                    for c in choices) + ")"
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return "(" + " | ".join(self.value(option) for option in schema[key]) + ")"
        kind = schema.get("type", "object" if "properties" in schema else "array" if "items" in schema else None)
        if isinstance(kind, list) and kind:
            return "(" + " | ".join(self.value({**schema, "type": k}) for k in kind) + ")"
        if kind == "string":
            lo, hi = schema.get("minLength"), schema.get("maxLength")
            count = f"{{{lo if isinstance(lo, int) else 0},{hi if isinstance(hi, int) else ''}}}"
            name = f"{self._prefix}_{len(self.rules)}"
            self.rules.append(f"{name}[suffix={_lit(QUOTE)}]: /(?s:.{count})/")
            return f"{_lit(QUOTE)} {name}"
        if kind in ("integer", "number", "boolean", "null"):
            sub = {**schema, "x-guidance": {**self._options, **(schema.get("x-guidance") or {})}}
            return self._rule(f"%json {json.dumps(sub)}")
        if kind == "object":
            return self.object(schema)
        if kind == "array" and isinstance(schema.get("items"), dict):
            item = self.value(schema["items"])
            optional = "" if isinstance(schema.get("minItems"), int) and schema["minItems"] > 0 else "?"
            return self._rule(f'"[" ({item} ("," {item})*){optional} "]"')
        return "g_array" if kind == "array" else "g_value"

    def object(self, schema: dict[str, Any]) -> str:
        """`{k:v,...}`: the declared properties, in the template's order, comma-separated whichever
        optional ones are left out."""
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties:
            return "g_object"
        required = set(schema.get("required") or [])
        members = [(self._rule(f"{_lit(key + ':')} {self.value(sub)}"), key in required)
                   for key, sub in sorted(properties.items(), key=lambda item: item[0].lower())]

        def rest(start: int) -> str:  # the members after `start`, each after a comma
            return " ".join(f'"," {m}' if req else f'("," {m})?' for m, req in members[start:])

        firsts = []  # one alternative per member that may come first: every one before it is optional
        for i, (member, req) in enumerate(members):
            firsts.append(f"{member} {rest(i + 1)}".strip())
            if req:
                break
        empty = "" if any(req for _, req in members) else "?"
        return self._rule(f'"{{" ({" | ".join(firsts)}){empty} "}}"')


def _gemma4(tools: list[Tool], marker: Marker, fmt: ToolFormat) -> list[str]:
    """`<|tool_call>call:N{...}<tool_call|>`: a strict tool's arguments held to its schema, any
    object in the notation otherwise."""
    bodies, rules = [], []
    for i, tool in enumerate(tools):
        arguments = _GemmaArguments(tool, f"a_{i}")
        bodies.append(f"{_lit(tool.name)} {arguments.object(tool.parameters or {}) if tool.strict else 'g_object'}")
        rules += arguments.rules
    return [f"start: {marker(fmt.start)} {_lit(CALL_PREFIX)} call {marker(fmt.end)}", *_alternatives(bodies),
            *rules, *GEMMA4_ANY]


def _harmony(tools: list[Tool], marker: Marker, forced: bool) -> list[str]:
    """`<|channel|>commentary to=functions.N <|constrain|>json<|message|>{...}<|call|>`. Forced: the
    whole reply, an optional analysis message first (gpt-oss always reasons; the reasoning budget
    closes it in time for the call); under auto: from `to=` on, in either header order the model writes."""
    channel, message, constrain = marker(CHANNEL), marker(MESSAGE), marker(CONSTRAIN)
    bodies = [f"{_lit(t.name)} head {message} {_arguments(t)} {marker(CALL)}" for t in tools]
    if forced:
        return [f"start: analysis? {channel} {_lit('commentary ' + RECIPIENT + FUNCTIONS)} call",
                f'analysis: {channel} "analysis" {message} thought {marker(END)} {marker(START)} "assistant"',
                "thought: /(?s:.*)/",
                f'head: " " {constrain} "json"', *_alternatives(bodies)]
    return [f"start: {_lit(RECIPIENT + FUNCTIONS)} call",
            f'head: " "? ({channel} "commentary" " "?)? {constrain}? "json"?', *_alternatives(bodies)]


def call_grammar(fmt: ToolFormat, tools: list[Tool], marker: Marker, forced: bool) -> str:
    """One call in `fmt`'s own format, one alternative per tool, so the name is always an offered
    one and the arguments follow that tool's schema (when strict). `forced`: the grammar is the
    whole reply; else it takes over once the router sees a call open, from the opener on (harmony:
    from `to=`). `marker` spells a marker in Lark (a special token, or a quoted literal)."""
    if fmt.family == HERMES:
        rules = _hermes(tools, marker, fmt, forced)
    elif fmt.family == QWEN3_CODER:
        rules = _qwen3_coder(tools, marker, fmt)
    elif fmt.family == MISTRAL:
        rules = _mistral(tools, marker, fmt, forced)
    elif fmt.family == LLAMA3:
        rules = _llama(tools, marker, fmt, forced)
    elif fmt.family == HARMONY:
        rules = _harmony(tools, marker, forced)
    elif fmt.family == GEMMA4:
        rules = _gemma4(tools, marker, fmt)
    else:
        raise GrammarError(f"no call grammar for the {fmt.family} tool-call format")
    return llguidance.LLMatcher.grammar_from_lark("\n".join(rules))
