"""A generation job and the channel that carries its events from the worker to its connection.

The worker thread never touches a socket: it puts events into the job's channel, an unbounded
asyncio queue on the connection's event loop, so a client that stops reading stalls only itself.
The buffer is bounded all the same, by the job's max_tokens. The connection side sees a job only
through its RequestHandle (serving/handle.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field

from lmserve.chat.reply import ReplyPlan
from lmserve.core.events import Event
from lmserve.core.types import SamplingParams


class EventChannel:
    """Thread -> event loop hand-off for one job's events."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()

    def put(self, event: Event) -> None:
        """Called from the worker thread."""
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def get(self) -> Event:
        return await self._queue.get()

    def put_local(self, event: Event) -> None:
        """Called on the event loop itself (the connection side ending a job it abandons)."""
        self._queue.put_nowait(event)


@dataclass(eq=False)  # jobs are compared by identity (the queue removes exactly this one)
class GenerationJob:
    """Everything the worker needs to run one request, already tokenized and validated."""

    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    channel: EventChannel
    stop: list[str] = field(default_factory=list)
    session_id: str | None = None
    reply: ReplyPlan = field(default_factory=ReplyPlan)  # reasoning, tool calls, grammar
    # Prompt tokens before the template's generation prompt (0: unknown): a hybrid cache is
    # checkpointed there, where the next turn's prompt parts from this one (serving/scheduler.py).
    history_end: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Mark the job abandoned (the worker drops it); safe from any thread, idempotent."""
        self.cancelled.set()

    def emit(self, event: Event) -> None:
        """Called from the worker thread."""
        self.channel.put(event)
