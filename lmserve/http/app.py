"""The Litestar application: routes for every dialect over the model pool's runtimes.

Route handlers only parse, submit and render; each route also answers without the /v1 prefix. A
request's `model` picks the runtime (`ModelPool.use`, loading the model when it is not resident).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
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
    result_unless_gone,
)
from lmserve.http.errors import anthropic_error, openai_error, renderer_for_path
from lmserve.http.guard import Guard, GuardOptions
from lmserve.http.messages_schema import CountTokensBody, MessagesBody
from lmserve.http.metrics import Metrics
from lmserve.http.ollama_routes import ollama_routes
from lmserve.http.openai_chat import ChatRenderer, parse_chat
from lmserve.http.openai_completions import CompletionRenderer, parse_completion
from lmserve.http.openai_embeddings import EmbeddingsBody, parse_embeddings, render_embeddings
from lmserve.http.openai_responses import ResponseRenderer, parse_responses
from lmserve.http.response_store import ResponseStore
from lmserve.http.responses_schema import ResponsesBody
from lmserve.http.structs import NonNegative, decode
from lmserve.pool.directory import ModelChoice, file_header
from lmserve.pool.residents import ModelPool
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


class ModelBody(Struct):
    model: str


def both(path: str) -> list[str]:
    """A /v1 route and its prefix-less twin."""
    return [path, path.removeprefix("/v1")]


def requested_model(body: dict[str, Any]) -> str | None:
    """The body's `model`: which model serves it (None: the startup model)."""
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise invalid("model", "must be a string naming a model (GET /v1/models lists them)")
    return name or None


def create_app(pool: ModelPool, metrics: Metrics, cors_origins: list[str] | None = None) -> Litestar:
    runtime = pool.default  # the startup model: /fit, /tokenize, the chat page, /health's top level
    model = runtime.model

    def loaded_card(served: Runtime, name: str | None = None) -> dict[str, Any]:
        return {
            "id": name or served.model.model_id,
            "object": "model",
            "created": int(served.started_at),
            "owned_by": "lmserve",
            "loaded": True,
            "context_window": served.ctx,
            "max_model_len": served.ctx,
            "meta": served.model_info(),
        }

    def model_card(choice: ModelChoice) -> dict[str, Any]:
        resident = next((r for r in pool.residents() if r.choice.key == choice.key), None)
        if resident is not None:
            return loaded_card(resident.runtime, choice.name)
        header = file_header(choice.path)
        return {"id": choice.name, "object": "model", "created": int(header.get("modified", 0)),
                "owned_by": "lmserve", "loaded": False, "context_window": header.get("trained_context"),
                "max_model_len": header.get("trained_context"),
                "meta": {k: v for k, v in header.items() if k != "template"}}

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

    async def generate(request: Request, served: Runtime, chat: ChatRequest, renderer: Renderer,
                       render_error: ErrorRenderer) -> Response:
        chat.session_id = chat.session_id or session_hint(request)
        prepared = await off_loop(served.prepare_chat, chat)
        handle = served.start_prepared(prepared, observer_of(request, served))
        return await answer(request, [handle], chat.stream, OneOf(renderer), render_error)

    @post(both("/v1/chat/completions"), status_code=200, operation_class=openapi.json_body(ChatCompletionsBody))
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request)
        async with pool.use(requested_model(body)) as served:
            chat, options = await off_loop(parse_chat, body, served.model.tokenizer.vocab_size)
            renderer = ChatRenderer(served.model.model_id, chat.sampling.logprobs, options)
            return await generate(request, served, chat, renderer, openai_error)

    responses_store = ResponseStore()

    @post(both("/v1/responses"), status_code=200, operation_class=openapi.json_body(ResponsesBody))
    async def responses(request: Request) -> Response:
        body = await read_json(request)
        async with pool.use(requested_model(body)) as served:
            call = await off_loop(parse_responses, body, served.model.tokenizer.vocab_size, responses_store)
            renderer = ResponseRenderer(served.model.model_id, call, responses_store,
                                        served.resolved_sampling(call.chat.sampling))
            return await generate(request, served, call.chat, renderer, openai_error)

    @post(both("/v1/messages"), status_code=200, operation_class=openapi.json_body(MessagesBody))
    async def messages(request: Request) -> Response:
        body = await read_json(request)
        async with pool.use(requested_model(body)) as served:
            chat = await off_loop(parse_messages, body, served.model.tokenizer.vocab_size)
            return await generate(request, served, chat, MessageRenderer(served.model.model_id), anthropic_error)

    @post(both("/v1/completions"), status_code=200, operation_class=openapi.json_body(CompletionsBody))
    async def completions(request: Request) -> Response:
        body = await read_json(request)
        async with pool.use(requested_model(body)) as served:
            call = await off_loop(parse_completion, body, served.model.tokenizer)
            plan = await off_loop(served.plan_completion, call.output_format)
            handles = served.start_completion(call.prompts, call.sampling, call.max_tokens, call.stop,
                                              plan, session_hint(request), observer_of(request, served))
            renderer = CompletionRenderer(served.model.model_id, call.sampling.logprobs, call.include_usage)
            return await answer(request, handles, call.stream, renderer, openai_error)

    @post(both("/v1/embeddings"), status_code=200, operation_class=openapi.json_body(EmbeddingsBody))
    async def embeddings(request: Request) -> Response:
        body = await read_json(request)
        async with pool.use(requested_model(body)) as served:
            call = await off_loop(parse_embeddings, body, served.model.tokenizer, served.model.config.hidden_size)
            pending = served.embed(call.inputs)
            observer_of(request, served)
        vectors = await result_unless_gone(pending, request)
        return json_response(await off_loop(render_embeddings, call, vectors, served.model.model_id))

    @post(both("/v1/messages/count_tokens"), status_code=200,
          operation_class=openapi.json_body(CountTokensBody))
    async def count_tokens(request: Request) -> Response:
        body = await read_json(request)
        async with pool.use(requested_model(body)) as served:
            chat = await off_loop(parse_messages, body, served.model.tokenizer.vocab_size, False)
            return json_response({"input_tokens": await off_loop(served.count_prompt_tokens, chat)})

    @get(both("/v1/models"))
    async def list_models() -> Response:
        choices = await off_loop(pool.directory.listing)
        cards = await off_loop(lambda: [model_card(choice) for choice in choices])
        return json_response({"object": "list", "data": cards})

    @get(both("/v1/models/{model_id:path}"))
    async def get_model(model_id: str) -> Response:
        choice = await off_loop(pool.directory.find, model_id.lstrip("/"), False)  # a path parameter keeps its "/"
        return json_response(await off_loop(model_card, choice))

    @get("/models/status")
    async def models_status() -> Response:
        return json_response({"models": [r.describe() for r in pool.residents()], "max_models": pool.max_models,
                              "keep_alive_seconds": pool.keep_alive if pool.keep_alive != float("inf") else -1,
                              "loads": pool.loads, "unloads": pool.unloads})

    @post("/models/load", status_code=200, operation_class=openapi.json_body(ModelBody))
    async def models_load(request: Request) -> Response:
        name = decode(await read_json(request), ModelBody).model
        resident = await pool.load(name)
        return json_response({"model": resident.runtime.model.model_id, "loaded": True, **resident.describe()})

    @post("/models/unload", status_code=200, operation_class=openapi.json_body(ModelBody))
    async def models_unload(request: Request) -> Response:
        name = decode(await read_json(request), ModelBody).model
        return json_response({"model": name, "unloaded": await pool.unload_named(name)})

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
                "models": [r.describe() for r in pool.residents()],
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
            embeddings,
            count_tokens,
            list_models,
            get_model,
            models_status,
            models_load,
            models_unload,
            health,
            fit,
            tokenize,
            detokenize,
            metrics_page,
            chat_page,
            probe,
            *ollama_routes(pool, observer_of),
            create_static_files_router(path="/static", directories=[STATIC], include_in_schema=False),
        ],
        exception_handlers={RequestError: _request_error, HTTPException: _http_error, Exception: _crash},
        cors_config=CORSConfig(allow_origins=cors_origins) if cors_origins else None,
        openapi_config=openapi.openapi_config(),
        logging_config=None,  # keep the process's own log format (cli.py)
    )


def server_app(pool: ModelPool, guard: GuardOptions, cors_origins: list[str] | None = None) -> AccessLog:
    """The full ASGI stack: request ids, metrics and logs outermost, then the guard, then the app."""

    def total(figure: Callable[[Runtime], int]) -> Callable[[], int]:
        return lambda: sum(figure(r) for r in pool.runtimes())

    metrics = Metrics({
        "lmserve_queue_depth": ("Requests waiting for a worker.", total(lambda r: r.status().queue_depth)),
        "lmserve_active_sequences": ("Sequences being generated.", total(lambda r: r.status().active_sequences)),
        "lmserve_kv_bytes": ("Bytes held by resident KV slots.", total(lambda r: r.status().kv["kv_bytes"])),
        "lmserve_models_loaded": ("Models resident.", lambda: len(pool.residents())),
    })
    guarded = Guard(create_app(pool, metrics, cors_origins), guard)  # the app renders metrics: gauge after
    metrics.gauges["lmserve_requests_in_flight"] = ("Requests counted against --conns (their bodies may still be "
                                            "arriving).", lambda: guarded.in_flight)
    return AccessLog(guarded, metrics)


def observer_of(request: Request, served: Runtime | None = None) -> Observer | None:
    """The access-log record of this request watches its events (timings, tokens, outcome), and
    names the model that `served` it."""
    record = request.scope.get(RECORD_KEY)
    if record is None:
        return None
    if served is not None:
        record.model = served.model.model_id
    return record.observe


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
