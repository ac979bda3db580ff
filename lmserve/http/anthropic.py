"""Anthropic Messages: request body -> ChatRequest, events -> message JSON or SSE events."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from lmserve.core.errors import invalid
from lmserve.core.events import Event, Failed, Finished, KeepAlive, Started, Usage
from lmserve.core.types import ChatRequest, Message, OutputFormat, SamplingParams, Tool, ToolCall, ToolChoice
from lmserve.http import fields
from lmserve.http.anthropic_blocks import ContentBlocks
from lmserve.http.common import KEEPALIVE_COMMENT, sse

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
UNSUPPORTED_BLOCKS = {"image": "images", "document": "documents", "search_result": "search results"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _text_blocks(value: Any, where: str) -> list[dict[str, Any]]:
    """Content as a list of blocks (a bare string is one text block)."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise invalid(where, "must be a string or an array of content blocks")
    for j, block in enumerate(value):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise invalid(f"{where}[{j}]", "must be an object with a string `type`")
        if block["type"] in UNSUPPORTED_BLOCKS:
            raise invalid(f"{where}[{j}].type",
                          f"{UNSUPPORTED_BLOCKS[block['type']]} are not supported by this text-only model")
    return value


def _block_text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text", "must be a string")
    return text


def parse_system(value: Any) -> str:
    """System text; the client's billing-header block is metadata and never reaches the prompt
    (it changes between requests and would defeat prefix reuse)."""
    if value is None:
        return ""
    blocks = _text_blocks(value, "system")
    texts = []
    for j, block in enumerate(blocks):
        if block["type"] != "text":
            raise invalid(f"system[{j}].type", "system blocks must be text")
        text = _block_text(block, f"system[{j}]")
        if j == 0 and text.startswith(BILLING_HEADER_PREFIX):
            continue
        texts.append(text)
    return "\n".join(t for t in texts if t)


def _tool_result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    parts = _text_blocks(content, f"{where}.content")
    return "".join(_block_text(p, f"{where}.content[{k}]") for k, p in enumerate(parts) if p["type"] == "text")


def parse_turn(raw: Any, where: str) -> list[Message]:
    """One Anthropic message -> one or more normalized messages (tool results become tool turns)."""
    if not isinstance(raw, dict):
        raise invalid(where, "must be an object")
    role = raw.get("role")
    if role not in ("user", "assistant", "system"):
        raise invalid(f"{where}.role", f"unknown role {role!r}; expected user or assistant")
    blocks = _text_blocks(raw.get("content", ""), f"{where}.content")
    out: list[Message] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    reasoning: list[str] = []
    for j, block in enumerate(blocks):
        kind, at = block["type"], f"{where}.content[{j}]"
        if kind == "text":
            texts.append(_block_text(block, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(ToolCall(str(block.get("id", f"toolu_{j}")), str(block.get("name", "")),
                                  json.dumps(block.get("input", {}), ensure_ascii=False)))
        elif kind == "tool_result" and role == "user":
            out.append(Message("tool", _tool_result_text(block, at), tool_call_id=block.get("tool_use_id")))
        elif kind == "thinking" and role == "assistant":
            reasoning.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking" and role == "assistant":
            continue
        else:
            raise invalid(f"{at}.type", f"content block type '{kind}' is not valid in a {role} message")
    if texts or calls or not out:
        out.append(Message(role, "".join(texts), tool_calls=calls, reasoning="".join(reasoning) or None))
    return out


def parse_tools(body: dict[str, Any]) -> list[Tool]:
    """Client tools. Their input_schema is always enforced once a call starts, leniently: a schema
    keyword the grammar engine lacks (Claude Code uses `propertyNames`) is skipped, not refused.
    Anthropic-defined tool types (bash_*, web_search_*, ...) are not offered."""
    tools = []
    for i, tool in enumerate(fields.array(body, "tools")):
        if not isinstance(tool, dict):
            raise invalid(f"tools[{i}]", "must be an object")
        if tool.get("type") in (None, "custom"):
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise invalid(f"tools[{i}].name", "must be a non-empty string")
            if not isinstance(tool.get("input_schema"), dict):
                raise invalid(f"tools[{i}].input_schema", "must be a JSON schema object")
            description = tool.get("description")
            tools.append(Tool(tool["name"], description if isinstance(description, str) else None,
                              tool["input_schema"], strict=True, lenient=True))
    return tools


def parse_tool_choice(body: dict[str, Any]) -> ToolChoice:
    choice = fields.obj(body, "tool_choice")
    kind = choice.get("type", "auto")
    if kind == "tool":
        name = fields.string(choice, "name", name="tool_choice.name")
        if not name:
            raise invalid("tool_choice.name", "is required for tool_choice type tool")
        return ToolChoice("named", name)
    if not isinstance(kind, str) or kind not in TOOL_CHOICES:
        raise invalid("tool_choice.type", "must be one of auto, any, tool, none")
    return ToolChoice(TOOL_CHOICES[kind])


def parse_thinking(body: dict[str, Any]) -> tuple[bool, int | None]:
    """`thinking` enabled (with its token budget) or adaptive turns reasoning on."""
    thinking = fields.obj(body, "thinking")
    kind = thinking.get("type", "disabled")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise invalid("thinking.type", "must be one of enabled, adaptive, disabled")
    budget = fields.integer(thinking, "budget_tokens", None, 1, name="thinking.budget_tokens")
    return kind != "disabled", budget if kind == "enabled" else None


def parse_output_format(body: dict[str, Any]) -> OutputFormat | None:
    fmt = fields.obj(fields.obj(body, "output_config"), "format", name="output_config.format")
    if not fmt:
        return None
    if fmt.get("type") != "json_schema":
        raise invalid("output_config.format.type", "must be json_schema")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise invalid("output_config.format.schema", "must be a JSON schema object")
    return OutputFormat("json_schema", schema, "output_config.format.schema")


def parse_messages(body: dict[str, Any], vocab_size: int, require_max_tokens: bool = True) -> ChatRequest:
    max_tokens = fields.integer(body, "max_tokens", None, 1)
    if max_tokens is None and require_max_tokens:
        raise invalid("max_tokens", "is required")
    raw_messages = fields.array(body, "messages")
    if not raw_messages:
        raise invalid("messages", "must be a non-empty array of messages")
    messages: list[Message] = []
    system = parse_system(body.get("system"))
    if system:
        messages.append(Message("system", system))
    for i, raw in enumerate(raw_messages):
        messages.extend(parse_turn(raw, f"messages[{i}]"))
    tools, tool_choice, output_format = parse_tools(body), parse_tool_choice(body), parse_output_format(body)
    reasoning, thinking_budget = parse_thinking(body)
    stop = fields.array(body, "stop_sequences")
    if not all(isinstance(s, str) for s in stop):
        raise invalid("stop_sequences", "must be an array of strings")
    sampling = SamplingParams(
        temperature=fields.number(body, "temperature", 1.0, 0.0, 1.0),
        top_p=fields.number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=fields.integer(body, "top_k", 0, 0) or 0,
    )
    stream = fields.boolean(body, "stream")
    return ChatRequest(messages, sampling, max_tokens, [s for s in stop if s], stream, tools=tools,
                       tool_choice=tool_choice, output_format=output_format, reasoning=reasoning,
                       thinking_budget=thinking_budget)


def usage_json(usage: Usage) -> dict[str, Any]:
    """Anthropic counts only the uncached part of the prompt as input_tokens."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens}


class MessageRenderer:
    """One job's events -> an Anthropic message body or its SSE event sequence."""

    def __init__(self, model: str) -> None:
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model

    def _message(self, content: list[dict[str, Any]], finish: Finished | None, usage: Usage) -> dict[str, Any]:
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": self._stop_reason(finish) if finish else None,
            "stop_sequence": finish.stop_sequence if finish else None,
            "usage": usage_json(usage),
        }

    @staticmethod
    def _stop_reason(finish: Finished) -> str:
        return "stop_sequence" if finish.stop_sequence else STOP_REASONS.get(finish.reason, "end_turn")

    def body(self, events: list[Event]) -> dict[str, Any]:
        blocks = ContentBlocks()
        for event in events:
            blocks.feed(event)
        blocks.close()
        finish = next(e for e in events if isinstance(e, Finished))
        return self._message(blocks.content, finish, finish.usage)

    async def frames(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """message_start as soon as the worker takes the request (it carries the cached count),
        pings while a long prefill runs (SSE comments before message_start, as no event may
        precede it), then the content blocks."""
        blocks = ContentBlocks()
        started = False
        async for event in events:
            if isinstance(event, Started):
                start = self._message([], None, Usage(event.prompt_tokens, 0, event.cached_tokens))
                yield sse({"type": "message_start", "message": start}, "message_start")
                started = True
            elif isinstance(event, KeepAlive):
                yield sse({"type": "ping"}, "ping") if started else KEEPALIVE_COMMENT
            elif isinstance(event, Finished):
                for name, payload in blocks.close():
                    yield sse(payload, name)
                yield sse({"type": "message_delta",
                           "delta": {"stop_reason": self._stop_reason(event),
                                     "stop_sequence": event.stop_sequence},
                           "usage": usage_json(event.usage)}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
            elif isinstance(event, Failed):
                yield sse({"type": "error", "error": {"type": event.error_type, "message": event.message}},
                          "error")
            else:
                for name, payload in blocks.feed(event):
                    yield sse(payload, name)
