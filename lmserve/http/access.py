"""Outermost ASGI middleware: a request id on every response, metrics, one log line per request.

The id is the client's `X-Request-Id` when it sends a sane one, else a fresh one; it is echoed on
the response (refusals included) and carried by the request's structured log line together with
the route, status, token counts and timings the dialect handler recorded on the way.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmserve.core.events import (
    CLIENT_CLOSED,
    Event,
    Failed,
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolCallEvent,
    Usage,
)
from lmserve.http.metrics import Metrics
from lmserve.serving.handle import SpeculationUsage

log = logging.getLogger("lmserve.access")
RECORD_KEY = "lmserve.record"
_SANE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
ROUTES = ("/chat/completions", "/completions", "/responses", "/messages/count_tokens", "/messages", "/embeddings",
          "/models",
          "/health", "/metrics", "/tokenize", "/detokenize")
ADMIN_ROUTES = ("/models/status", "/models/load", "/models/unload")
OLLAMA_ROUTES = ("/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/tags", "/api/ps", "/api/show",
                 "/api/version")


def route_label(path: str) -> str:
    """A bounded set of route names for metrics: unknown paths share one label."""
    if path in ADMIN_ROUTES or path in OLLAMA_ROUTES:
        return path
    bare = path.removeprefix("/v1")
    if bare.startswith("/models/"):
        return "/models/{id}"
    if bare in ROUTES or path == "/":
        return bare or "/"
    return "/static" if path.startswith("/static/") else "other"


@dataclass
class RequestRecord:
    """What one request did, filled in as its events pass on the connection side."""

    request_id: str
    started: float
    metrics: Metrics
    ttft: float | None = None  # to the first output of any kind: text, reasoning or a tool call
    last_output: float | None = None
    usage: Usage | None = None
    outcome: str | None = None  # of the generation: "ok", "error" or "client_closed"
    model: str | None = None  # the id of the model that served it

    def observe(self, event: Event) -> None:
        now = time.perf_counter()
        if isinstance(event, TextDelta | ReasoningDelta | ToolCallEvent):
            if self.ttft is None:
                self.ttft = now - self.started
                self.metrics.ttft.observe(self.ttft)
            else:
                self.metrics.inter_token.observe(now - self.last_output)
            self.last_output = now
        elif isinstance(event, Finished):
            self.usage = event.usage
            self.outcome = self.outcome or "ok"
            self.metrics.count_tokens(event.usage.prompt_tokens, event.usage.completion_tokens,
                                      event.usage.cached_tokens)
            if isinstance(event.usage, SpeculationUsage):
                self.metrics.count_drafts(event.usage.drafted, event.usage.accepted)
        elif isinstance(event, Failed):  # a client that left overrides whatever else was seen
            self.outcome = CLIENT_CLOSED if event.error_type == CLIENT_CLOSED else self.outcome or "error"


class AccessLog:
    def __init__(self, app: Callable, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        offered = dict(scope.get("headers", [])).get(b"x-request-id", b"").decode("latin-1")
        request_id = offered if _SANE_ID.match(offered) else uuid.uuid4().hex
        record = RequestRecord(request_id, time.perf_counter(), self.metrics)
        scope[RECORD_KEY] = record
        status = 500

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = route_label(scope.get("path", ""))
            self.metrics.count_request(route, status)
            if record.outcome == CLIENT_CLOSED:
                self.metrics.count_client_closed(route)
            usage = record.usage
            drafts = usage if isinstance(usage, SpeculationUsage) else None
            level = logging.DEBUG if route == "/health" else logging.INFO  # probes would drown the log
            log.log(level, json.dumps({
                "request_id": request_id, "method": scope.get("method"), "route": route, "status": status,
                "model": record.model, "outcome": record.outcome,
                "prompt_tokens": usage.prompt_tokens if usage else None,
                "completion_tokens": usage.completion_tokens if usage else None,
                "cached_tokens": usage.cached_tokens if usage else None,
                "drafted_tokens": drafts.drafted if drafts else None,
                "accepted_tokens": drafts.accepted if drafts else None,
                "ttft_ms": round(record.ttft * 1000, 1) if record.ttft is not None else None,
                "duration_ms": round((time.perf_counter() - record.started) * 1000, 1),
            }))
