"""Dialect-neutral request types: every API dialect parses into these, nothing else reaches the core."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class ToolCall:
    """A function call the assistant made (in history, or parsed from a reply)."""

    id: str
    name: str
    arguments: str  # JSON text, as the dialects carry it

    def template_arguments(self) -> Any:
        """The arguments as chat templates take them: a JSON object as a dict (Hugging Face's shape;
        Qwen3-Coder iterates it, Llama 3.1 and Mistral `tojson` it), empty text as `{}`, anything
        else (not JSON, not an object) as the text sent, for the template to show as it is."""
        if not self.arguments.strip():
            return {}
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return self.arguments
        return value if isinstance(value, dict) else self.arguments

    def template_text(self) -> str:
        """The arguments as a template writes them with `tojson`: an object in json.dumps' layout."""
        value = self.template_arguments()
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


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
        """The dict shape Hugging Face chat templates expect: calls as {"id", "type": "function",
        "function": {"name", "arguments": <dict>}}, reasoning as `reasoning_content` (the renderer
        aliases it as `thinking`, the name gpt-oss reads)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.template_arguments()}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        return out


def name_tool_results(messages: list[Message]) -> None:
    """Give each tool turn without a `name` the name of the call it answers (matched by id), as
    Hugging Face's tool message carries it; every dialect sends only the id."""
    names: dict[str, str] = {}  # call id -> name, of the latest call with that id so far
    for message in messages:
        names.update((c.id, c.name) for c in message.tool_calls)
        if message.role == "tool" and message.name is None and message.tool_call_id in names:
            message.name = names[message.tool_call_id]


@dataclass
class Tool:
    """A function the model may call. `strict` holds its arguments to `parameters` (else any JSON
    object); `lenient` skips schema keywords the grammar engine does not implement."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False
    lenient: bool = False

    def to_template(self) -> dict[str, Any]:
        """OpenAI's tool shape, the one Hugging Face chat templates render."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass
class ToolChoice:
    """Whether the model may, must or must not call a tool: mode "auto", "none", "required"
    (any offered tool) or "named" (the tool `name`)."""

    mode: str = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass
class OutputFormat:
    """A structured-output constraint as sent: kind "json_schema" (source: the schema), "json_object",
    "regex", "lark" or "gbnf" (source: the text), "choice" (source: the strings, one of which is the
    reply); `param` names the request field for errors."""

    kind: str
    source: Any
    param: str


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
    given: frozenset[str] = frozenset()  # the fields the client set; the others may take model defaults

    def with_defaults(self, defaults: dict[str, float | int]) -> SamplingParams:
        """The model's recommended values for the fields the client did not set."""
        fill = {k: v for k, v in defaults.items() if k not in self.given}
        return dataclasses.replace(self, **fill) if fill else self

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
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    output_format: OutputFormat | None = None
    # Whether the client asked for a reasoning channel (thinking): None when it did not say, and
    # the template's own default applies (Qwen3 / 3.5 think, Gemma 4 does not).
    reasoning: bool | None = None
    # "low" | "medium" | "high" for templates that take a `reasoning_effort` (gpt-oss's harmony);
    # None: the client did not say, the template's own default applies
    reasoning_effort: str | None = None
    # Tokens the reasoning may take (0: none; -1: no budget of its own); None: the server's
    # --reasoning-budget applies (chat/reasoning.py). Never more than 3/4 of max_tokens either.
    thinking_budget: int | None = None
    reasoning_inline: bool = False  # reasoning_format none: reasoning given back in the answer text
    single_call: bool = False  # parallel_tool_calls false (disable_parallel_tool_use): one call at most
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None

    @property
    def offered_tools(self) -> list[Tool]:
        """The tools the model sees: none when the client said tool_choice "none"."""
        return [] if self.tool_choice.mode == "none" else self.tools

    @property
    def constrained(self) -> bool:
        """A grammar governs the reply from its first token (so it renders with thinking off)."""
        return self.output_format is not None or (self.tool_choice.forced and bool(self.tools))
