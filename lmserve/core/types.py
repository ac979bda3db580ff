"""Dialect-neutral request types: every API dialect parses into these, nothing else reaches the core."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class ToolCall:
    """A function call the assistant made (in history, or parsed from a reply)."""

    id: str
    name: str
    arguments: str  # JSON text, as the dialects carry it


@dataclass
class Message:
    """One turn of a conversation after the dialect's shape has been removed."""

    role: str
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The dict shape Hugging Face chat templates expect."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        return out


@dataclass
class SamplingParams:
    """How to pick each next token. temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def needs_host_logits(self) -> bool:
        """True when the host must see the full logits (anything beyond a plain argmax)."""
        return (
            not self.greedy
            or self.logprobs
            or bool(self.logit_bias)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repeat_penalty != 1.0
        )


@dataclass
class ChatRequest:
    """A normalized chat request: what to render, how to sample, when to stop."""

    messages: list[Message]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    tools: list[dict[str, Any]] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None
