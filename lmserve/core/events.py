"""Dialect-neutral generation events: the one stream every dialect renders into its own frames."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: list[int]


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log-probability and its strongest alternatives (OpenAI's shape)."""

    token: str
    logprob: float
    bytes: list[int]
    top: list[TopLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # the part of completion_tokens spent inside a think block

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TextDelta:
    """Answer text that is final: it can no longer turn into a stop string."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class ReasoningDelta:
    """Reasoning text (a leading think block), kept out of the answer."""

    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    """One complete tool call the model made; `arguments` is JSON text. `id` is dialect-neutral
    (hex); each dialect prefixes it its own way."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Finished:
    """The end of a reply. reason: "stop" (end of turn, stop string or grammar complete),
    "length" or "tool_calls" (the turn ended after the model called tools)."""

    reason: str
    usage: Usage
    stop_sequence: str | None = None


@dataclass(frozen=True)
class Started:
    """The worker took the request: its prompt size and how much of it a KV slot already held.
    Always the first event; a stream's opening frames (Anthropic's message_start) are built from it."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class KeepAlive:
    """Nothing happened for a while (queued, or a long prefill): streams write a keep-alive frame.
    Made on the connection side by the request handle, never by the worker."""


@dataclass(frozen=True)
class Failed:
    """The request failed inside the worker; status is what an HTTP answer would carry."""

    message: str
    status: int = 500
    error_type: str = "server_error"


CLIENT_CLOSED = "client_closed"  # Failed.error_type of a request its client abandoned


Event = Started | TextDelta | ReasoningDelta | ToolCallEvent | Finished | Failed | KeepAlive
