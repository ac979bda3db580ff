"""uvicorn's HTTP/1.1 protocol with a deadline on a request's headers.

uvicorn times out an idle kept-alive connection, but not one that has started a request: a client
that sends half a request line, or headers without their blank line, holds its socket and file
descriptor for as long as it likes (slowloris), and many of them exhaust the process's. Here a
request's headers must be whole within `--read-timeout` seconds of the connection opening, or of
the first byte after the previous reply; otherwise the client gets a 408 and the connection is
closed (one that never sent a byte is just closed). Bodies have their own deadline in `guard.py`, between parts. h11 is chosen explicitly (not
httptools when installed) so the deadline always applies.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_MESSAGE = b"request headers not received in time (--read-timeout)\n"
TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_MESSAGE), _MESSAGE))


def header_deadline_protocol(seconds: float) -> type[H11Protocol]:
    """The protocol class to give `uvicorn.Config(http=...)`: headers are due within `seconds`."""

    class HeaderDeadlineProtocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._started = False  # bytes of a request whose headers are not whole
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # the next request's headers are not whole yet
                self._started = True
                self._arm()
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._started = False
            self._disarm()  # the next request's clock starts with its first byte (keep-alive runs until then)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(seconds, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                if self._started:  # a connection that never sent a byte is closed without a word
                    self.transport.write(TIMEOUT_RESPONSE)
                self.transport.close()

    return HeaderDeadlineProtocol
