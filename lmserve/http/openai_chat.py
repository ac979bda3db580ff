"""OpenAI Chat Completions: request body -> ChatRequest, events -> chat.completion(.chunk) JSON."""

from __future__ import annotations

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
from lmserve.core.types import (
    ChatRequest,
    Message,
    Tool,
    ToolCall,
    name_tool_results,
)
from lmserve.http import chat_schema as schema
from lmserve.http.common import KEEPALIVE_COMMENT, sse
from lmserve.http.reply_summary import ReplySummary
from lmserve.http.request_fields import (
    ROLE_ALIASES,
    reasoning_fields,
    response_format,
    sampling_params,
    stop_strings,
    template_kwargs,
    text_content,
    tool_choice,
)
from lmserve.http.structs import decode


@dataclass
class ChatOptions:
    """Dialect-level choices that do not change generation."""

    include_usage: bool = False


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
