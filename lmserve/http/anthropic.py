"""Anthropic Messages: request body -> ChatRequest, events -> message JSON or SSE events."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from lmserve.core.errors import RequestError, invalid
from lmserve.core.events import Event, Failed, Finished, TextDelta, Usage
from lmserve.core.types import ChatRequest, Message, SamplingParams, ToolCall
from lmserve.engine.jobs import GenerationJob
from lmserve.http import fields
from lmserve.http.common import sse

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
UNSUPPORTED_BLOCKS = {"image": "images", "document": "documents", "search_result": "search results"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


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


def parse_tools(body: dict[str, Any]) -> None:
    for i, tool in enumerate(fields.array(body, "tools")):
        if not isinstance(tool, dict):
            raise invalid(f"tools[{i}]", "must be an object")
        if tool.get("type") in (None, "custom"):
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise invalid(f"tools[{i}].name", "must be a non-empty string")
            if not isinstance(tool.get("input_schema"), dict):
                raise invalid(f"tools[{i}].input_schema", "must be a JSON schema object")
    choice = fields.obj(body, "tool_choice")
    if choice.get("type") in ("any", "tool"):
        raise RequestError("forcing a tool call (tool_choice any/tool) is not implemented yet", 501, "tool_choice")


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
    parse_tools(body)
    output_format = fields.obj(body, "output_config").get("format")
    if output_format is not None:
        raise RequestError("output_config.format is not implemented yet", 501, "output_config.format")
    stop = fields.array(body, "stop_sequences")
    if not all(isinstance(s, str) for s in stop):
        raise invalid("stop_sequences", "must be an array of strings")
    sampling = SamplingParams(
        temperature=fields.number(body, "temperature", 1.0, 0.0, 1.0),
        top_p=fields.number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=fields.integer(body, "top_k", 0, 0) or 0,
    )
    stream = fields.boolean(body, "stream")
    return ChatRequest(messages, sampling, max_tokens, [s for s in stop if s], stream)


def usage_json(usage: Usage) -> dict[str, Any]:
    """Anthropic counts only the uncached part of the prompt as input_tokens."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens}


class MessageRenderer:
    """One job's events -> an Anthropic message body or its SSE event sequence."""

    def __init__(self, model: str, job: GenerationJob) -> None:
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model
        self.job = job

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
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        finish = next(e for e in events if isinstance(e, Finished))
        content = [{"type": "text", "text": text}] if text else []
        return self._message(content, finish, finish.usage)

    async def frames(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        # Rendered after the first event, so the worker has already set the cached count.
        start = self._message([], None, Usage(len(self.job.prompt_ids), 0, self.job.cached_tokens))
        yield sse({"type": "message_start", "message": start}, "message_start")
        block_open = False
        async for event in events:
            if isinstance(event, TextDelta):
                if not block_open:
                    block_open = True
                    yield sse({"type": "content_block_start", "index": 0,
                               "content_block": {"type": "text", "text": ""}}, "content_block_start")
                yield sse({"type": "content_block_delta", "index": 0,
                           "delta": {"type": "text_delta", "text": event.text}}, "content_block_delta")
            elif isinstance(event, Finished):
                if block_open:
                    yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
                yield sse({"type": "message_delta",
                           "delta": {"stop_reason": self._stop_reason(event),
                                     "stop_sequence": event.stop_sequence},
                           "usage": usage_json(event.usage)}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
            elif isinstance(event, Failed):
                yield sse({"type": "error", "error": {"type": event.error_type, "message": event.message}},
                          "error")
