"""The OpenAI Chat Completions and legacy completions request bodies as Structs, with what every
OpenAI dialect shares: sampling and constraint extensions, function tools, tool_choice and response
formats."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from lmserve.http.structs import Count, JsonSchema, NonEmpty, NonNegative, Rejected, Unit

Penalty = Annotated[float, Meta(ge=-2, le=2)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
SchemaOrText = str | JsonSchema | bool  # a JSON schema, or its JSON text


class OpenAIBody(Struct, kw_only=True):
    """Sampling and llama.cpp's / vLLM's extensions, read alike by every OpenAI route."""

    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Unit | None = None
    top_k: NonNegative | None = None
    min_p: Unit | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # It divides repeated tokens' positive logits: near 0 they overflow (1 turns it off).
    repeat_penalty: Annotated[float, Meta(ge=0.01, le=10)] | None = None
    seed: Annotated[int, Meta(ge=-(2**63), extra_json_schema={"maximum": 2**64 - 1})] | None = None
    logit_bias: dict[int, Annotated[float, Meta(ge=-100, le=100)]] | None = None
    stop: str | Annotated[list[str], Meta(max_length=4)] | None = None
    stream: bool | None = None
    grammar: str | None = None  # GBNF or Lark
    guided_grammar: str | None = None
    regex: str | None = None
    guided_regex: str | None = None
    lark: str | None = None
    json_schema: SchemaOrText | None = None
    guided_json: SchemaOrText | None = None
    guided_choice: Annotated[list[NonEmpty], Meta(min_length=1)] | None = None  # vLLM's: one of these strings


ThinkingBudget = Annotated[int, Meta(ge=-1, description="tokens; 0 turns reasoning off, -1 sets no budget")]
# llama-server's: none leaves reasoning in the answer text; auto and deepseek are the default
ReasoningFormat = Literal["none", "auto", "deepseek"]


class ChatLikeBody(OpenAIBody, kw_only=True):
    """What Chat Completions and Responses share beyond sampling: reasoning and call-count fields
    (the effort is each one's own)."""

    thinking_token_budget: ThinkingBudget | None = None  # vLLM's; wins over the effort's budget
    reasoning_format: ReasoningFormat | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call


class StreamOptions(Struct):
    include_usage: bool | None = None


class TextPart(Struct):
    type: Literal["text"]
    text: str


class FunctionDef(Struct, kw_only=True):
    name: NonEmpty
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None  # true: arguments are held to `parameters`


class ChatTool(Struct):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Struct):
    name: str


class NamedToolChoice(Struct, omit_defaults=True):
    """One function: chat's {"function": {"name"}} or Responses' {"name"} (both routes take both)."""

    type: Literal["function"]
    function: FunctionName | None = None
    name: str | None = None


ToolChoiceSpec = Literal["auto", "none", "required"] | NamedToolChoice


class JsonSchemaSpec(Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    description: str | None = None
    schema: JsonSchema | bool | None = None  # without one: any JSON object
    strict: bool | None = None  # the schema is enforced whatever it says


class ResponseFormat(Struct, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema", "regex", "grammar"] = "text"
    json_schema: JsonSchemaSpec | None = None
    regex: str | None = None  # type regex
    grammar: str | None = None  # type grammar: GBNF or Lark, as the `grammar` extension


class ToolCallFunction(Struct):
    name: str
    arguments: str = "{}"


class ChatToolCall(Struct):
    function: ToolCallFunction
    id: str | None = None


ChatContent = str | list[TextPart] | None


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: an alias of system
    content: ChatContent = None
    tool_calls: list[ChatToolCall] | None = None  # assistant
    reasoning_content: str | None = None  # assistant
    reasoning: str | None = None  # assistant: vLLM's and OpenRouter's name for reasoning_content
    tool_call_id: str | None = None  # tool


class ChatCompletionsBody(ChatLikeBody, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    n: Annotated[Count, Meta(description="only 1")] | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None  # requires logprobs
    stream_options: StreamOptions | None = None  # only with stream
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoiceSpec | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None  # anything but none / minimal turns reasoning on
    chat_template_kwargs: dict[str, Any] | None = None
    functions: Rejected = None  # the legacy functions API
    function_call: Rejected = None


class CompletionsBody(OpenAIBody, kw_only=True):
    """POST /v1/completions: a prompt is a string, an array of strings (one choice each), an array
    of token ids or an array of such arrays."""

    prompt: str | list[str | NonNegative | list[NonNegative]]
    max_tokens: Count | None = None  # default 16
    logprobs: TopLogprobs | None = None
    echo: Annotated[bool, Meta(description="only false")] | None = None
    suffix: Rejected = None
    n: Annotated[Count, Meta(description="only 1")] | None = None
    best_of: Annotated[Count, Meta(description="only 1")] | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
