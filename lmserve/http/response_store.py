"""Responses kept for `previous_response_id`: a bounded in-memory map, oldest evicted first.

Serving is stateless unless a client asks otherwise, and a kept conversation costs memory until
it goes, so both the number of kept responses and their text bytes are capped. Requests are
parsed on worker threads (a lookup) while replies end on the event loop (a put): a lock keeps
the two apart.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from lmserve.core.errors import RequestError
from lmserve.core.types import Message

DEFAULT_MAX_RESPONSES = 256
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


def conversation_bytes(messages: list[Message]) -> int:
    """The UTF-8 size of a conversation's text: what dominates its memory."""
    total = 0
    for m in messages:
        total += len(m.content.encode()) + len((m.reasoning or "").encode())
        total += sum(len(c.name.encode()) + len(c.arguments.encode()) for c in m.tool_calls)
    return total


class ResponseStore:
    """response id -> the conversation it ended (its input items and its output)."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[list[Message], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, conversation: list[Message]) -> None:
        """Keep a conversation, evicting the oldest until both caps hold again. One larger
        than the byte cap on its own is not kept: continuing it is a 404 like any evicted id."""
        size = conversation_bytes(conversation)
        if size > self.max_bytes:
            return
        with self._lock:
            self._items[response_id] = (list(conversation), size)
            self._bytes += size
            while len(self._items) > self.max_responses or self._bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self._bytes -= dropped

    def get(self, response_id: str) -> list[Message]:
        """The kept conversation, or a 404 naming the id."""
        with self._lock:
            entry = self._items.get(response_id)
        if entry is None:
            raise RequestError(
                f"previous_response_id: no stored response with id '{response_id}' (unknown, created "
                "with store: false, or evicted from this server's bounded in-memory store)",
                404, "previous_response_id", "previous_response_not_found")
        return list(entry[0])
