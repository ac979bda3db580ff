"""OpenAI Chat Completions: request body -> ChatRequest, events -> chat.completion(.chunk) JSON."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from msgspec import Struct

from lmserve.chat.reasoning import effort_budget
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
from lmserve.core.types import (
    ChatRequest,
    Message,
    OutputFormat,
    SamplingParams,
    Tool,
    ToolCall,
    ToolChoice,
    name_tool_results,
)
from lmserve.http import chat_schema as schema
from lmserve.http.common import KEEPALIVE_COMMENT, sse
from lmserve.http.reply_summary import ReplySummary
from lmserve.http.structs import decode

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


@dataclass
class ChatOptions:
    """Dialect-level choices that do not change generation."""

    include_usage: bool = False


def text_content(content: str | list[Any] | None) -> str:
    """A string, or an array of text parts joined: OpenAI's two shapes of message content."""
    return content if isinstance(content, str) else "".join(part.text for part in content or [])


def chat_message(raw: schema.ChatMessage) -> Message:
    """One message; a call's arguments stay JSON text (the template gets them as a dict)."""
    message = Message(ROLE_ALIASES.get(raw.role, raw.role), text_content(raw.content))
    if raw.role == "assistant":
        message.tool_calls = [ToolCall(call.id or f"call_{j}", call.function.name, call.function.arguments)
                              for j, call in enumerate(raw.tool_calls or [])]
        message.reasoning = raw.reasoning_content if raw.reasoning_content is not None else raw.reasoning
    if raw.role == "tool":
        message.tool_call_id = raw.tool_call_id
    return message


def chat_messages(raw: list[schema.ChatMessage]) -> list[Message]:
    """`messages`, each tool result named after the call it answers."""
    messages = [chat_message(m) for m in raw]
    name_tool_results(messages)
    return messages


def chat_tools(tools: list[schema.ChatTool] | None) -> list[Tool]:
    """Tool declarations in OpenAI's function shape; `strict: true` holds arguments to the schema."""
    functions = [tool.function for tool in tools or []]
    return [Tool(f.name, f.description, f.parameters, strict=f.strict is True) for f in functions]


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


def parse_chat(raw: dict[str, Any], vocab_size: int) -> tuple[ChatRequest, ChatOptions]:
    body = decode(raw, schema.ChatCompletionsBody)
    messages = chat_messages(body.messages)
    if body.n not in (None, 1):
        raise invalid("n", "only n=1 is supported (one process serves one sequence per request)")
    for legacy in ("functions", "function_call"):
        if getattr(body, legacy) is not None:
            raise invalid(legacy, "the legacy functions API is not supported; use `tools`")
    sampling = sampling_params(body, vocab_size)
    sampling.logprobs, sampling.top_logprobs = body.logprobs is True, body.top_logprobs or 0
    if sampling.top_logprobs and not sampling.logprobs:
        raise invalid("top_logprobs", "requires `logprobs: true`")
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options", "is only allowed when `stream` is true")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request = ChatRequest(messages, sampling, max_tokens, stop_strings(body.stop), body.stream is True,
                          tools=chat_tools(body.tools), tool_choice=tool_choice(body.tool_choice),
                          output_format=response_format(body, body.response_format),
                          template_kwargs=template_kwargs(body.chat_template_kwargs),
                          **reasoning_fields(body, body.reasoning_effort))
    include_usage = body.stream_options is not None and body.stream_options.include_usage is True
    return request, ChatOptions(include_usage=include_usage)


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
