"""Sampled token ids -> final answer text: UTF-8-safe detokenization and stop strings.

Tokens are turned into bytes and fed through an incremental UTF-8 decoder, so a character split
across tokens (an emoji, say) is only released once complete. Text that might still become a
stop string is held back; a stop string that appears is never released, even when it was
assembled from several tokens.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

from lmserve.core.events import TextDelta, TokenLogprob


class TokenStream:
    """Per-request text state; `push` one token at a time, `flush` at the end."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop: Sequence[str] = ()) -> None:
        self._token_bytes = token_bytes
        self._stops = [s for s in stop if s]
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self._pending_logprobs: list[TokenLogprob] = []
        self.stop_sequence: str | None = None
        self.text = ""  # everything released so far

    @property
    def stopped(self) -> bool:
        return self.stop_sequence is not None

    def push(self, token_id: int, logprob: TokenLogprob | None = None) -> TextDelta | None:
        """Add one generated token; returns the text that became final, if any."""
        if logprob is not None:
            self._pending_logprobs.append(logprob)
        self._held += self._utf8.decode(self._token_bytes(token_id))
        return self._release(final=False)

    def flush(self) -> TextDelta | None:
        """End of generation: release whatever is held (a partial character becomes U+FFFD)."""
        self._held += self._utf8.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> TextDelta | None:
        if self.stopped:
            return None
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
        self.text += out
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
