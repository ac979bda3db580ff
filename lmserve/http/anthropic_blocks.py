"""Anthropic content blocks (thinking, text, tool_use) built from events, with the SSE events
that stream them: content_block_start, its deltas, content_block_stop.

A thinking block closes with a signature_delta. Clients send thinking blocks back with their
signature; this server keeps no secret behind it, so the signature is an opaque random token.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from lmserve.core.events import Event, ReasoningDelta, TextDelta, ToolCallEvent

Frame = tuple[str, dict[str, Any]]  # (event name, payload)

DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}


class ContentBlocks:
    """Feed events, collect frames; `close` ends the open block. `content` is the message body's."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self._open: str | None = None  # type of the open text or thinking block

    def feed(self, event: Event) -> list[Frame]:
        if isinstance(event, TextDelta | ReasoningDelta):
            kind = "text" if isinstance(event, TextDelta) else "thinking"
            frames = [] if self._open == kind else self.close() + self._start(kind)
            delta_type, key = DELTAS[kind]
            self.content[-1][key] += event.text
            return [*frames, self._frame("content_block_delta", delta={"type": delta_type, key: event.text})]
        if isinstance(event, ToolCallEvent):
            block = {"type": "tool_use", "id": f"toolu_{event.id}", "name": event.name,
                     "input": json.loads(event.arguments)}
            frames = self.close()
            self.content.append(block)
            return [*frames, self._frame("content_block_start", content_block={**block, "input": {}}),
                    self._frame("content_block_delta", delta={"type": "input_json_delta",
                                                              "partial_json": event.arguments}),
                    self._frame("content_block_stop")]
        return []

    def close(self) -> list[Frame]:
        if self._open is None:
            return []
        frames = []
        if self._open == "thinking":
            signature = uuid.uuid4().hex
            self.content[-1]["signature"] = signature
            frames.append(self._frame("content_block_delta", delta={"type": "signature_delta",
                                                                    "signature": signature}))
        self._open = None
        return [*frames, self._frame("content_block_stop")]

    def _start(self, kind: str) -> list[Frame]:
        block = {"type": kind, DELTAS[kind][1]: ""}
        if kind == "thinking":
            block["signature"] = ""
        self.content.append(block)
        self._open = kind
        return [self._frame("content_block_start", content_block=dict(block))]

    def _frame(self, name: str, **payload: Any) -> Frame:
        return name, {"type": name, "index": len(self.content) - 1, **payload}
