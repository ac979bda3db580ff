"""The OpenAI Responses request body as Structs. Hosted tool items and types are accepted and
dropped: `responses_known` marks them (null) before decoding."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from msgspec import Meta, Struct

from lmserve.http.chat_schema import ChatLikeBody, FunctionDef, JsonSchemaSpec, ToolChoiceSpec
from lmserve.http.structs import Count, Rejected, keep_known

DROPPED_ITEM_SUFFIXES = ("_call", "_call_output")
DROPPED_ITEMS = ("compaction",)
TOOL_TYPES = ("function", "namespace")


class InputTextPart(Struct, tag="input_text", tag_field="type"):
    text: str


class OutputTextPart(Struct, tag="output_text", tag_field="type"):
    text: str


ResponsesContent = str | list[InputTextPart | OutputTextPart] | None


class MessageItem(Struct, tag="message", tag_field="type", kw_only=True):
    """Also an item without `type` that has a `role`."""

    role: Literal["developer", "system", "user", "assistant"]
    content: ResponsesContent = None


class FunctionCallItem(Struct, tag="function_call", tag_field="type"):
    call_id: str
    name: str
    arguments: str


class CustomToolCallItem(Struct, tag="custom_tool_call", tag_field="type"):
    call_id: str
    name: str
    input: str


class FunctionCallOutputItem(Struct, tag="function_call_output", tag_field="type"):
    call_id: str
    output: ResponsesContent = None


class CustomToolCallOutputItem(FunctionCallOutputItem, tag="custom_tool_call_output"):
    pass


class ReasoningText(Struct):
    text: str = ""


class ReasoningItem(Struct, tag="reasoning", tag_field="type"):
    """Its readable text (content, else summary) is the next assistant turn's reasoning;
    `encrypted_content` is OpenAI's alone and is dropped."""

    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] | None = None


InputItem = (MessageItem | FunctionCallItem | CustomToolCallItem | FunctionCallOutputItem
             | CustomToolCallOutputItem | ReasoningItem)
INPUT_TYPES = {cls.__struct_config__.tag for cls in get_args(InputItem)}
InputItems = Annotated[list[InputItem | None], Meta(
    description="hosted tool items (any `*_call`, `*_call_output`) and `compaction` are accepted and dropped")]


class FunctionTool(FunctionDef, tag="function", tag_field="type"):
    pass


class NamespaceTool(Struct, tag="namespace", tag_field="type"):
    """Codex's group of function tools, flattened to them."""

    tools: list[FunctionTool | None] | None = None


ResponsesTools = Annotated[list[FunctionTool | NamespaceTool | None], Meta(
    description="hosted tool types (web_search, file_search, mcp, custom, ...) are accepted and dropped")]


class TextFormat(JsonSchemaSpec, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"] = "text"


class TextConfig(Struct):
    format: TextFormat | None = None


class ReasoningConfig(Struct, omit_defaults=True):
    effort: str | None = None  # anything but none / minimal turns reasoning on
    summary: str | None = None


class ResponsesBody(ChatLikeBody, kw_only=True):
    input: str | InputItems | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # default true
    max_output_tokens: Count | None = None
    tools: ResponsesTools | None = None
    tool_choice: ToolChoiceSpec | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    conversation: Rejected = None  # no server-side conversations: use previous_response_id
    background: Rejected = None


def responses_known(body: dict[str, Any]) -> dict[str, Any]:
    """The body with dropped input items and tools marked (null), and type-less messages typed."""
    def dropped_item(kind: str) -> bool:
        return kind not in INPUT_TYPES and (kind.endswith(DROPPED_ITEM_SUFFIXES) or kind in DROPPED_ITEMS)

    def members(tool: Any) -> Any:  # a namespace keeps its function tools only
        inner = tool.get("tools") if isinstance(tool, dict) and tool.get("type") == "namespace" else None
        if not isinstance(inner, list):
            return tool
        return {**tool, "tools": [t if isinstance(t, dict) and t.get("type") == "function" else None
                                  for t in inner]}

    tools = keep_known(body.get("tools"), lambda kind: kind not in TOOL_TYPES)
    items = keep_known(body.get("input"), dropped_item, lambda item: "message" if "role" in item else None)
    return {**body, "input": items, "tools": [members(t) for t in tools] if isinstance(tools, list) else tools}
