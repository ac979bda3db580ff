"""The Anthropic Messages request body (and count_tokens') as Structs. Anthropic-defined tools
are accepted and not offered: `messages_known` marks them (null) before decoding."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from lmserve.http.structs import Count, JsonSchema, NonEmpty, NonNegative, Unit, keep_known


class TextBlock(Struct, tag="text", tag_field="type"):
    text: str


class SystemBlock(Struct):
    type: Literal["text"]
    text: str


class ToolUseBlock(Struct, tag="tool_use", tag_field="type"):
    id: str | None = None
    name: str = ""
    input: dict[str, Any] = {}


class ResultPart(Struct):
    """A block of a tool result: text is read, images and documents are refused, others skipped."""

    type: str
    text: str | None = None


class ToolResultBlock(Struct, tag="tool_result", tag_field="type"):
    tool_use_id: str | None = None
    content: str | list[ResultPart] = ""


class ThinkingBlock(Struct, tag="thinking", tag_field="type"):
    thinking: str = ""


class RedactedThinkingBlock(Struct, tag="redacted_thinking", tag_field="type"):
    pass


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class AnthropicMessage(Struct):
    """A turn; `tool_use` and `thinking` go in assistant turns, `tool_result` in user turns."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block] = ""


class CustomTool(Struct, tag="custom", tag_field="type"):
    """A client tool (also without `type`): its input_schema is enforced on a call, leniently."""

    name: NonEmpty
    input_schema: JsonSchema
    description: str | None = None


AnthropicTools = Annotated[list[CustomTool | None], Meta(
    description="Anthropic-defined tool types (bash_*, web_search_*, ...) are accepted and not offered")]


class AnthropicToolChoice(Struct):
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None  # required for type tool
    disable_parallel_tool_use: bool | None = None  # true: at most one tool_use block


class Thinking(Struct):
    type: Literal["enabled", "adaptive", "disabled"] = "disabled"
    budget_tokens: Count | None = None  # enabled only


class JsonOutputFormat(Struct):
    type: Literal["json_schema"]
    schema: JsonSchema


class OutputConfig(Struct):
    format: JsonOutputFormat | None = None


class CountTokensBody(Struct, kw_only=True):
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1)]
    system: str | list[SystemBlock] | None = None  # a first block `x-anthropic-billing-header: ...` is metadata
    max_tokens: Count | None = None
    temperature: Unit | None = None
    top_p: Unit | None = None
    top_k: NonNegative | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    tools: AnthropicTools | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesBody(CountTokensBody, kw_only=True):
    max_tokens: Count


def messages_known(body: dict[str, Any]) -> dict[str, Any]:
    """The body with Anthropic-defined tools marked (null) and type-less tools typed custom."""
    tools = keep_known(body.get("tools"), lambda kind: kind != "custom", lambda tool: "custom")
    return {**body, "tools": tools}
