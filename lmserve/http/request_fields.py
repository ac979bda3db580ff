"""Request fields every OpenAI-shaped route reads alike (Chat Completions, Responses, legacy
completions; Anthropic's Messages reads the sampling and stop fields too): sampling, stop strings,
output formats and the grammar extensions, tool_choice, reasoning and chat-template fields."""

from __future__ import annotations

import json
from typing import Any

from msgspec import Struct

from lmserve.chat.reasoning import effort_budget
from lmserve.core.errors import invalid
from lmserve.core.types import OutputFormat, SamplingParams, ToolChoice
from lmserve.http import chat_schema as schema

ROLE_ALIASES = {"developer": "system"}  # every other role is itself
# Constraint extensions (llama.cpp's, vLLM's) -> the kind of grammar each carries.
GRAMMAR_EXTENSIONS = {"grammar": "gbnf", "regex": "regex", "lark": "lark", "json_schema": "json_schema",
                      "guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "gbnf",
                      "guided_choice": "choice"}
# response_format types that carry a grammar as text, under the key named like the type
TEXT_FORMATS = {"regex": "regex", "grammar": "gbnf"}
# Names the renderer passes to the chat template itself: chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")
NO_REASONING = ("none", "minimal")
EFFORT_LEVELS = ("low", "medium", "high")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repeat_penalty", "seed")
MAX_SEED = 2**64 - 1


def text_content(content: str | list[Any] | None) -> str:
    """A string, or an array of text parts joined: OpenAI's two shapes of message content."""
    return content if isinstance(content, str) else "".join(part.text for part in content or [])


def tool_choice(value: schema.ToolChoiceSpec | None) -> ToolChoice:
    """"auto", "none", "required", or one function: chat's {"type": "function", "function":
    {"name"}} or Responses' {"type": "function", "name"}."""
    if value is None or isinstance(value, str):
        return ToolChoice(value or "auto")
    name = value.function.name if value.function is not None else value.name
    if not name:
        raise invalid("tool_choice", 'must be "auto", "none", "required" or {"type": "function", ...} '
                      "naming a function")
    return ToolChoice("named", name)


def grammar_extension(body: schema.OpenAIBody) -> OutputFormat | None:
    """llama.cpp's and vLLM's constraint fields (`grammar` is GBNF or Lark); at most one."""
    present = [key for key in GRAMMAR_EXTENSIONS if getattr(body, key) is not None]
    if len(present) > 1:
        raise invalid(present[1], f"only one constraint may be given, got {', '.join(present)}")
    if not present:
        return None
    key = present[0]
    kind, value = GRAMMAR_EXTENSIONS[key], getattr(body, key)
    if kind == "json_schema" and isinstance(value, str):  # a schema's JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise invalid(key, f"is not valid JSON: {exc}") from None
        if not isinstance(value, dict | bool):
            raise invalid(key, "must be a JSON schema")
    return OutputFormat(kind, value, key)


def output_format(body: schema.OpenAIBody, kind: str, spec: schema.JsonSchemaSpec | None, param: str,
                  spec_param: str) -> OutputFormat | None:
    """A format (text, json_object, json_schema with `spec` at `spec_param`) or a grammar
    extension, not both."""
    extension = grammar_extension(body)
    if kind == "text":
        return extension
    if extension is not None:
        raise invalid(extension.param, f"cannot be combined with {param}")
    if kind in TEXT_FORMATS:
        text = getattr(spec, kind, None)
        if not text:
            raise invalid(f"{param}.{kind}", f"is required for {param} type {kind}")
        return OutputFormat(TEXT_FORMATS[kind], text, f"{param}.{kind}")
    param = spec_param if kind == "json_schema" else param
    source = spec.schema if kind == "json_schema" and spec is not None else None
    if source is None:  # json_object, or json_schema without a schema: any JSON object
        return OutputFormat("json_object", None, param)
    return OutputFormat("json_schema", source, f"{param}.schema")


def response_format(body: schema.OpenAIBody, fmt: schema.ResponseFormat | None) -> OutputFormat | None:
    """Chat's and completions' response_format: the json_schema fields nest under "json_schema",
    a regex or grammar under the key named like its type."""
    fmt = fmt or schema.ResponseFormat()
    spec = fmt if fmt.type in TEXT_FORMATS else fmt.json_schema
    return output_format(body, fmt.type, spec, "response_format", "response_format.json_schema")


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs` (llama.cpp's and vLLM's extension, e.g. {"enable_thinking": false}):
    extra variables for the chat template; an explicit `enable_thinking` wins over the reasoning fields."""
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in (kwargs or {}):
            raise invalid(f"chat_template_kwargs.{key}", "is set by the server and cannot be overridden")
    return dict(kwargs or {})


def reasoning_requested(effort: str | None) -> bool | None:
    """Any effort but none/minimal turns reasoning on (a no-op for a model without a channel);
    none/minimal turn it off; no effort leaves the template's default (None)."""
    return None if effort is None else effort not in NO_REASONING


def reasoning_fields(body: schema.ChatLikeBody, effort: str | None) -> dict[str, Any]:
    """ChatRequest's reasoning fields from Chat Completions' or Responses' body and its effort:
    `thinking_token_budget` wins over the effort's budget (chat/reasoning.py)."""
    budget = body.thinking_token_budget if body.thinking_token_budget is not None else effort_budget(effort)
    return {"reasoning": reasoning_requested(effort), "reasoning_effort": effort_level(effort),
            "thinking_budget": budget, "reasoning_inline": body.reasoning_format == "none",
            "single_call": body.parallel_tool_calls is False}


def effort_level(effort: str | None) -> str | None:
    """OpenAI's effort as gpt-oss's `reasoning_effort` ("low" | "medium" | "high"): none and
    minimal are low (harmony always reasons), xhigh is high; unset or unknown: the template's default."""
    if effort in NO_REASONING:
        return "low"
    return "high" if effort == "xhigh" else effort if effort in EFFORT_LEVELS else None


def stop_strings(stop: str | list[str] | None) -> list[str]:
    return [s for s in ([stop] if isinstance(stop, str) else stop or []) if s]


def sampling_params(body: Struct, vocab_size: int) -> SamplingParams:
    """The sampling fields a body sets; unset ones keep SamplingParams' defaults (the APIs' own)
    until the runtime fills in the model's recommended values."""
    given = {key: value for key in SAMPLING_FIELDS if (value := getattr(body, key, None)) is not None}
    if given.get("seed", 0) > MAX_SEED:
        raise invalid("seed", f"must be at most {MAX_SEED}, got {given['seed']}")
    bias = getattr(body, "logit_bias", None) or {}
    for token in bias:
        if not 0 <= token < vocab_size:
            raise invalid("logit_bias", f"token id {token} is outside the vocabulary (0..{vocab_size - 1})")
    return SamplingParams(**given, logit_bias=bias, given=frozenset(given))
