"""HTTP plumbing shared by the dialects: JSON bodies in and out, SSE frames, lazy streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol, TypeVar

import anyio
import anyio.to_thread
from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from lmserve.core.errors import RequestError
from lmserve.core.events import CLIENT_CLOSED, Event, Failed
from lmserve.http.access import RECORD_KEY
from lmserve.serving.handle import RequestHandle

T = TypeVar("T")

ErrorRenderer = Callable[[RequestError], Response]
MAX_DEPTH = 64  # JSON nesting a request may use (tool schemas nest, but never this far)


class Renderer(Protocol):
    """What each dialect provides for one job: SSE frames, or one JSON body."""

    def frames(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]: ...

    def body(self, events: list[Event]) -> dict[str, Any]: ...


class MultiRenderer(Protocol):
    """The same for several requests answered together (/v1/completions with several prompts)."""

    def frames(self, per_request: list[AsyncIterator[Event]]) -> AsyncIterator[bytes]: ...

    def body(self, per_request: list[list[Event]]) -> dict[str, Any]: ...


class OneOf:
    """A single-request Renderer seen as a MultiRenderer of one."""

    def __init__(self, renderer: Renderer) -> None:
        self.renderer = renderer

    def frames(self, per_request: list[AsyncIterator[Event]]) -> AsyncIterator[bytes]:
        (events,) = per_request
        return self.renderer.frames(events)

    def body(self, per_request: list[list[Event]]) -> dict[str, Any]:
        (events,) = per_request
        return self.renderer.body(events)


def dumps(payload: Any) -> bytes:
    """Compact UTF-8 JSON. A lone surrogate (only ever echoed from a refused request) is written
    as its \\u escape instead of failing the response."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(content=dumps(payload), status_code=status, media_type="application/json",
                    headers=headers)


# CPU-heavy request work (parsing a multi-megabyte body, rendering the template, tokenizing,
# compiling grammars) runs on these threads, never on the event loop: six 3 MB count_tokens
# requests froze /health and every stream for 16 s when they ran on it. The pool is bounded; the
# requests waiting for it already hold their --conns places.
WORKERS = anyio.CapacityLimiter(max(2, os.cpu_count() or 2))


WORKER_NICENESS = 10  # below the event loop and the decode thread: admission work yields the cores to them
_niced = threading.local()


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a worker thread, the event loop serving others meanwhile."""
    return await anyio.to_thread.run_sync(_niced_call, fn, args, limiter=WORKERS)


def _niced_call(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    """Run on a worker thread at a lower priority (Linux schedules each thread by its own nice
    value): with the cores busy tokenizing megabytes, /health and the streams still get them."""
    if not getattr(_niced, "done", False):
        if sys.platform == "linux":  # elsewhere a thread id is no process id: leave the priority be
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICENESS)
        _niced.done = True
    return fn(*args)


async def read_json(request: Request) -> dict[str, Any]:
    """Parse the body as a JSON object whatever the Content-Type says (curl -d sends form encoding)."""
    return await off_loop(parse_json, await request.body())


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or the RequestError that names what is wrong with it."""
    if not raw.strip():
        raise RequestError("the request body is empty; send a JSON object", 400, "body")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}", 400, "body") from None
    except ValueError:  # an integer literal past Python's digit limit (int_max_str_digits)
        raise RequestError("the request body is not valid JSON: a number has too many digits", 400, "body") from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", 400, "body")
    _check_tree(body)
    return body


def _too_deep() -> RequestError:
    return RequestError(f"the request body nests deeper than {MAX_DEPTH} levels", 400, "body")


def _check_tree(body: Any) -> None:
    """Refuse what json.loads lets through but nothing downstream can handle: nesting deeper than
    MAX_DEPTH (recursive renderers would overflow) and lone UTF-16 surrogates from `\\ud800`-style
    escapes (text that cannot be encoded, so the tokenizer cannot take it). Walks iteratively."""
    stack: list[tuple[Any, int, tuple]] = [(body, 0, ())]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, (path, key))
                stack.append((item, depth + 1, (path, key)))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, (path, i)) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path)


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode()
    except UnicodeEncodeError:
        where = _path_name(path) or "body"
        raise RequestError(f"{where}: contains a lone UTF-16 surrogate escape; text must be valid Unicode",
                           400, where) from None


def _path_name(path: tuple) -> str:
    """(((), "messages"), 0) -> "messages[0]"."""
    parts: list[str] = []
    while path:
        path, key = path
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(reversed(parts)).lstrip(".")


def sse(data: Any, event: str | None = None) -> bytes:
    """One Server-Sent Events frame; `data` is JSON-encoded unless it is already a string."""
    text = data if isinstance(data, str) else dumps(data).decode()
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


def failure_error(failure: Failed) -> RequestError:
    return RequestError(failure.message, failure.status)


KEEPALIVE_COMMENT = b": keep-alive\n\n"  # an SSE comment: every client's parser skips it


def event_stream(frames: AsyncIterator[bytes], handles: Sequence[RequestHandle],
                 media_type: str = "text/event-stream") -> Stream:
    """An admitted streaming request: the response head goes out at once, then the dialect's
    frames (SSE, or Ollama's NDJSON). However the stream ends (done, client gone, server
    stopping) the requests are let go."""

    def let_go() -> None:
        for handle in handles:
            handle.cancel()  # a no-op for a request that already ended

    async def body() -> AsyncIterator[bytes]:
        try:
            async for frame in frames:
                yield frame
        finally:
            let_go()

    # The background task runs as soon as the response is over, also when a disconnect cancelled
    # the stream while the generator sat at a `yield` (its `finally` would wait for finalization).
    return Stream(body(), media_type=media_type, background=BackgroundTask(let_go),
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def collect(handles: Sequence[RequestHandle], request: Request) -> list[list[Event]]:
    """All events of non-streaming requests, one list per handle. A client that disconnects
    meanwhile cancels them all: each list then ends in a `client_closed` failure at once, so the
    handler returns (and its connection place is given back) without waiting for the worker."""

    async def watch_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for handle in handles:
            handle.cancel()

    watcher = asyncio.create_task(watch_disconnect())
    try:
        return [[event async for event in handle.events()] for handle in handles]
    finally:
        watcher.cancel()


async def result_unless_gone(future: asyncio.Future[T], request: Request) -> T:
    """`future`'s result (work queued for the worker that is no generation: embeddings). A client
    that disconnects first cancels it, so the worker skips it if it has not run yet: a 499."""

    async def watch_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        future.cancel()

    watcher = asyncio.create_task(watch_disconnect())
    try:
        return await future
    except asyncio.CancelledError:
        if not future.cancelled() or asyncio.current_task().cancelling():
            raise  # this handler itself is being cancelled
        record = request.scope.get(RECORD_KEY)
        if record is not None:
            record.outcome = CLIENT_CLOSED
        raise RequestError("the client closed the connection before its reply", 499, None, CLIENT_CLOSED) from None
    finally:
        watcher.cancel()
