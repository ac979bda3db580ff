"""OpenAI Responses: request body (plus any stored history) -> ChatRequest, events -> the Response
object or its SSE event sequence."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from lmserve.core.errors import invalid
from lmserve.core.events import Event, Failed, Finished, KeepAlive, Usage
from lmserve.core.types import ChatRequest, Message, Tool, ToolCall
from lmserve.http import fields
from lmserve.http.common import KEEPALIVE_COMMENT, sse
from lmserve.http.openai_chat import (
    ROLE_ALIASES,
    parse_output_format,
    parse_sampling,
    parse_tool_choice,
    reasoning_requested,
    template_kwargs,
    text_content,
)
from lmserve.http.response_store import ResponseStore
from lmserve.http.responses_output import Frame, OutputItems

INPUT_ROLES = ("developer", "system", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text")
CALL_ITEMS = {"function_call": "arguments", "custom_tool_call": "input"}  # item type -> its argument field
OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output")
# Hosted and built-in tool items (web_search_call, local_shell_call, ...) and compaction state only
# OpenAI can read: history the model here could not have produced, so it is dropped, not rejected.
DROPPED_ITEM_SUFFIXES = ("_call", "_call_output")
DROPPED_ITEMS = ("compaction",)


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
        self.call_names: dict[str, str] = {}

    def add(self, message: Message) -> None:
        if message.role == "assistant" and self.reasoning:
            message.reasoning = "".join(self.reasoning)
            self.reasoning = []
        self.messages.append(message)

    def call(self, call: ToolCall) -> None:
        self.call_names[call.id] = call.name
        last = self.messages[-1] if self.messages else None
        if last is not None and last.role == "assistant":
            last.tool_calls.append(call)
        else:
            self.add(Message("assistant", tool_calls=[call]))


def _string_field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"{where}.{key}", "must be a string")
    return value


def _reasoning_text(item: dict[str, Any]) -> str:
    """Readable reasoning of a reasoning item (full text if sent, else its summary); encrypted
    content is OpenAI's alone and is dropped."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list):
            text = "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
            if text:
                return text
    return ""


def parse_input(value: Any) -> list[Message]:
    """`input`: a string (one user turn) or an array of typed items."""
    if value is None:
        return []
    if isinstance(value, str):
        return [Message("user", value)]
    if not isinstance(value, list):
        raise invalid("input", "must be a string or an array of input items")
    history = _History()
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, "must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if not isinstance(kind, str):  # (and a list or object is unhashable)
            raise invalid(f"{where}.type", "must be a string naming the item type")
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise invalid(f"{where}.role", f"unknown role {role!r}; expected one of {', '.join(INPUT_ROLES)}")
            history.add(Message(ROLE_ALIASES[role], text_content(item.get("content"), f"{where}.content",
                                                                 TEXT_PARTS)))
        elif kind in CALL_ITEMS:
            call_id = _string_field(item, "call_id", where)
            args = _string_field(item, CALL_ITEMS[kind], where)
            history.call(ToolCall(call_id, _string_field(item, "name", where), args))
        elif kind in OUTPUT_ITEMS:
            call_id = _string_field(item, "call_id", where)
            output = text_content(item.get("output"), f"{where}.output", TEXT_PARTS)
            history.add(Message("tool", output, tool_call_id=call_id, name=history.call_names.get(call_id)))
        elif kind == "reasoning":
            history.reasoning.append(_reasoning_text(item))
        elif kind.endswith(DROPPED_ITEM_SUFFIXES) or kind in DROPPED_ITEMS:
            continue
        else:
            raise invalid(f"{where}.type", f"unsupported input item type {kind!r}")
    return history.messages


def _function_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.name", "must be a non-empty string")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid(f"{where}.parameters", "must be a JSON schema object")
    description = tool.get("description")
    return {"type": "function", "name": name, "description": description if isinstance(description, str) else None,
            "parameters": parameters, "strict": tool.get("strict") is True}


def parse_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Function tools, with Codex's `namespace` groups flattened to their functions. Hosted tool
    types (web_search, file_search, ...) are dropped, never rejected: clients send them always."""
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(fields.array(body, "tools")):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise invalid(where, "must be an object with a string `type`")
        if tool["type"] == "function":
            tools.append(_function_tool(tool, where))
        elif tool["type"] == "namespace":
            members = fields.array(tool, "tools", name=f"{where}.tools")
            tools.extend(_function_tool(t, f"{where}.tools[{j}]") for j, t in enumerate(members)
                         if isinstance(t, dict) and t.get("type") == "function")
    return tools


def _merge_leading_system(messages: list[Message]) -> list[Message]:
    """instructions plus the leading developer/system items as one system turn: many chat
    templates take only one system message, first (Codex sends instructions and two developer items)."""
    n = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    if n < 2:
        return messages
    return [Message("system", "\n\n".join(m.content for m in messages[:n])), *messages[n:]]


def parse_responses(body: dict[str, Any], vocab_size: int, store: ResponseStore) -> ResponsesCall:
    """Validate the whole body first, then continue the stored conversation it names, if any."""
    instructions = fields.string(body, "instructions")
    previous_id = fields.string(body, "previous_response_id")
    keep = fields.boolean(body, "store", True)
    for unsupported in ("conversation", "background"):
        if body.get(unsupported):
            raise invalid(unsupported, "is not supported by this server; continue with previous_response_id")
    items = parse_input(body.get("input"))
    tools = parse_tools(body)
    text_format = fields.obj(fields.obj(body, "text"), "format", name="text.format")
    output_format = parse_output_format(body, text_format, "text.format", nested=False)
    reasoning = fields.obj(body, "reasoning")
    sampling = parse_sampling(body, vocab_size)
    max_output_tokens = fields.integer(body, "max_output_tokens", None, 1)
    stop = fields.stop_strings(body, "stop")
    stream = fields.boolean(body, "stream")
    session_id = fields.string(body, "prompt_cache_key")
    echo = {
        "instructions": instructions, "max_output_tokens": max_output_tokens,
        "previous_response_id": previous_id, "store": keep, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "tools": tools, "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": fields.boolean(body, "parallel_tool_calls", True),
        "metadata": fields.obj(body, "metadata"), "text": {"format": text_format or {"type": "text"}},
        "truncation": "disabled", "reasoning": reasoning or None,
    }
    conversation = [*(store.get(previous_id) if previous_id else []), *items]
    if not conversation:
        raise invalid("input", "is required: a string or a non-empty array of input items")
    messages = [Message("system", instructions)] if instructions else []
    messages = _merge_leading_system([*messages, *conversation])
    chat = ChatRequest(messages, sampling, max_output_tokens, stop, stream, session_id=session_id,
                       tools=[Tool(t["name"], t["description"], t["parameters"], t["strict"]) for t in tools],
                       tool_choice=parse_tool_choice(body), output_format=output_format,
                       reasoning=reasoning_requested(reasoning.get("effort"), "reasoning.effort"),
                       template_kwargs=template_kwargs(body))
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

    def __init__(self, model_id: str, call: ResponsesCall, store: ResponseStore) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model_id
        self.call = call
        self.store = store

    def _response(self, status: str, output: list[dict[str, Any]], usage: Usage | None = None,
                  error: dict[str, str] | None = None) -> dict[str, Any]:
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model, "output": output, "usage": usage_json(usage) if usage else None,
            **self.call.echo,
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
