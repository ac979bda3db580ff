"""The one thing the HTTP side holds of a running request: its events, and a way to abandon it.

Events arrive in order: `Started` (prompt and cached token counts) first, then reply events, then
one terminal `Finished` or `Failed`. While nothing arrives for `keepalive` seconds (queued, or a
long prefill) the iterator yields `KeepAlive`, so a stream can keep its connection alive.
`cancel()` (the client left) ends the iteration at once with a `client_closed` failure and tells
the scheduler, which drops the job from the queue now and from the batch at its next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from lmserve.core.events import CLIENT_CLOSED, Event, Failed, Finished, KeepAlive, Usage
from lmserve.serving.jobs import GenerationJob

Observer = Callable[[Event], None]


@dataclass(frozen=True)
class SpeculationUsage(Usage):
    """The usage a finished job reports, with what speculative decoding did for it (the access
    log and /metrics show it; the dialects see a plain Usage)."""

    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, the tokens the model agreed with


class RequestHandle:
    def __init__(self, job: GenerationJob, cancel: Callable[[GenerationJob], None],
                 observer: Observer | None = None) -> None:
        self._job = job
        self._cancel = cancel
        self._observer = observer
        self.outcome: str | None = None  # "finished", "failed" or "client_closed", once ended
        self._closing: Failed | None = None

    @property
    def ended(self) -> bool:
        return self.outcome is not None

    def cancel(self) -> None:
        """The client is gone: give back everything the request holds. Idempotent; a no-op once
        the request ended on its own. Call on the event loop."""
        if self.ended:
            return
        self.outcome = CLIENT_CLOSED
        self._cancel(self._job)
        closing = Failed("the client closed the request", 499, CLIENT_CLOSED)
        if self._observer is not None:  # seen now: a cancelled stream is not iterated any more
            self._observer(closing)
        self._closing = closing
        self._job.channel.put_local(closing)

    async def events(self, keepalive: float | None = None) -> AsyncIterator[Event]:
        """Every event up to and including the terminal one."""
        while True:
            try:
                event = await asyncio.wait_for(self._job.channel.get(), keepalive)
            except TimeoutError:
                yield KeepAlive()
                continue
            terminal = isinstance(event, Finished | Failed)
            if terminal and self.outcome is None:
                self.outcome = "finished" if isinstance(event, Finished) else "failed"
            if self._observer is not None and event is not self._closing:
                self._observer(event)
            yield event
            if terminal:
                return
