"""ASGI middleware in front of the app: connection cap, drain refusal, body cap, Host guard and
API key.

It runs before Litestar reads a body, so an oversized request is refused without reading it,
and every refusal is written in the envelope of the dialect the path belongs to. The operator's
probes (/health, /metrics) are never counted against or refused by the connection cap, so a full
server can still be looked at.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from lmserve.core.errors import RequestError
from lmserve.http.common import dumps
from lmserve.http.errors import error_payload

Scope = dict[str, Any]
PROBES = frozenset({"/health", "/metrics"})
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


def is_loopback_host(host: str) -> bool:
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:].split("]")[0]
    elif name.count(":") == 1:
        name = name.split(":")[0]
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
        refusal = self._refusal(path, headers, probe)
        if refusal is not None:
            await _send_error(send, refusal, path)
            return
        if probe:
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, self._capped_receive(receive), send)
        finally:
            self.in_flight -= 1

    def _refusal(self, path: str, headers: dict[str, str], probe: bool) -> RequestError | None:
        opts = self.options
        if not probe and opts.draining() and opts.shutdown_error is not None:
            return opts.shutdown_error()
        if not probe and self.in_flight >= opts.max_conns:
            return RequestError(f"too many concurrent connections (limit {opts.max_conns}); retry shortly",
                                503, None, "too_many_connections", {"Retry-After": "1"})
        host = headers.get("host", "")
        if opts.check_host and not (is_loopback_host(host) or host.split(":")[0] in opts.allowed_hosts):
            return RequestError(f"Host header {host!r} is not allowed on a loopback server "
                                "(start with --allow-host to permit it)", 403, None, "host_not_allowed")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > opts.max_body:
            return self._too_large()
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

    def _capped_receive(self, receive: Callable) -> Callable:
        """A chunked body without Content-Length is counted as it arrives; the RequestError
        raised past the cap reaches the app's error handler, which answers 413."""
        seen = 0
        limit = self.options.max_body

        async def wrapped() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise self._too_large()
            return message

        return wrapped


async def _send_error(send: Callable, err: RequestError, path: str) -> None:
    body = dumps(error_payload(err, path))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
