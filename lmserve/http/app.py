"""The Litestar application: routes for every dialect over one Runtime.

Route handlers only parse, submit and render; each route also answers without the /v1 prefix.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from litestar import Litestar, MediaType, Request, Response, get, head, post
from litestar.config.cors import CORSConfig
from litestar.exceptions import HTTPException
from litestar.static_files import create_static_files_router
from msgspec import Struct

from lmserve import __version__
from lmserve.core.errors import RequestError, invalid
from lmserve.core.events import Failed
from lmserve.core.types import ChatRequest
from lmserve.http import openapi
from lmserve.http.access import RECORD_KEY, AccessLog
from lmserve.http.anthropic import MessageRenderer, parse_messages
from lmserve.http.chat_schema import ChatCompletionsBody, CompletionsBody
from lmserve.http.common import (
    ErrorRenderer,
    MultiRenderer,
    OneOf,
    Renderer,
    collect,
    event_stream,
    failure_error,
    json_response,
    off_loop,
    read_json,
)
from lmserve.http.errors import anthropic_error, openai_error, renderer_for_path
from lmserve.http.guard import Guard, GuardOptions
from lmserve.http.messages_schema import CountTokensBody, MessagesBody
from lmserve.http.metrics import Metrics
from lmserve.http.openai_chat import ChatRenderer, parse_chat
from lmserve.http.openai_completions import CompletionRenderer, parse_completion
from lmserve.http.openai_responses import ResponseRenderer, parse_responses
from lmserve.http.response_store import ResponseStore
from lmserve.http.responses_schema import ResponsesBody
from lmserve.http.structs import NonNegative, decode
from lmserve.runtime import Runtime
from lmserve.serving.handle import Observer, RequestHandle

log = logging.getLogger("lmserve.http")
STATIC = Path(__file__).parent / "static"


class TokenizeBody(Struct):
    content: str
    add_special: bool | None = None
    with_pieces: bool | None = None


class DetokenizeBody(Struct):
    tokens: list[NonNegative] = []


def both(path: str) -> list[str]:
    """A /v1 route and its prefix-less twin."""
    return [path, path.removeprefix("/v1")]


def create_app(runtime: Runtime, metrics: Metrics, cors_origins: list[str] | None = None) -> Litestar:
    model = runtime.model

    def model_card() -> dict[str, Any]:
        return {
            "id": model.model_id,
            "object": "model",
            "created": int(runtime.started_at),
            "owned_by": "lmserve",
            "context_window": runtime.ctx,
            "max_model_len": runtime.ctx,
            "meta": runtime.model_info(),
        }

    keepalive = runtime.settings.sse_keepalive

    async def answer(request: Request, handles: list[RequestHandle], stream: bool, renderer: MultiRenderer,
                     render_error: ErrorRenderer) -> Response:
        """Stream SSE frames or answer one JSON body: the same for every dialect."""
        if stream:
            return event_stream(renderer.frames([h.events(keepalive) for h in handles]), handles)
        per_handle = await collect(handles, request)
        for events in per_handle:
            if isinstance(events[-1], Failed):
                return render_error(failure_error(events[-1]))
        return json_response(renderer.body(per_handle))

    async def generate(request: Request, chat: ChatRequest, renderer: Renderer,
                       render_error: ErrorRenderer) -> Response:
        chat.session_id = chat.session_id or session_hint(request)
        prepared = await off_loop(runtime.prepare_chat, chat)
        handle = runtime.start_prepared(prepared, observer_of(request))
        return await answer(request, [handle], chat.stream, OneOf(renderer), render_error)

    @post(both("/v1/chat/completions"), status_code=200, operation_class=openapi.json_body(ChatCompletionsBody))
    async def chat_completions(request: Request) -> Response:
        chat, options = await off_loop(parse_chat, await read_json(request), model.tokenizer.vocab_size)
        return await generate(request, chat, ChatRenderer(model.model_id, chat.sampling.logprobs, options),
                              openai_error)

    responses_store = ResponseStore()

    @post(both("/v1/responses"), status_code=200, operation_class=openapi.json_body(ResponsesBody))
    async def responses(request: Request) -> Response:
        call = await off_loop(parse_responses, await read_json(request), model.tokenizer.vocab_size, responses_store)
        renderer = ResponseRenderer(model.model_id, call, responses_store, runtime.resolved_sampling(call.chat.sampling))
        return await generate(request, call.chat, renderer, openai_error)

    @post(both("/v1/messages"), status_code=200, operation_class=openapi.json_body(MessagesBody))
    async def messages(request: Request) -> Response:
        chat = await off_loop(parse_messages, await read_json(request), model.tokenizer.vocab_size)
        return await generate(request, chat, MessageRenderer(model.model_id), anthropic_error)

    @post(both("/v1/completions"), status_code=200, operation_class=openapi.json_body(CompletionsBody))
    async def completions(request: Request) -> Response:
        call = await off_loop(parse_completion, await read_json(request), model.tokenizer)
        plan = await off_loop(runtime.plan_completion, call.output_format)
        handles = runtime.start_completion(call.prompts, call.sampling, call.max_tokens, call.stop,
                                           plan, session_hint(request), observer_of(request))
        renderer = CompletionRenderer(model.model_id, call.sampling.logprobs, call.include_usage)
        return await answer(request, handles, call.stream, renderer, openai_error)

    @post(both("/v1/messages/count_tokens"), status_code=200,
          operation_class=openapi.json_body(CountTokensBody))
    async def count_tokens(request: Request) -> Response:
        chat = await off_loop(parse_messages, await read_json(request), model.tokenizer.vocab_size, False)
        return json_response({"input_tokens": await off_loop(runtime.count_prompt_tokens, chat)})

    @get(both("/v1/models"))
    async def list_models() -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @get(both("/v1/models/{model_id:path}"))
    async def get_model(model_id: str) -> Response:
        return json_response(model_card())

    @get("/health")
    async def health() -> Response:
        status = runtime.status()
        return json_response(
            {
                "status": "ok",
                "model": model.model_id,
                "engine": status.engine,
                "device": status.device,
                "context": runtime.ctx,
                "model_info": runtime.model_info(),
                "queue_depth": status.queue_depth,
                "active_sequences": status.active_sequences,
                "tokens_generated": status.tokens_generated,
                "warm": status.warm,
                "kv": status.kv,
                "auth_required": bool(runtime.settings.api_key),
                "version": __version__,
            }
        )

    @get("/fit")
    async def fit(ctx: int | None = None, slots: int | None = None) -> Response:
        """What a context and slot count would cost here (the RAM guard's arithmetic)."""
        for name, value in (("ctx", ctx), ("slots", slots)):
            if value is not None and value < 1:
                raise invalid(name, "must be a positive integer")
        return json_response(runtime.fit(ctx, slots))

    @get("/metrics")
    async def metrics_page() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @head(["/", "/v1"], include_in_schema=False)
    async def probe() -> None:
        """Claude Code opens with `HEAD /` to see whether the server is up."""

    @get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return Response((STATIC / "index.html").read_bytes(), media_type=MediaType.HTML)

    @post("/tokenize", status_code=200, operation_class=openapi.json_body(TokenizeBody))
    async def tokenize(request: Request) -> Response:
        body = decode(await read_json(request), TokenizeBody)
        return json_response({"tokens": await off_loop(_tokens, model.tokenizer, body)})

    @post("/detokenize", status_code=200, operation_class=openapi.json_body(DetokenizeBody))
    async def detokenize(request: Request) -> Response:
        ids = decode(await read_json(request), DetokenizeBody).tokens
        vocab = model.tokenizer.vocab_size
        if not all(i < vocab for i in ids):
            raise invalid("tokens", f"must be an array of token ids between 0 and {vocab - 1}")
        return json_response({"content": await off_loop(model.tokenizer.decode, ids)})

    return Litestar(
        route_handlers=[
            chat_completions,
            responses,
            messages,
            completions,
            count_tokens,
            list_models,
            get_model,
            health,
            fit,
            tokenize,
            detokenize,
            metrics_page,
            chat_page,
            probe,
            create_static_files_router(path="/static", directories=[STATIC], include_in_schema=False),
        ],
        exception_handlers={RequestError: _request_error, HTTPException: _http_error, Exception: _crash},
        cors_config=CORSConfig(allow_origins=cors_origins) if cors_origins else None,
        openapi_config=openapi.openapi_config(),
        logging_config=None,  # keep the process's own log format (cli.py)
    )


def server_app(runtime: Runtime, guard: GuardOptions, cors_origins: list[str] | None = None) -> AccessLog:
    """The full ASGI stack: request ids, metrics and logs outermost, then the guard, then the app."""
    metrics = Metrics({
        "lmserve_queue_depth": ("Requests waiting for the worker.", lambda: runtime.status().queue_depth),
        "lmserve_active_sequences": ("Sequences being generated.", lambda: runtime.status().active_sequences),
        "lmserve_kv_bytes": ("Bytes held by resident KV slots.", lambda: runtime.status().kv["kv_bytes"]),
    })
    guarded = Guard(create_app(runtime, metrics, cors_origins), guard)  # the app renders metrics: gauge after
    metrics.gauges["lmserve_requests_in_flight"] = ("Requests counted against --conns (their bodies may still be "
                                            "arriving).", lambda: guarded.in_flight)
    return AccessLog(guarded, metrics)


def observer_of(request: Request) -> Observer | None:
    """The access-log record of this request watches its events (timings, tokens, outcome)."""
    record = request.scope.get(RECORD_KEY)
    return record.observe if record is not None else None


def session_hint(request: Request) -> str | None:
    """A client's session id (ours, or Claude Code's) steers KV slot choice toward its own slot."""
    return request.headers.get("x-session-id") or request.headers.get("x-claude-code-session-id")


def _piece_json(raw: bytes) -> str | list[int]:
    """llama.cpp's piece: the text when it is valid UTF-8, else the raw bytes."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _tokens(tokenizer: Any, body: TokenizeBody) -> list[Any]:
    """/tokenize's answer: ids, or ids with their pieces."""
    ids = tokenizer.encode(body.content, add_special=body.add_special is True, parse_special=True)
    if body.with_pieces:
        return [{"id": i, "piece": _piece_json(tokenizer.token_bytes(i))} for i in ids]
    return ids


def _request_error(request: Request, exc: RequestError) -> Response:
    return renderer_for_path(request.url.path)(exc)


def _http_error(request: Request, exc: HTTPException) -> Response:
    message = str(exc.detail)
    if exc.status_code in (404, 405):  # as OpenAI's API words it: the request that matched nothing
        message = f"Invalid URL ({request.method} {request.url.path}): {message.lower()}"
    return renderer_for_path(request.url.path)(RequestError(message, exc.status_code, None))


def _crash(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    err = RequestError("internal server error; see the server log", 500)
    return renderer_for_path(request.url.path)(err)
