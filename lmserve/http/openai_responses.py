"""OpenAI Responses: request body (plus any stored history) -> ChatRequest, events -> the Response
object or its SSE event sequence."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from lmserve.core.errors import invalid
from lmserve.core.events import Event, Failed, Finished, KeepAlive, Usage
from lmserve.core.types import ChatRequest, Message, SamplingParams, Tool, ToolCall, name_tool_results
from lmserve.http import responses_schema as schema
from lmserve.http.common import KEEPALIVE_COMMENT, sse
from lmserve.http.request_fields import (
    ROLE_ALIASES,
    output_format,
    reasoning_fields,
    sampling_params,
    stop_strings,
    template_kwargs,
    text_content,
    tool_choice,
)
from lmserve.http.response_store import ResponseStore
from lmserve.http.responses_output import Frame, OutputItems
from lmserve.http.structs import decode


@dataclass
class ResponsesCall:
    """A parsed Responses request: what to generate, what `store` keeps, what the Response echoes."""

    chat: ChatRequest
    conversation: list[Message]  # stored history + this input, without instructions (not carried over)
    store: bool
    echo: dict[str, Any]


class _History:
    """Builds normalized turns from input items: consecutive assistant output (text, then calls)
    becomes one assistant turn, and reasoning items attach to the assistant turn that follows."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.reasoning: list[str] = []

    def add(self, message: Message) -> None:
        if message.role == "assistant" and self.reasoning:
            message.reasoning = "".join(self.reasoning)
            self.reasoning = []
        self.messages.append(message)

    def call(self, call: ToolCall) -> None:
        last = self.messages[-1] if self.messages else None
        if last is not None and last.role == "assistant":
            last.tool_calls.append(call)
        else:
            self.add(Message("assistant", tool_calls=[call]))


def _reasoning_text(item: schema.ReasoningItem) -> str:
    """Readable reasoning of a reasoning item: its full text if sent, else its summary."""
    return "".join(p.text for p in item.content or []) or "".join(p.text for p in item.summary or [])


def input_messages(value: str | list[schema.InputItem | None] | None) -> list[Message]:
    """`input`: a string (one user turn) or an array of typed items (null: a dropped one)."""
    if value is None or isinstance(value, str):
        return [Message("user", value)] if value is not None else []
    history = _History()
    for item in value:
        if isinstance(item, schema.MessageItem):
            history.add(Message(ROLE_ALIASES.get(item.role, item.role), text_content(item.content)))
        elif isinstance(item, schema.FunctionCallItem | schema.CustomToolCallItem):
            args = item.arguments if isinstance(item, schema.FunctionCallItem) else item.input
            history.call(ToolCall(item.call_id, item.name, args))
        elif isinstance(item, schema.FunctionCallOutputItem):
            history.add(Message("tool", text_content(item.output), tool_call_id=item.call_id))
        elif isinstance(item, schema.ReasoningItem):
            history.reasoning.append(_reasoning_text(item))
    return history.messages


def _function_tool(tool: schema.FunctionTool) -> dict[str, Any]:
    return {"type": "function", "name": tool.name, "description": tool.description,
            "parameters": tool.parameters, "strict": tool.strict is True}


def function_tools(tools: schema.ResponsesTools | None) -> list[dict[str, Any]]:
    """Function tools, with Codex's `namespace` groups flattened to their functions (hosted tool
    types were dropped: clients send them always)."""
    out: list[dict[str, Any]] = []
    for tool in tools or []:
        if isinstance(tool, schema.FunctionTool):
            out.append(_function_tool(tool))
        elif tool is not None:
            out.extend(_function_tool(t) for t in tool.tools or [] if t is not None)
    return out


def _merge_leading_system(messages: list[Message]) -> list[Message]:
    """instructions plus the leading developer/system items as one system turn: many chat
    templates take only one system message, first (Codex sends instructions and two developer items)."""
    n = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    if n < 2:
        return messages
    return [Message("system", "\n\n".join(m.content for m in messages[:n])), *messages[n:]]


def _echo(struct: msgspec.Struct | None) -> Any:
    return msgspec.to_builtins(struct) if struct is not None else None


def parse_responses(raw: dict[str, Any], vocab_size: int, store: ResponseStore) -> ResponsesCall:
    """Validate the whole body first, then continue the stored conversation it names, if any."""
    body = decode(schema.responses_known(raw), schema.ResponsesBody)
    for unsupported in ("conversation", "background"):
        if getattr(body, unsupported):
            raise invalid(unsupported, "is not supported by this server; continue with previous_response_id")
    items = input_messages(body.input)
    tools = function_tools(body.tools)
    text_format = (body.text.format if body.text is not None else None) or schema.TextFormat()
    fmt = output_format(body, text_format.type, text_format, "text.format", "text.format")
    sampling = sampling_params(body, vocab_size)
    keep = body.store is not False
    echo = {
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id, "store": keep, "tools": tools, "tool_choice": _echo(body.tool_choice) or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False, "metadata": body.metadata or {},
        "text": {"format": {"type": text_format.type, **_echo(text_format)}}, "truncation": "disabled",
        "reasoning": _echo(body.reasoning) or None,
    }
    previous = body.previous_response_id
    conversation = [*(store.get(previous) if previous else []), *items]
    if not conversation:
        raise invalid("input", "is required: a string or a non-empty array of input items")
    messages = [Message("system", body.instructions)] if body.instructions else []
    messages = _merge_leading_system([*messages, *conversation])
    name_tool_results(messages)  # also results answering a call of the stored history
    effort = body.reasoning.effort if body.reasoning is not None else None
    chat = ChatRequest(messages, sampling, body.max_output_tokens, stop_strings(body.stop), body.stream is True,
                       session_id=body.prompt_cache_key,
                       tools=[Tool(t["name"], t["description"], t["parameters"], t["strict"]) for t in tools],
                       tool_choice=tool_choice(body.tool_choice), output_format=fmt,
                       template_kwargs=template_kwargs(body.chat_template_kwargs), **reasoning_fields(body, effort))
    return ResponsesCall(chat, conversation, keep, echo)


# -- rendering ---------------------------------------------------------------------------------

def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


class ResponseRenderer:
    """One job's events -> a Response object or its event stream; a finished response is kept
    in the store (unless `store: false`) so that a later request can continue it."""

    def __init__(self, model_id: str, call: ResponsesCall, store: ResponseStore, sampling: SamplingParams) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model_id
        self.call = call
        self.store = store
        self.sampling = sampling  # as applied: the model's recommended values where the client set none

    def _response(self, status: str, output: list[dict[str, Any]], usage: Usage | None = None,
                  error: dict[str, str] | None = None) -> dict[str, Any]:
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model, "output": output, "usage": usage_json(usage) if usage else None,
            "temperature": self.sampling.temperature, "top_p": self.sampling.top_p, **self.call.echo,
        }

    def _finish(self, output: OutputItems, finish: Finished) -> tuple[str, list[Frame]]:
        """The final status and the frames closing the output; keeps the conversation when the
        request allows."""
        status = "incomplete" if finish.reason == "length" else "completed"
        frames = output.finish(status)
        if self.call.store:
            self.store.put(self.id, [*self.call.conversation, output.message()])
        return status, frames

    def body(self, events: list[Event]) -> dict[str, Any]:
        output = OutputItems()
        for event in events:
            output.feed(event)
        finish = next(e for e in events if isinstance(e, Finished))
        status, _ = self._finish(output, finish)
        return self._response(status, output.items, finish.usage)

    async def frames(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """The event skeleton the SDKs' stream state machines expect, numbered in order."""
        numbers = itertools.count()

        def frame(kind: str, **payload: Any) -> bytes:
            return sse({"type": kind, **payload, "sequence_number": next(numbers)}, kind)

        yield frame("response.created", response=self._response("in_progress", []))
        yield frame("response.in_progress", response=self._response("in_progress", []))
        output = OutputItems()
        async for event in events:
            if isinstance(event, Finished):
                status, frames = self._finish(output, event)
                for kind, payload in frames:
                    yield frame(kind, **payload)
                yield frame(f"response.{status}", response=self._response(status, output.items, event.usage))
            elif isinstance(event, KeepAlive):
                yield KEEPALIVE_COMMENT
            elif isinstance(event, Failed):
                for kind, payload in output.finish("incomplete"):
                    yield frame(kind, **payload)
                error = {"code": "server_error", "message": event.message}
                yield frame("response.failed", response=self._response("failed", output.items, error=error))
            else:
                for kind, payload in output.feed(event):
                    yield frame(kind, **payload)
