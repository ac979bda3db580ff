"""Responses output items (reasoning, message, function_call) built from events, together with
the stream events that announce them, in the order the SDKs' stream state machines expect.

Items open lazily: reasoning text opens a reasoning item, answer text a message item, and each
tool call is one function_call item streamed whole as soon as it closes. Non-streaming bodies
run the same builder and keep only the items.
"""

from __future__ import annotations

import uuid
from typing import Any

from lmserve.core.events import Event, ReasoningDelta, TextDelta, ToolCallEvent
from lmserve.core.types import Message, ToolCall

Frame = tuple[str, dict[str, Any]]  # (event type, payload without type and sequence number)

# What an open item of each kind streams: item id prefix, content part type, delta/done event prefix.
TEXT_ITEMS = {
    "message": ("msg", "output_text", "response.output_text"),
    "reasoning": ("rs", "reasoning_text", "response.reasoning_text"),
}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "output_text":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": kind, "text": text}


class OutputItems:
    """Feed events, collect frames; `close` finishes the open item."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # every item so far, the open one included
        self._open: str | None = None  # kind of the open text item
        self._texts: list[str] = []
        self.text = ""
        self.reasoning = ""
        self.calls: list[ToolCall] = []

    def feed(self, event: Event) -> list[Frame]:
        if isinstance(event, TextDelta | ReasoningDelta):
            kind = "message" if isinstance(event, TextDelta) else "reasoning"
            frames = [] if self._open == kind else self.close("completed") + self._start(kind)
            self._texts.append(event.text)
            if kind == "message":
                self.text += event.text
            else:
                self.reasoning += event.text
            return [*frames, (f"{TEXT_ITEMS[kind][2]}.delta", {**self._at(), "delta": event.text,
                                                               **({"logprobs": []} if kind == "message" else {})})]
        if isinstance(event, ToolCallEvent):
            return self.close("completed") + self._call(event)
        return []

    def finish(self, status: str) -> list[Frame]:
        """The end of the reply: close the open item (an empty reply is one empty message)."""
        return (self._start("message") if not self.items else []) + self.close(status)

    def close(self, status: str) -> list[Frame]:
        """Finish the open text item, if any, with `status` (completed or incomplete)."""
        if self._open is None:
            return []
        kind, (_, part_type, prefix) = self._open, TEXT_ITEMS[self._open]
        text, item = "".join(self._texts), self.items[-1]
        self._open, self._texts = None, []
        item["status"] = status
        item["content"] = [_part(part_type, text)]
        done = {**self._at(), "text": text, **({"logprobs": []} if kind == "message" else {})}
        return [(f"{prefix}.done", done),
                ("response.content_part.done", {**self._at(), "part": _part(part_type, text)}),
                ("response.output_item.done", {"output_index": len(self.items) - 1, "item": item})]

    def message(self) -> Message:
        """The assistant turn this output adds to the conversation (for previous_response_id)."""
        return Message("assistant", self.text, tool_calls=list(self.calls), reasoning=self.reasoning or None)

    def _at(self) -> dict[str, Any]:
        """Where the open text item's content is (it is always the last item)."""
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _start(self, kind: str) -> list[Frame]:
        prefix, part_type, _ = TEXT_ITEMS[kind]
        item: dict[str, Any] = {"id": f"{prefix}_{uuid.uuid4().hex}", "type": kind, "status": "in_progress",
                                "content": []}
        if kind == "message":
            item["role"] = "assistant"
        else:
            item["summary"] = []
        self.items.append(item)
        self._open = kind
        return [("response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(item)}),
                ("response.content_part.added", {**self._at(), "part": _part(part_type, "")})]

    def _call(self, call: ToolCallEvent) -> list[Frame]:
        item = {"id": f"fc_{call.id}", "type": "function_call", "call_id": f"call_{call.id}", "name": call.name,
                "arguments": call.arguments, "status": "completed"}
        self.items.append(item)
        self.calls.append(ToolCall(item["call_id"], call.name, call.arguments))
        index = len(self.items) - 1
        at = {"item_id": item["id"], "output_index": index}
        return [("response.output_item.added", {"output_index": index,
                                                "item": {**item, "arguments": "", "status": "in_progress"}}),
                ("response.function_call_arguments.delta", {**at, "delta": call.arguments}),
                ("response.function_call_arguments.done", {**at, "name": call.name, "arguments": call.arguments}),
                ("response.output_item.done", {"output_index": index, "item": item})]
