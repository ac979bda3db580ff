"""HTTP plumbing shared by the dialects: JSON bodies in and out, SSE frames, lazy streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from litestar import Request, Response
from litestar.response import Stream

from lmserve.core.errors import RequestError
from lmserve.core.events import Event, Failed
from lmserve.engine.jobs import GenerationJob

ErrorRenderer = Callable[[RequestError], Response]
MAX_DEPTH = 64  # JSON nesting a request may use (tool schemas nest, but never this far)


class Renderer(Protocol):
    """What each dialect provides for one job: SSE frames, or one JSON body."""

    def frames(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]: ...

    def body(self, events: list[Event]) -> dict[str, Any]: ...


def dumps(payload: Any) -> bytes:
    """Compact UTF-8 JSON. A lone surrogate (only ever echoed from a refused request) is written
    as its \\u escape instead of failing the response."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(content=dumps(payload), status_code=status, media_type="application/json",
                    headers=headers)


async def read_json(request: Request) -> dict[str, Any]:
    """Parse the body as a JSON object whatever the Content-Type says (curl -d sends form encoding)."""
    raw = await request.body()
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


async def lazy_stream(
    job: GenerationJob,
    frames: Callable[[AsyncIterator[Event]], AsyncIterator[bytes]],
    render_error: ErrorRenderer,
    siblings: Sequence[GenerationJob] = (),
) -> Response:
    """Start the SSE response only once the first event exists, so that a request failing
    before its first token gets a plain JSON error with its status instead of a 200 stream.
    `siblings` (further prompts of the same request) are cancelled with it."""
    events = job.events()
    try:
        first = await anext(events)
    except BaseException:
        cancel_all(job, siblings)
        raise
    if isinstance(first, Failed):
        cancel_all(job, siblings)
        return render_error(failure_error(first))

    async def replay() -> AsyncIterator[Event]:
        yield first
        async for event in events:
            yield event

    async def body() -> AsyncIterator[bytes]:
        try:
            async for frame in frames(replay()):
                yield frame
        finally:
            cancel_all(job, siblings)  # client gone or stream over: either way the worker may drop it

    return Stream(body(), media_type="text/event-stream",
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def cancel_all(job: GenerationJob, siblings: Sequence[GenerationJob] = ()) -> None:
    for j in (job, *siblings):
        j.cancel()


async def collect(job: GenerationJob, request: Request) -> list[Event]:
    """All events of a non-streaming job. A client that disconnects meanwhile cancels the job,
    so the worker stops generating for nobody."""

    async def watch_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()

    watcher = asyncio.create_task(watch_disconnect())
    out: list[Event] = []
    try:
        async for event in job.events():
            out.append(event)
    finally:
        watcher.cancel()
        job.cancel()
    return out
