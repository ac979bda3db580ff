"""Sampled token ids -> final text: UTF-8-safe detokenization and stop strings.

Tokens are turned into bytes and fed through an incremental UTF-8 decoder, so a character split
across tokens (an emoji, say) is only released once complete. Stop strings are a separate filter,
`StopFilter`, over text deltas: text that might still become a stop string is held back, and a
stop string that appears is never released, even when it was assembled from several tokens.
TokenStream composes the two for plain text; the reply decoder runs the filter on answer text only
(after reasoning and tool calls are routed out), so a stop string inside a think block or a call
does not end the reply.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

from lmserve.core.events import TextDelta, TokenLogprob


class StopFilter:
    """Stop strings over a stream of text deltas; `feed` each delta, `flush` when the text ends or
    is interrupted (by a tool call, say: text on either side of it cannot form one stop string).

    Logprobs stay with the text they describe: those of held-back text are released with it."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._stops = [s for s in stop if s]
        self._held = ""
        self._pending_logprobs: list[TokenLogprob] = []
        self.stop_sequence: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_sequence is not None

    def feed(self, delta: TextDelta, final: bool = False) -> TextDelta | None:
        """Returns the text that became final, if any; nothing once a stop string has appeared.
        `final`: no more text follows, so nothing is held back."""
        if self.stopped:
            return None
        self._pending_logprobs.extend(delta.logprobs)
        self._held += delta.text
        return self._release(final)

    def flush(self) -> TextDelta | None:
        """Release whatever is held (it can no longer be completed into a stop string)."""
        return self.feed(TextDelta(""), final=True)

    def _release(self, final: bool) -> TextDelta | None:
        cut = len(self._held)
        for stop in self._stops:
            at = self._held.find(stop)
            if at != -1 and at < cut:
                cut, self.stop_sequence = at, stop
        if not self.stopped and not final:
            cut -= self._partial_stop_suffix()
        out, self._held = self._held[:cut], self._held[cut:]
        if self.stopped:
            self._held = ""
        if not out:
            return None
        delta = TextDelta(out, self._pending_logprobs)
        self._pending_logprobs = []
        return delta

    def _partial_stop_suffix(self) -> int:
        """Length of the longest tail of the held text that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._held)), longest, -1):
                if self._held.endswith(stop[:n]):
                    longest = n
                    break
        return longest


class TokenStream:
    """Per-request text state; `push` one token at a time, `flush` at the end."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop: Sequence[str] = ()) -> None:
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopFilter(stop)
        self.text = ""  # everything released so far

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def stop_sequence(self) -> str | None:
        return self._stops.stop_sequence

    @property
    def pending(self) -> bytes:
        """The bytes of a character not complete yet (released once a later token completes it)."""
        return self._utf8.getstate()[0]

    def push(self, token_id: int, logprob: TokenLogprob | None = None) -> TextDelta | None:
        """Add one generated token; returns the text that became final, if any."""
        text = self._utf8.decode(self._token_bytes(token_id))
        return self._out(self._stops.feed(TextDelta(text, [logprob] if logprob is not None else [])))

    def flush(self) -> TextDelta | None:
        """End of generation: release whatever is held (a partial character becomes U+FFFD)."""
        return self._out(self._stops.feed(TextDelta(self._utf8.decode(b"", final=True)), final=True))

    def _out(self, delta: TextDelta | None) -> TextDelta | None:
        if delta is not None:
            self.text += delta.text
        return delta
