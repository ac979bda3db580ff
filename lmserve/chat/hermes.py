"""Tools for a chat template that cannot render them (ChatML, SmolLM2): the hermes convention as
Qwen's template writes it, folded into plain system, assistant and user turns.

The tool list goes into the system turn, past calls become `<tool_call>` JSON in the assistant
turn, and tool results become one user turn of `<tool_response>` blocks, so the conversation
reads exactly as a hermes-trained template would render it.
"""

from __future__ import annotations

import json

from lmserve.core.types import Message, Tool, ToolCall

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call>"
)


def tools_section(tools: list[Tool]) -> str:
    """The system-prompt section that declares the tools."""
    listed = "".join("\n" + json.dumps(t.to_template(), ensure_ascii=False) for t in tools)
    return TOOLS_HEADER + listed + TOOLS_FOOTER


def call_text(call: ToolCall) -> str:
    """One call as Qwen3's template writes it from Hugging Face's shape (arguments a dict, so in
    json.dumps' layout whatever spacing the client's JSON text had): the way the model writes it."""
    return f'<tool_call>\n{{"name": "{call.name}", "arguments": {call.template_text()}}}\n</tool_call>'


def fold(messages: list[Message], tools: list[Tool]) -> list[Message]:
    """Messages with tools, tool calls and tool results turned into plain text turns."""
    out: list[Message] = []
    if tools:
        section = tools_section(tools)
        if messages and messages[0].role == "system":
            out.append(Message("system", messages[0].content + "\n\n" + section))
            messages = messages[1:]
        else:
            out.append(Message("system", section))
    results: Message | None = None  # the user turn collecting consecutive tool results
    for message in messages:
        if message.role == "tool":
            block = f"<tool_response>\n{message.content}\n</tool_response>"
            if results is None:
                results = Message("user", block)
                out.append(results)
            else:
                results.content += "\n" + block
            continue
        results = None
        if message.role == "assistant" and message.tool_calls:
            calls = "\n".join(call_text(c) for c in message.tool_calls)
            content = message.content + "\n" + calls if message.content else calls
            out.append(Message("assistant", content, reasoning=message.reasoning))
        else:
            out.append(message)
    return out
