"""OpenAI Chat Completions: request body -> ChatRequest, events -> chat.completion(.chunk) JSON."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from lmserve.core.errors import invalid
from lmserve.core.events import (
    Event,
    Failed,
    Finished,
    KeepAlive,
    ReasoningDelta,
    Started,
    TextDelta,
    TokenLogprob,
    ToolCallEvent,
    Usage,
)
from lmserve.core.types import ChatRequest, Message, OutputFormat, SamplingParams, Tool, ToolCall, ToolChoice
from lmserve.http import fields
from lmserve.http.common import KEEPALIVE_COMMENT, sse
from lmserve.http.reply_summary import ReplySummary

ROLE_ALIASES = {"developer": "system", "system": "system", "user": "user", "assistant": "assistant",
                "tool": "tool"}
# Chat's and Responses' names for the same non-text parts: both dialects reject them the same way.
UNSUPPORTED_PARTS = {"image_url": "images", "input_image": "images", "input_audio": "audio", "file": "files",
                     "input_file": "files"}
# Constraint extensions (llama.cpp's, vLLM's) -> the kind of grammar each carries.
GRAMMAR_EXTENSIONS = {"grammar": "gbnf", "regex": "regex", "lark": "lark", "json_schema": "json_schema",
                      "guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "gbnf"}
# Names the renderer passes to the chat template itself: chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")
NO_REASONING = ("none", "minimal")


@dataclass
class ChatOptions:
    """Dialect-level choices that do not change generation."""

    include_usage: bool = False


def text_content(value: Any, where: str, allowed_parts: tuple[str, ...] = ("text",)) -> str:
    """A string, or an array of text parts joined: OpenAI's two shapes of message content."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(where, "must be a string or an array of content parts")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"{where}[{j}]", "must be an object with a string `type`")
        kind = part["type"]
        if kind in UNSUPPORTED_PARTS:
            raise invalid(f"{where}[{j}].type", f"{UNSUPPORTED_PARTS[kind]} are not supported by this "
                          f"text-only model ('{kind}' content part)")
        if kind not in allowed_parts:
            raise invalid(f"{where}[{j}].type", f"unknown content part type '{kind}'")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}[{j}].text", "must be a string")
        texts.append(text)
    return "".join(texts)


def parse_tool_calls(value: Any, where: str) -> list[ToolCall]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid(where, "must be an array")
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"{where}[{j}].function.name", "must be a string")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise invalid(f"{where}[{j}].function.arguments", "must be a JSON string")
        calls.append(ToolCall(str(call.get("id") or f"call_{j}"), fn["name"], args))
    return calls


def parse_message(raw: Any, where: str) -> Message:
    if not isinstance(raw, dict):
        raise invalid(where, "must be an object")
    role = raw.get("role")
    if not isinstance(role, str) or role not in ROLE_ALIASES:  # (a list or object is unhashable)
        raise invalid(f"{where}.role", f"unknown role {role!r}; expected one of "
                      "system, developer, user, assistant, tool")
    content = text_content(raw.get("content"), f"{where}.content")
    message = Message(ROLE_ALIASES[role], content)
    if role == "assistant":
        message.tool_calls = parse_tool_calls(raw.get("tool_calls"), f"{where}.tool_calls")
        reasoning = raw.get("reasoning_content")
        message.reasoning = reasoning if isinstance(reasoning, str) else None
    if role == "tool":
        message.tool_call_id = fields.string(raw, "tool_call_id", name=f"{where}.tool_call_id")
    return message


def parse_tools(body: dict[str, Any]) -> list[Tool]:
    """Tool declarations in OpenAI's function shape; `strict: true` holds arguments to the schema."""
    tools = []
    for i, tool in enumerate(fields.array(body, "tools")):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"tools[{i}].type", "only function tools are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(f"tools[{i}].function.name", "must be a non-empty string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise invalid(f"tools[{i}].function.parameters", "must be a JSON schema object")
        description = fn.get("description")
        tools.append(Tool(fn["name"], description if isinstance(description, str) else None,
                          fn.get("parameters"), strict=fn.get("strict") is True))
    return tools


def parse_tool_choice(body: dict[str, Any]) -> ToolChoice:
    """"auto", "none", "required", or one function: chat's {"type": "function", "function":
    {"name"}} or Responses' {"type": "function", "name"}."""
    value = body.get("tool_choice")
    if value is None:
        return ToolChoice()
    if value in ("auto", "none", "required"):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else value.get("name")
        if isinstance(name, str) and name:
            return ToolChoice("named", name)
    raise invalid("tool_choice", 'must be "auto", "none", "required" or {"type": "function", ...} '
                  "naming a function")


def grammar_extension(body: dict[str, Any]) -> OutputFormat | None:
    """llama.cpp's and vLLM's constraint fields (`grammar` is GBNF or Lark); at most one."""
    present = [key for key in GRAMMAR_EXTENSIONS if body.get(key) is not None]
    if len(present) > 1:
        raise invalid(present[1], f"only one constraint may be given, got {', '.join(present)}")
    if not present:
        return None
    key = present[0]
    kind, value = GRAMMAR_EXTENSIONS[key], body[key]
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise invalid(key, f"is not valid JSON: {exc}") from None
        if not isinstance(value, dict | bool):
            raise invalid(key, "must be a JSON schema")
    elif not isinstance(value, str):
        raise invalid(key, "must be a string")
    return OutputFormat(kind, value, key)


def parse_output_format(body: dict[str, Any], fmt: dict[str, Any], param: str, nested: bool) -> OutputFormat | None:
    """A format object (text, json_object, json_schema) or a grammar extension, not both. The
    json_schema fields ({"name", "schema", "strict"}) sit under "json_schema" in chat's
    response_format (`nested`) and in the object itself in Responses' text.format."""
    extension = grammar_extension(body)
    kind = fmt.get("type", "text")
    if kind not in ("text", "json_schema", "json_object"):
        raise invalid(f"{param}.type", "must be one of text, json_schema, json_object")
    if kind == "text":
        return extension
    if extension is not None:
        raise invalid(extension.param, f"cannot be combined with {param}")
    if kind == "json_schema" and nested:
        param = f"{param}.json_schema"
        fmt = fields.obj(fmt, "json_schema", name=param)
    schema = fmt.get("schema") if kind == "json_schema" else None
    if schema is None:  # json_object, or a json_schema without a schema: any JSON object
        return OutputFormat("json_object", None, param)
    if not isinstance(schema, dict | bool):
        raise invalid(f"{param}.schema", "must be a JSON schema object")
    return OutputFormat("json_schema", schema, f"{param}.schema")


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """`chat_template_kwargs` (llama.cpp's and vLLM's extension, e.g. {"enable_thinking": false}):
    extra variables for the chat template; an explicit `enable_thinking` wins over the reasoning fields."""
    kwargs = fields.obj(body, "chat_template_kwargs")
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in kwargs:
            raise invalid(f"chat_template_kwargs.{key}", "is set by the server and cannot be overridden")
    return dict(kwargs)


def reasoning_requested(effort: Any, param: str) -> bool:
    """Any effort but none/minimal turns reasoning on (a no-op for a model without a channel)."""
    if effort is not None and not isinstance(effort, str):
        raise invalid(param, "must be a string")
    return effort is not None and effort not in NO_REASONING


def parse_sampling(body: dict[str, Any], vocab_size: int) -> SamplingParams:
    """The sampling fields the OpenAI dialects share (and llama.cpp's extensions)."""
    return SamplingParams(
        temperature=fields.number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=fields.number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=fields.integer(body, "top_k", 0, 0),
        min_p=fields.number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=fields.number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=fields.number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        # It divides repeated tokens' positive logits: near 0 they overflow (1 turns it off).
        repeat_penalty=fields.number(body, "repeat_penalty", 1.0, 0.01, 10.0),
        seed=fields.integer(body, "seed", None, -(2**63), 2**64 - 1),
        logit_bias=fields.logit_bias(body, "logit_bias", vocab_size),
    )


def parse_chat(body: dict[str, Any], vocab_size: int) -> tuple[ChatRequest, ChatOptions]:
    raw_messages = fields.array(body, "messages")
    if not raw_messages:
        raise invalid("messages", "must be a non-empty array of messages")
    messages = [parse_message(m, f"messages[{i}]") for i, m in enumerate(raw_messages)]
    if fields.integer(body, "n", 1, 1) != 1:
        raise invalid("n", "only n=1 is supported (one process serves one sequence per request)")
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise invalid(legacy, "the legacy functions API is not supported; use `tools`")
    tools = parse_tools(body)
    tool_choice = parse_tool_choice(body)
    output_format = parse_output_format(body, fields.obj(body, "response_format"), "response_format", nested=True)
    sampling = parse_sampling(body, vocab_size)
    sampling.logprobs = fields.boolean(body, "logprobs")
    sampling.top_logprobs = fields.integer(body, "top_logprobs", 0, 0, 20) or 0
    if sampling.top_logprobs and not sampling.logprobs:
        raise invalid("top_logprobs", "requires `logprobs: true`")
    max_tokens = fields.integer(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = fields.integer(body, "max_tokens", None, 1)
    stream = fields.boolean(body, "stream")
    stream_options = fields.obj(body, "stream_options")
    if stream_options and not stream:
        raise invalid("stream_options", "is only allowed when `stream` is true")
    request = ChatRequest(messages, sampling, max_tokens, fields.stop_strings(body, "stop"), stream, tools=tools,
                          tool_choice=tool_choice, output_format=output_format,
                          reasoning=reasoning_requested(body.get("reasoning_effort"), "reasoning_effort"),
                          template_kwargs=template_kwargs(body))
    return request, ChatOptions(include_usage=fields.boolean(stream_options, "include_usage"))


# -- responses ---------------------------------------------------------------------------------

def logprob_json(lp: TokenLogprob) -> dict[str, Any]:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": lp.bytes,
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in lp.top]}


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def tool_call_json(call: ToolCallEvent) -> dict[str, Any]:
    return {"id": f"call_{call.id}", "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ChatRenderer:
    """Turns one job's events into a chat.completion body or chat.completion.chunk frames."""

    def __init__(self, model_id: str, logprobs: bool, options: ChatOptions) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model = model_id
        self.logprobs = logprobs
        self.options = options

    def body(self, events: list[Event]) -> dict[str, Any]:
        reply = ReplySummary.of(events)
        logprobs = None
        if self.logprobs:
            logprobs = {"content": [logprob_json(lp) for lp in reply.logprobs], "refusal": None}
        message: dict[str, Any] = {"role": "assistant", "content": reply.text or (None if reply.calls else ""),
                                   "refusal": None, "annotations": []}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.calls:
            message["tool_calls"] = [tool_call_json(c) for c in reply.calls]
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                         "finish_reason": reply.finish.reason}],
            "usage": usage_json(reply.finish.usage),
        }

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if self.logprobs and logprobs is not None:
            choice["logprobs"] = {"content": [logprob_json(lp) for lp in logprobs], "refusal": None}
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.model, "choices": [choice]}
        if self.options.include_usage:
            chunk["usage"] = None
        return chunk

    async def frames(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """The role chunk once the worker takes the request, SSE comments while it waits or
        prefills, then one chunk per event."""
        calls = 0
        async for event in events:
            if isinstance(event, Started):
                yield sse(self._chunk({"role": "assistant", "content": ""}))
            elif isinstance(event, KeepAlive):
                yield KEEPALIVE_COMMENT
            elif isinstance(event, TextDelta):
                yield sse(self._chunk({"content": event.text}, logprobs=event.logprobs))
            elif isinstance(event, ReasoningDelta):
                yield sse(self._chunk({"reasoning_content": event.text}))
            elif isinstance(event, ToolCallEvent):
                yield sse(self._chunk({"tool_calls": [{"index": calls, **tool_call_json(event)}]}))
                calls += 1
            elif isinstance(event, Finished):
                yield sse(self._chunk({}, event.reason))
                if self.options.include_usage:
                    yield sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                               "model": self.model, "choices": [], "usage": usage_json(event.usage)})
            elif isinstance(event, Failed):
                yield sse({"error": {"message": event.message, "type": event.error_type,
                                     "param": None, "code": None}})
        yield b"data: [DONE]\n\n"
