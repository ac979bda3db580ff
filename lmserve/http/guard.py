"""ASGI middleware in front of the app: connection cap, drain refusal, body cap, Host guard and
API key.

It runs before Litestar reads a body, so an oversized request is refused without reading it,
and every refusal is written in the envelope of the dialect the path belongs to. The operator's
probes (/health, /metrics) are never counted against or refused by the connection cap, so a full
server can still be looked at.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from lmserve.core.errors import RequestError
from lmserve.core.events import CLIENT_CLOSED
from lmserve.http.access import RECORD_KEY
from lmserve.http.common import dumps
from lmserve.http.errors import error_payload

Scope = dict[str, Any]
PROBES = frozenset({"/health", "/metrics"})
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


HOST_HEADER = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{1,5})?")  # host[:port], nothing else


def host_name(host: str) -> str | None:
    """The name of a Host header (`127.0.0.1:8080` -> `127.0.0.1`, `[::1]` -> `::1`), or None
    when it is not a plain host and port (`127.0.0.1:80@evil.com` is not)."""
    match = HOST_HEADER.fullmatch(host.strip())
    return match.group(1).strip("[]").lower() if match else None


def is_loopback_host(host: str) -> bool:
    name = host_name(host)
    if name is None:
        return False
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass
class GuardOptions:
    api_key: str | None = None
    max_conns: int = 32
    max_body: int = 4 * 1024 * 1024
    check_host: bool = True  # on a loopback bind: refuse foreign Host headers (DNS rebinding)
    allowed_hosts: set[str] = field(default_factory=set)
    cors_origins: set[str] = field(default_factory=set)  # --cors: the other origins a browser may call from
    read_timeout: float = 30.0  # the most a request body may take between two of its parts (--read-timeout)
    draining: Callable[[], bool] = lambda: False  # shutdown has begun: refuse new work with 503
    shutdown_error: Callable[[], RequestError] | None = None  # the refusal while draining


class Guard:
    """Wraps the ASGI app; counts in-flight requests for the connection cap."""

    def __init__(self, app: ASGIApp, options: GuardOptions) -> None:
        self.app = app
        self.options = options
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        probe = path in PROBES
        refusal = self._refusal(path, headers, probe, scope.get("method", "GET"))
        if refusal is not None:
            await _send_error(send, refusal, path)
            return
        if probe:
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, self._capped_receive(receive, scope), send)
        finally:
            self.in_flight -= 1

    def _same_or_allowed(self, origin: str, host: str) -> bool:
        """An Origin header of the server's own address (its chat page) or one of --cors."""
        if origin in self.options.cors_origins or "*" in self.options.cors_origins:
            return True
        return urlsplit(origin).netloc.lower() == host.strip().lower()

    def _refusal(self, path: str, headers: dict[str, str], probe: bool, method: str = "GET") -> RequestError | None:
        opts = self.options
        if not probe and opts.draining() and opts.shutdown_error is not None:
            return opts.shutdown_error()
        if not probe and self.in_flight >= opts.max_conns:
            return RequestError(f"too many concurrent connections (limit {opts.max_conns}); retry shortly",
                                503, None, "too_many_connections", {"Retry-After": "1"})
        host = headers.get("host", "")
        if opts.check_host and not (is_loopback_host(host) or host_name(host) in opts.allowed_hosts):
            return RequestError(f"Host header {host!r} is not allowed on a loopback server "
                                "(start with --allow-host to permit it)", 403, None, "host_not_allowed")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > opts.max_body:
            return self._too_large()
        origin = headers.get("origin")
        if origin is not None and not self._same_or_allowed(origin, host):
            # A web page of another origin may send a "simple" POST (text/plain, no preflight) to
            # a local server: only --cors origins, and the server's own page, may call it.
            return RequestError(f"requests from origin {origin!r} are not allowed (start with --cors {origin} "
                                "to permit it)", 403, None, "origin_not_allowed")
        if method == "OPTIONS" and "access-control-request-method" in headers:
            return None  # a CORS preflight carries no credentials by design: the CORS layer answers it
        if opts.api_key and not self._open(path) and not self._authorized(headers):
            return RequestError("missing or invalid API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`",
                                401, None, "invalid_api_key")
        return None

    def _too_large(self) -> RequestError:
        return RequestError(f"request body larger than {self.options.max_body} bytes (--max-body)", 413, "body",
                            "request_too_large")

    @staticmethod
    def _open(path: str) -> bool:
        return path == "/" or path == "/health" or path.startswith("/static/")

    def _authorized(self, headers: dict[str, str]) -> bool:
        key = self.options.api_key or ""
        bearer = headers.get("authorization", "")
        offered = bearer[7:] if bearer.lower().startswith("bearer ") else headers.get("x-api-key", "")
        return hmac.compare_digest(offered.encode(), key.encode())

    def _capped_receive(self, receive: Callable, scope: Scope) -> Callable:
        """The body as it arrives: counted (a chunked body has no Content-Length), each part
        awaited at most `read_timeout` (a client that sends headers and a few bytes must not
        hold a --conns place for ever), and a client that leaves before its body is complete
        counted as a client close, not a server error. The RequestErrors raised reach the app's
        error handler: 413, 408, and for the client gone 499 (written to nobody)."""
        seen, complete = 0, False
        limit, timeout = self.options.max_body, self.options.read_timeout

        async def wrapped() -> dict[str, Any]:
            nonlocal seen, complete
            if complete:  # after the body only a disconnect can come: waiting for it is the caller's business
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout)
            except TimeoutError:
                raise RequestError(f"the request body stalled: no part of it arrived within {timeout:g} s "
                                   "(--read-timeout)", 408, "body", "request_timeout",
                                   {"Connection": "close"}) from None
            if message["type"] == "http.disconnect":
                record = scope.get(RECORD_KEY)
                if record is not None:
                    record.outcome = CLIENT_CLOSED
                raise RequestError("the client closed the connection before its request body was complete",
                                   499, "body", CLIENT_CLOSED)
            seen += len(message.get("body", b""))
            if seen > limit:
                raise self._too_large()
            complete = not message.get("more_body", False)
            return message

        return wrapped


async def _send_error(send: Callable, err: RequestError, path: str) -> None:
    body = dumps(error_payload(err, path))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
