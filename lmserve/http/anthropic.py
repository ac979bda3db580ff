"""Anthropic Messages: request body -> ChatRequest, events -> message JSON or SSE events."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from lmserve.core.errors import invalid
from lmserve.core.events import Event, Failed, Finished, KeepAlive, Started, Usage
from lmserve.core.types import (
    ChatRequest,
    Message,
    OutputFormat,
    Tool,
    ToolCall,
    ToolChoice,
    name_tool_results,
)
from lmserve.http import messages_schema as schema
from lmserve.http.anthropic_blocks import ContentBlocks
from lmserve.http.common import KEEPALIVE_COMMENT, sse
from lmserve.http.request_fields import sampling_params, stop_strings
from lmserve.http.structs import REFUSED, decode, refused

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Thinking budgets -> gpt-oss's reasoning_effort: up to 4096 tokens low (Claude Code's "think" is
# 4000), up to 16384 medium ("think hard", 10000), more high ("ultrathink", 31999).
EFFORT_BUDGETS = ((4096, "low"), (16384, "medium"))


def parse_system(value: str | list[schema.SystemBlock] | None) -> str:
    """System text; the client's billing-header block is metadata and never reaches the prompt
    (it changes between requests and would defeat prefix reuse)."""
    if value is None or isinstance(value, str):
        return value or ""
    if value and value[0].text.startswith(BILLING_HEADER_PREFIX):
        value = value[1:]
    return "\n".join(b.text for b in value if b.text)


def _tool_result_text(block: schema.ToolResultBlock, where: str) -> str:
    if isinstance(block.content, str):
        return block.content
    for k, part in enumerate(block.content):
        if part.type in REFUSED:
            raise refused(part.type, f"{where}.content[{k}].type")
        if part.type == "text" and part.text is None:
            raise invalid(f"{where}.content[{k}].text", "must be a string")
    return "".join(part.text or "" for part in block.content if part.type == "text")


def parse_turn(raw: schema.AnthropicMessage, where: str) -> list[Message]:
    """One Anthropic message -> one or more normalized messages (tool results become tool turns)."""
    blocks = [schema.TextBlock(raw.content)] if isinstance(raw.content, str) else raw.content
    role, out = raw.role, []
    texts: list[str] = []
    calls: list[ToolCall] = []
    reasoning: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if isinstance(block, schema.TextBlock):
            texts.append(block.text)
        elif isinstance(block, schema.ToolUseBlock) and role == "assistant":
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(ToolCall(block.id or f"toolu_{j}", block.name, arguments))
        elif isinstance(block, schema.ToolResultBlock) and role == "user":
            out.append(Message("tool", _tool_result_text(block, at), tool_call_id=block.tool_use_id))
        elif isinstance(block, schema.ThinkingBlock) and role == "assistant":
            reasoning.append(block.thinking)
        elif not (isinstance(block, schema.RedactedThinkingBlock) and role == "assistant"):
            kind = block.__struct_config__.tag
            raise invalid(f"{at}.type", f"content block type '{kind}' is not valid in a {role} message")
    if texts or calls or not out:
        out.append(Message(role, "".join(texts), tool_calls=calls, reasoning="".join(reasoning) or None))
    return out


def check_tool_results(turn: schema.AnthropicMessage, previous: schema.AnthropicMessage | None, where: str) -> None:
    """As Anthropic's API: each tool_result answers a tool_use of the assistant turn just before it."""
    if isinstance(turn.content, str):
        return
    asked = {block.id for block in (previous.content if previous is not None and previous.role == "assistant"
                                    and not isinstance(previous.content, str) else [])
             if isinstance(block, schema.ToolUseBlock)}
    for j, block in enumerate(turn.content):
        if isinstance(block, schema.ToolResultBlock) and block.tool_use_id not in asked:
            raise invalid(f"{where}.content[{j}].tool_use_id",
                          f"unexpected tool_use_id {block.tool_use_id!r}: each tool_result block must answer a "
                          "tool_use block of the previous (assistant) message")


def effort_level(thinking: schema.Thinking) -> str:
    """`thinking` as gpt-oss's reasoning_effort: disabled (or absent) low, adaptive medium,
    enabled by its budget (medium without one)."""
    if thinking.type != "enabled":
        return "low" if thinking.type == "disabled" else "medium"
    if thinking.budget_tokens is None:
        return "medium"
    return next((level for most, level in EFFORT_BUDGETS if thinking.budget_tokens <= most), "high")


def parse_tool_choice(choice: schema.AnthropicToolChoice | None) -> ToolChoice:
    choice = choice or schema.AnthropicToolChoice()
    if choice.type != "tool":
        return ToolChoice(TOOL_CHOICES[choice.type])
    if not choice.name:
        raise invalid("tool_choice.name", "is required for tool_choice type tool")
    return ToolChoice("named", choice.name)


def parse_messages(raw: dict[str, Any], vocab_size: int, require_max_tokens: bool = True) -> ChatRequest:
    model = schema.MessagesBody if require_max_tokens else schema.CountTokensBody
    body = decode(schema.messages_known(raw), model)
    system = parse_system(body.system)
    messages = [Message("system", system)] if system else []
    for i, turn in enumerate(body.messages):
        messages.extend(parse_turn(turn, f"messages[{i}]"))
        check_tool_results(turn, body.messages[i - 1] if i else None, f"messages[{i}]")
    name_tool_results(messages)
    # Client tools' input_schema is always enforced once a call starts, leniently: a keyword the
    # grammar engine lacks (Claude Code uses `propertyNames`) is skipped, not refused.
    tools = [Tool(t.name, t.description, t.input_schema, strict=True, lenient=True)
             for t in body.tools or [] if t is not None]
    fmt = body.output_config.format if body.output_config is not None else None
    output_format = OutputFormat("json_schema", fmt.schema, "output_config.format.schema") if fmt else None
    thinking = body.thinking or schema.Thinking()  # enabled (with its token budget) or adaptive: reasoning on
    stop = stop_strings(body.stop_sequences)
    return ChatRequest(messages, sampling_params(body, vocab_size), body.max_tokens, stop, body.stream is True,
                       tools=tools, tool_choice=parse_tool_choice(body.tool_choice),
                       output_format=output_format, reasoning=thinking.type != "disabled",
                       reasoning_effort=effort_level(thinking),
                       thinking_budget=thinking.budget_tokens if thinking.type == "enabled" else None,
                       single_call=body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use is True)


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
