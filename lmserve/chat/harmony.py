"""gpt-oss's harmony replies: a sequence of messages, each a header and a body, routed by channel.

The generation prompt ends with `<|start|>assistant`, so the reply starts with a header:
`<|channel|>analysis<|message|>...<|end|>` is reasoning (ReasoningDelta),
`<|channel|>final<|message|>...` the answer (TextDelta; so is a `commentary` message without a
recipient, a preamble meant for the user), and a message with a recipient,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (or, as the
template renders past calls, `to=functions.NAME<|channel|>commentary json<|message|>`), a call.
Later messages open with `<|start|>assistant`. `<|call|>` and `<|return|>` end the turn (the
scheduler stops on them), so a call's body also ends at the end of the reply. Headers never reach
the client; a call that does not parse, or names a tool that was not offered, passes through as
text with its markers. Text that could still be the start of a marker is held back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from lmserve.chat.reply_router import CallRouting, Router, call_events, partial_suffix
from lmserve.chat.tool_format import parsed_call
from lmserve.core.events import Event

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
CALL, RETURN = "<|call|>", "<|return|>"
CLOSERS = (END, CALL, RETURN, START)  # what ends a message body (START: a model that skipped <|end|>)
RECIPIENT = "to="
FUNCTIONS = "functions."
GENERATION_PROMPT = START + "assistant"
HEADER_LIMIT = 256  # characters: a "header" longer than this without <|message|> is not one
CLOSE_ANALYSIS = END + GENERATION_PROMPT  # forced when thinking has used its budget
ANALYSIS_OPEN = CHANNEL + "analysis" + MESSAGE  # how reasoning given back inline is opened

_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_RECIPIENT = re.compile(re.escape(RECIPIENT) + r"([^\s<]+)")


def start_state(prompt: str, governed: bool) -> str:
    """Where the reply starts: in a header after `<|start|>assistant`, or inside the analysis or
    final message when the prompt already opened one. A reply a grammar governs (an output format)
    is answer text from its first token."""
    if governed:
        return "final"
    tail = prompt.rstrip()
    for channel in ("analysis", "final", "commentary"):
        if tail.endswith(f"{CHANNEL}{channel}{MESSAGE}"):
            return "analysis" if channel == "analysis" else "final"
    return "header"


@dataclass
class HarmonyRouter(Router):
    """Per-reply routing state over harmony messages. States: "header", "analysis" (reasoning),
    "final" (answer), "call"."""

    THINKING: ClassVar[str] = "analysis"

    calls: CallRouting | None = None
    start: str = "header"
    _header: str = field(init=False, default="")  # the open call's header, as written
    _name: str = field(init=False, default="")
    _counted: bool = field(init=False, default=False)  # the open call is counted in `opened`

    def __post_init__(self) -> None:
        self._state = self.start

    @property
    def open_call(self) -> str | None:
        """The open call's text so far, from `to=` on (what a call grammar must accept)."""
        if self._state == "call":
            return self._header[self._header.find(RECIPIENT):] + MESSAGE + self._buf
        if self._state == "header" and (at := self._buf.find(RECIPIENT)) != -1:
            return self._buf[at:]
        return None

    def _release(self, out: list[Event]) -> None:
        """A call ends here (its `<|call|>` ended the turn); held text is released."""
        if self._state == "call":
            self._close_call(out, "")
        elif self._state == "header":
            if RECIPIENT in self._buf or "<|" not in self._buf:
                self._text(out, self._buf)  # a call cut short, or text that never was harmony
        elif self._state == "analysis":
            self._reasoning(out, self._buf)
        else:
            self._text(out, self._buf)

    def _step(self, out: list[Event], final: bool) -> bool:
        if self._state == "header":
            return self._in_header(out)
        if self._state == "call":
            return self._in_call(out)
        return self._in_body(out, final)

    def _in_header(self, out: list[Event]) -> bool:
        at = self._buf.find(MESSAGE)
        if at == -1:
            if RECIPIENT in self._buf and not self._counted:
                self._counted = True  # a call opens: the decoder may start its grammar now
                self.opened += 1
            if len(self._buf) > HEADER_LIMIT:  # not harmony after all: the text is the answer
                self._state = "final"
                return True
            return False
        header, self._buf = self._buf[:at], self._buf[at + len(MESSAGE):]
        self._logprobs = []  # header tokens are not answer tokens
        recipient = _RECIPIENT.search(header)
        counted, self._counted = self._counted, False
        if recipient is not None:
            self.opened += not counted
            self._header = header
            target = recipient.group(1)
            self._name = target[len(FUNCTIONS):] if target.startswith(FUNCTIONS) else target
            self._state = "call"
            return True
        channel = _CHANNEL.search(header)
        self._state = "analysis" if channel is not None and channel.group(1) == "analysis" else "final"
        return True

    def _in_body(self, out: list[Event], final: bool) -> bool:
        at, marker = _first(self._buf, CLOSERS)
        emit = self._reasoning if self._state == "analysis" else self._text
        if at == -1:
            keep = 0 if final else max(partial_suffix(self._buf, m) for m in CLOSERS)
            emit(out, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        emit(out, self._buf[:at])
        # <|start|> belongs to the next header; the others are dropped with the message they end
        self._buf = self._buf[at:] if marker == START else self._buf[at + len(marker):]
        self._state = "header"
        return True

    def _in_call(self, out: list[Event]) -> bool:
        at, marker = _first(self._buf, CLOSERS)
        if at == -1:
            return False
        body, self._buf = self._buf[:at], self._buf[at:] if marker == START else self._buf[at + len(marker):]
        self._close_call(out, "" if marker == START else marker, body)
        return True

    def _close_call(self, out: list[Event], marker: str, body: str | None = None) -> None:
        body = self._buf if body is None else body
        name, self._state = self._name, "header"
        try:
            if self.calls is None:
                raise ValueError("no tools were offered")
            call = parsed_call(name, self.calls.format.parser(body, self.calls.tools), self.calls.names)
        except Exception:  # malformed, or not a tool on offer: the client sees what was written
            self._text(out, self._header + MESSAGE + body + marker)
            return
        out.extend(call_events([call]))
        self._logprobs = []


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The earliest of `markers` in `text` and which one it is; (-1, "") when none is there."""
    best, which = -1, ""
    for marker in markers:
        at = text.find(marker)
        if at != -1 and (best == -1 or at < best):
            best, which = at, marker
    return best, which
