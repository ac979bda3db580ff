"""Final reply text -> answer, reasoning and tool-call events.

Runs after TokenStream (UTF-8 safety) and before StopFilter (stop strings, on answer text only). A leading
`<think>...</think>` becomes ReasoningDelta; with tools offered, each `<tool_call>...</tool_call>`
(or the model family's own markers) becomes ToolCallEvent once it closes. Text that could still be
the start of a marker is held back, as TokenStream holds back stop strings, so a marker split
across tokens never leaks into the answer. A call that does not parse passes through as text.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from lmserve.chat.tool_format import ToolFormat
from lmserve.core.events import Event, ReasoningDelta, TextDelta, TokenLogprob, ToolCallEvent

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class CallRouting:
    """The tool-call format plus the offered tools it may name."""

    format: ToolFormat
    tools: list[dict[str, Any]]  # template-shaped, as the parsers take them
    names: frozenset[str]


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


@dataclass
class ReplyRouter:
    """Per-reply routing state; `feed` final text deltas, `flush` at the end."""

    think: bool = False  # the model has a reasoning channel: route a leading think block
    calls: CallRouting | None = None
    in_think: bool = False  # the prompt already opened the think block
    _state: str = field(init=False)
    _buf: str = field(init=False, default="")
    _skip_space: bool = field(init=False, default=False)  # drop whitespace after a closed block
    _logprobs: list[TokenLogprob] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._state = "think" if self.in_think else "start" if self.think else "text"
        self._skip_space = self.in_think

    @property
    def thinking(self) -> bool:
        return self._state == "think"

    def feed(self, delta: TextDelta) -> list[Event]:
        self._buf += delta.text
        self._logprobs.extend(delta.logprobs)
        out: list[Event] = []
        while self._step(out, final=False):
            pass
        return out

    def flush(self) -> list[Event]:
        """End of reply: whatever is held is released (an unclosed call as plain text)."""
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        if self._state == "think":
            self._reasoning(out, self._buf)
        elif self._state == "call" and self.calls is not None:
            self._text(out, self.calls.format.start + self._buf)
        else:
            self._text(out, self._buf)
        self._buf = ""
        return out

    # -- one transition at a time; True while there is more to do ------------------------------

    def _step(self, out: list[Event], final: bool) -> bool:
        if self._skip_space:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._skip_space = False
        if self._state == "start":
            return self._start(final)
        if self._state == "think":
            return self._in_think(out, final)
        if self._state == "call":
            return self._in_call(out)
        return self._in_text(out, final)

    def _start(self, final: bool) -> bool:
        head = self._buf.lstrip()
        for marker, state in ((THINK_OPEN, "think"), (THINK_CLOSE, "text")):  # a stray closer is dropped
            if head.startswith(marker):
                self._buf, self._state, self._skip_space = head[len(marker):], state, True
                self._logprobs = []  # logprobs describe answer tokens only
                return True
            if not final and marker.startswith(head):
                return False  # could still become a marker (or is only whitespace so far)
        self._state = "text"
        return True

    def _in_think(self, out: list[Event], final: bool) -> bool:
        at = self._buf.find(THINK_CLOSE)
        if at == -1:
            keep = 0 if final else partial_suffix(self._buf, THINK_CLOSE)
            self._reasoning(out, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._reasoning(out, self._buf[:at])
        self._buf, self._state, self._skip_space = self._buf[at + len(THINK_CLOSE):], "text", True
        self._logprobs = []
        return True

    def _in_text(self, out: list[Event], final: bool) -> bool:
        start = self.calls.format.start if self.calls else None
        at = self._buf.find(start) if start else -1
        if at == -1:
            keep = partial_suffix(self._buf, start) if start and not final else 0
            self._text(out, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._text(out, self._buf[:at])
        self._buf, self._state = self._buf[at + len(start):], "call"
        return True

    def _in_call(self, out: list[Event]) -> bool:
        assert self.calls is not None
        fmt = self.calls.format
        at = self._buf.find(fmt.end)
        if at == -1:
            return False
        body, self._buf = self._buf[:at], self._buf[at + len(fmt.end):]
        self._state, self._skip_space = "text", True
        try:
            calls = fmt.parse(body, self.calls.tools, self.calls.names)
        except ValueError:
            self._text(out, fmt.start + body + fmt.end)  # malformed: the client sees what was written
            return True
        out.extend(ToolCallEvent(uuid.uuid4().hex[:24], c.name, c.arguments) for c in calls)
        self._logprobs = []
        return True

    # -- emitting ---------------------------------------------------------------------------------

    def _text(self, out: list[Event], text: str) -> None:
        if text:
            out.append(TextDelta(text, self._logprobs))
            self._logprobs = []

    def _reasoning(self, out: list[Event], text: str) -> None:
        if text:
            out.append(ReasoningDelta(text))
            self._logprobs = []
