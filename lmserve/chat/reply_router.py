"""Final reply text -> answer, reasoning and tool-call events.

Runs after TokenStream (UTF-8 safety) and before StopFilter (stop strings, on answer text only). A leading
`<think>...</think>` (Gemma 4: `<|channel>thought...<channel|>`, anywhere in the reply) becomes
ReasoningDelta; with tools offered, each call in the model family's own format (`chat/tool_format.py`)
becomes ToolCallEvent once it closes: at its end marker, or where its JSON ends for the families
without one (Mistral, Llama) and for a call opened by the format's lead (Llama's `{`, hermes's bare
`{"name"`), which opens one only where the answer starts or a call just ended. Text that could
still be the start of a marker (or of the lead, where one may start) is held back, as TokenStream
holds back stop strings, so a marker split across tokens never leaks into the answer. A call that
does not parse passes through as text, markers (and the gap before a lead) and all.
gpt-oss's harmony channels have their own router (`chat/harmony.py`) with the same interface.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lmserve.chat import gemma4
from lmserve.chat.tool_format import CallScanner, ParsedCall, ToolFormat
from lmserve.core.events import Event, ReasoningDelta, TextDelta, TokenLogprob, ToolCallEvent


@dataclass(frozen=True)
class ThinkMarkers:
    """How a family writes its reasoning block, and what closes it when thinking has spent its
    budget. `anywhere`: a block may also open later in the reply and a stray closer there is dropped
    (Gemma 4: llama.cpp's parser takes thought channels between any two pieces of the answer, as
    replies end with an extra empty one or a lone `<channel|>`); otherwise only a leading block is
    reasoning and the rest is the model's text, whatever it says."""

    open: str
    close: str
    forced_close: str
    anywhere: bool = False


THINK = ThinkMarkers("<think>", "</think>", "\n</think>\n\n")
GEMMA4_THINK = ThinkMarkers(gemma4.THOUGHT_OPEN, gemma4.CHANNEL_CLOSE, "\n" + gemma4.CHANNEL_CLOSE, anywhere=True)
LEAD_GAP = " \t\r\n;"  # what may sit before a call opened by its lead


@dataclass(frozen=True)
class CallRouting:
    """The tool-call format plus the offered tools it may name."""

    format: ToolFormat
    tools: list[dict[str, Any]]  # template-shaped, as the parsers take them
    names: frozenset[str]

    def parse(self, body: str, bare: bool = False) -> list[ParsedCall]:
        return self.format.parse(body, self.tools, self.names, bare)


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def call_events(calls: list[ParsedCall]) -> list[ToolCallEvent]:
    return [ToolCallEvent(uuid.uuid4().hex[:24], c.name, c.arguments) for c in calls]


@dataclass
class Router:
    """What every router shares: `feed` final text deltas, `flush` at the end of the reply; a
    subclass steps through its states (`_step`, True while there is more to do) and releases what
    is left (`_release`). `opened` counts the calls that opened, the decoder's cue for the call
    grammar, and `open_call` is the open call's text from its opener on (what that grammar must
    accept)."""

    THINKING: ClassVar[str] = ""  # the state that is reasoning

    opened: int = field(init=False, default=0)
    _state: str = field(init=False, default="")
    _buf: str = field(init=False, default="")
    _logprobs: list[TokenLogprob] = field(init=False, default_factory=list)

    @property
    def thinking(self) -> bool:
        return self._state == self.THINKING

    @property
    def open_call(self) -> str | None:
        raise NotImplementedError

    def feed(self, delta: TextDelta) -> list[Event]:
        self._buf += delta.text
        self._logprobs.extend(delta.logprobs)
        out: list[Event] = []
        while self._step(out, final=False):
            pass
        return out

    def flush(self) -> list[Event]:
        """End of reply: whatever is held is released."""
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        self._release(out)
        self._buf = ""
        return out

    def _step(self, out: list[Event], final: bool) -> bool:
        raise NotImplementedError

    def _release(self, out: list[Event]) -> None:
        raise NotImplementedError

    def _text(self, out: list[Event], text: str) -> None:
        if text:
            out.append(TextDelta(text, self._logprobs))
            self._logprobs = []

    def _reasoning(self, out: list[Event], text: str) -> None:
        if text:
            out.append(ReasoningDelta(text))
            self._logprobs = []


@dataclass
class ReplyRouter(Router):
    """Per-reply routing state for think tags and the calls of a format with markers."""

    THINKING: ClassVar[str] = "think"

    think: bool = False  # the model has a reasoning channel: route a leading think block
    calls: CallRouting | None = None
    in_think: bool = False  # the prompt already opened the think block
    markers: ThinkMarkers = THINK
    _skip_space: bool = field(init=False, default=False)  # drop whitespace after a closed block
    _lead: bool = field(init=False, default=True)  # where the answer starts or a call just ended
    _opener: str = field(init=False, default="")  # the open call's opener, as written ("": its lead)
    _gap: str = field(init=False, default="")  # what was skipped before a lead, text again if no call
    _scan: CallScanner | None = field(init=False, default=None)
    _watch: tuple[str, ...] = field(init=False, default=())  # the markers looked for in answer text

    def __post_init__(self) -> None:
        self._state = "think" if self.in_think else "start" if self.think else "text"
        self._skip_space = self.in_think
        start = self.calls.format.start if self.calls else ""
        anywhere = (self.markers.open, self.markers.close) if self.think and self.markers.anywhere else ()
        self._watch = tuple(m for m in (start, *anywhere) if m)

    @property
    def open_call(self) -> str | None:
        return self._opener + self._buf if self._state == "call" else None

    def _release(self, out: list[Event]) -> None:
        """An unclosed think block is reasoning, an unclosed call plain text."""
        if self._state == "think":
            self._reasoning(out, self._buf)
        elif self._state == "call":
            self._text(out, self._gap + self._opener + self._buf)
        else:
            self._text(out, self._buf)

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
        for marker, state in ((self.markers.open, "think"), (self.markers.close, "text")):  # a stray closer is dropped
            if head.startswith(marker):
                self._buf, self._state, self._skip_space = head[len(marker):], state, True
                self._logprobs = []  # logprobs describe answer tokens only
                return True
            if not final and marker.startswith(head):
                return False  # could still become a marker (or is only whitespace so far)
        self._state = "text"
        return True

    def _in_think(self, out: list[Event], final: bool) -> bool:
        close = self.markers.close
        at = self._buf.find(close)
        if at == -1:
            keep = 0 if final else partial_suffix(self._buf, close)
            self._reasoning(out, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._reasoning(out, self._buf[:at])
        self._buf, self._state, self._skip_space = self._buf[at + len(close):], "text", True
        self._logprobs = []
        return True

    def _in_text(self, out: list[Event], final: bool) -> bool:
        fmt = self.calls.format if self.calls else None
        if fmt is not None and fmt.lead and self._lead:
            rest = self._buf.lstrip(LEAD_GAP)
            if rest.startswith(fmt.lead):  # a call where one may start: the gap before it is dropped
                self._open("", rest, self._buf[:len(self._buf) - len(rest)])
                return True
            if not final and fmt.lead.startswith(rest):
                return False  # a gap, or a gap and the start of the lead: hold it until it shows
            self._lead = False
        found = [(at, m) for m in self._watch if (at := self._buf.find(m)) != -1]
        if not found:
            keep = 0 if final else max((partial_suffix(self._buf, m) for m in self._watch), default=0)
            self._text(out, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        at, marker = min(found)
        self._text(out, self._buf[:at])
        rest = self._buf[at + len(marker):]
        if marker == self.markers.open:  # a later thought block (Gemma 4)
            self._buf, self._state, self._skip_space, self._logprobs = rest, "think", True, []
        elif marker == self.markers.close:  # a stray closer: dropped
            self._buf = rest
        else:
            self._open(marker, rest)
        return True

    def _open(self, opener: str, body: str, gap: str = "") -> None:
        assert self.calls is not None
        self._opener, self._gap, self._buf, self._state = opener, gap, body, "call"
        self._scan = self.calls.format.scanner(led=not opener)
        self.opened += 1

    def _in_call(self, out: list[Event]) -> bool:
        assert self.calls is not None and self._scan is not None
        end = self._scan.end(self._buf)
        if end is None:
            return False
        written, self._buf = self._buf[:end], self._buf[end:]
        marker = self.calls.format.end if self._opener else ""  # a call opened by its lead has none
        body = written[:len(written) - len(marker)] if marker else written
        self._state, self._scan = "text", None
        try:
            calls = self.calls.parse(body, bare=not self._opener)
        except ValueError:  # malformed: the client sees what was written, the gap before it too
            self._text(out, self._gap + self._opener + written)
            return True
        out.extend(call_events(calls))
        self._logprobs, self._lead, self._skip_space = [], True, True
        return True

    def _text(self, out: list[Event], text: str) -> None:
        if text:
            super()._text(out, text)
            self._lead = False
