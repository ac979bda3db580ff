"""The OpenAPI document at /openapi.json: Litestar generates paths and operations; each POST
route declares its request body here.

Handlers read their bodies themselves (`read_json` plus the dialect parsers, so that every error
is a 400 in the dialect's envelope naming the field), which leaves Litestar nothing to infer a
body schema from. Each route therefore names a hand-written JSON schema of what it honours through
its `operation_class`; nothing about request handling changes. The schemas document the accepted
shapes; the dialect parsers stay the authority (they also accept and ignore unknown fields).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.openapi.spec import OpenAPIMediaType, Operation, RequestBody, Schema

from lmserve import __version__

Json = dict[str, Any]


def _num(lo: float, hi: float) -> Json:
    return {"type": "number", "minimum": lo, "maximum": hi}


def _obj(properties: Json, required: tuple[str, ...] = ()) -> Json:
    return {"type": "object", "properties": properties, **({"required": list(required)} if required else {})}


STRING = {"type": "string"}
BOOL = {"type": "boolean"}
COUNT = {"type": "integer", "minimum": 1}
ANY_OBJECT = {"type": "object"}
STRINGS = {"type": "array", "items": STRING}


def _content(part_types: list[str]) -> Json:
    part = _obj({"type": {"enum": part_types}, "text": STRING}, ("type", "text"))
    return {"anyOf": [STRING, {"type": "array", "items": part}, {"type": "null"}]}


OPENAI_SAMPLING = {
    "model": STRING, "temperature": _num(0, 2), "top_p": _num(0, 1), "top_k": {"type": "integer", "minimum": 0},
    "min_p": _num(0, 1), "presence_penalty": _num(-2, 2), "frequency_penalty": _num(-2, 2),
    "repeat_penalty": _num(0.01, 10), "seed": {"type": "integer"}, "stream": BOOL,
    "stop": {"anyOf": [STRING, {**STRINGS, "maxItems": 4}]},
    "logit_bias": {"type": "object", "additionalProperties": _num(-100, 100)},
    "grammar": STRING, "guided_grammar": STRING, "regex": STRING, "guided_regex": STRING, "lark": STRING,
    "json_schema": ANY_OBJECT, "guided_json": ANY_OBJECT,
    "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]}, ANY_OBJECT]},
}
FORMAT_TYPES = {"enum": ["text", "json_object", "json_schema"]}
RESPONSE_FORMAT = _obj({"type": FORMAT_TYPES, "json_schema": _obj({"name": STRING, "schema": ANY_OBJECT,
                                                                    "strict": BOOL})})

CHAT = _obj({
    **OPENAI_SAMPLING,
    "messages": {"type": "array", "minItems": 1, "items": _obj({
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]}, "content": _content(["text"]),
        "tool_call_id": STRING, "tool_calls": {"type": "array", "items": _obj({
            "id": STRING, "type": {"const": "function"},
            "function": _obj({"name": STRING, "arguments": STRING}, ("name",))}, ("function",))},
    }, ("role",))},
    "max_tokens": COUNT, "max_completion_tokens": COUNT, "n": {"type": "integer", "minimum": 1, "maximum": 1},
    "logprobs": BOOL, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "stream_options": _obj({"include_usage": BOOL}), "reasoning_effort": STRING,
    "tools": {"type": "array", "items": _obj({
        "type": {"const": "function"},
        "function": _obj({"name": {"type": "string", "minLength": 1}, "description": STRING,
                          "parameters": ANY_OBJECT, "strict": BOOL}, ("name",))}, ("type", "function"))},
    "response_format": RESPONSE_FORMAT, "chat_template_kwargs": ANY_OBJECT,
}, ("messages",))

RESPONSES = _obj({
    **OPENAI_SAMPLING,
    "input": {"anyOf": [STRING, {"type": "array", "items": _obj({
        "type": STRING, "role": {"enum": ["developer", "system", "user", "assistant"]},
        "content": _content(["input_text", "output_text"]), "call_id": STRING, "name": STRING,
        "arguments": STRING, "output": STRING})}]},
    "instructions": STRING, "max_output_tokens": COUNT, "store": BOOL, "previous_response_id": STRING,
    "prompt_cache_key": STRING, "metadata": ANY_OBJECT, "parallel_tool_calls": BOOL, "include": STRINGS,
    "tools": {"type": "array", "items": _obj({"type": STRING, "name": STRING, "parameters": ANY_OBJECT},
                                             ("type",))},
    "text": _obj({"format": _obj({"type": FORMAT_TYPES, "schema": ANY_OBJECT, "name": STRING})}),
    "reasoning": _obj({"effort": STRING, "summary": STRING}), "chat_template_kwargs": ANY_OBJECT,
}, ("input",))

ANTHROPIC_BLOCK = _obj({"type": {"enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]},
                        "text": STRING, "id": STRING, "name": STRING, "input": ANY_OBJECT,
                        "tool_use_id": STRING, "content": {"anyOf": [STRING, {"type": "array"}]},
                        "thinking": STRING}, ("type",))
COUNT_TOKENS = _obj({
    "model": STRING,
    "messages": {"type": "array", "minItems": 1, "items": _obj({
        "role": {"enum": ["user", "assistant"]},
        "content": {"anyOf": [STRING, {"type": "array", "items": ANTHROPIC_BLOCK}]}}, ("role", "content"))},
    "system": {"anyOf": [STRING, {"type": "array", "items": _obj({"type": {"const": "text"}, "text": STRING},
                                                               ("type", "text"))}]},
    "max_tokens": COUNT, "temperature": _num(0, 1), "top_p": _num(0, 1), "top_k": {"type": "integer", "minimum": 0},
    "stop_sequences": STRINGS, "stream": BOOL, "metadata": ANY_OBJECT,
    "tools": {"type": "array", "items": _obj({"name": {"type": "string", "minLength": 1}, "description": STRING,
                                              "input_schema": ANY_OBJECT}, ("name", "input_schema"))},
    "tool_choice": _obj({"type": {"enum": ["auto", "any", "tool", "none"]}, "name": STRING}),
    "thinking": _obj({"type": {"enum": ["enabled", "adaptive", "disabled"]}, "budget_tokens": COUNT}),
    "output_config": _obj({"effort": STRING, "format": _obj({"type": {"const": "json_schema"},
                                                             "schema": ANY_OBJECT})}),
}, ("messages",))
MESSAGES = {**COUNT_TOKENS, "required": ["max_tokens", "messages"]}

TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
COMPLETIONS = _obj({
    **OPENAI_SAMPLING,
    "prompt": {"anyOf": [STRING, STRINGS, TOKEN_IDS, {"type": "array", "items": TOKEN_IDS}]},
    "max_tokens": COUNT, "logprobs": {"type": "integer", "minimum": 0, "maximum": 20}, "echo": {"const": False},
    "n": {"type": "integer", "minimum": 1, "maximum": 1}, "best_of": {"type": "integer", "minimum": 1, "maximum": 1},
    "stream_options": _obj({"include_usage": BOOL}), "response_format": RESPONSE_FORMAT,
}, ("prompt",))

TOKENIZE = _obj({"content": STRING, "add_special": BOOL, "with_pieces": BOOL}, ("content",))
DETOKENIZE = _obj({"tokens": TOKEN_IDS}, ("tokens",))


def json_body(schema: Json) -> type[Operation]:
    """An Operation class declaring `schema` as the route's JSON request body."""

    @dataclass
    class BodyOperation(Operation):
        def __post_init__(self) -> None:
            # A plain dict renders as written; Litestar's Schema dataclass would need a conversion.
            media = OpenAPIMediaType(schema=cast(Schema, schema))
            self.request_body = RequestBody(content={"application/json": media}, required=True)

    return BodyOperation


def openapi_config() -> OpenAPIConfig:
    """The JSON document only, at /openapi.json (no HTML viewer: those load scripts from a CDN)."""
    return OpenAPIConfig(title="lmserve", version=__version__, path="/openapi.json",
                         render_plugins=[JsonRenderPlugin(path="/")])
