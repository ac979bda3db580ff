"""The Ollama API's routes (docs/OLLAMA.md), over the same model pool and request path as the
OpenAI and Anthropic routes; `ollama.py` translates bodies and renders replies."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, get, post
from litestar.handlers import HTTPRouteHandler

from lmserve.core.duration import parse_duration
from lmserve.core.errors import invalid
from lmserve.core.events import Failed
from lmserve.http.common import (
    collect,
    event_stream,
    failure_error,
    json_response,
    off_loop,
    read_json,
    result_unless_gone,
)
from lmserve.http.ollama import (
    OllamaRenderer,
    Timing,
    chat_body,
    generate_body,
    raw_body,
    timestamp,
    wants_stream,
)
from lmserve.http.ollama_models import running, show, tag
from lmserve.http.openai_chat import parse_chat
from lmserve.http.openai_completions import parse_completion
from lmserve.pool.residents import ModelPool
from lmserve.runtime import Runtime
from lmserve.serving.handle import RequestHandle

OLLAMA_API_VERSION = "0.12.0"  # the Ollama release whose API this follows (think, tool_name, /api/embed)
NDJSON = "application/x-ndjson"


def model_name(body: dict[str, Any]) -> str:
    """Ollama's requests must name their model (`model`, or the older `name`)."""
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise invalid("model", "is required: the name of a model (GET /api/tags lists them)")
    return name


def keep_alive(body: dict[str, Any]) -> float | None:
    value = body.get("keep_alive")
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise invalid("keep_alive", str(exc)) from None


def ollama_routes(pool: ModelPool, observe: Any) -> list[HTTPRouteHandler]:
    """The handlers; `observe(request, runtime)` is the access log's observer for a request."""

    @contextlib.asynccontextmanager
    async def timed(name: str, timing: Timing) -> AsyncIterator[Runtime]:
        """`pool.use`, the time it took (a load, when the model was not resident) in `timing`."""
        started = time.perf_counter()
        async with pool.use(name) as runtime:
            timing.load_seconds = time.perf_counter() - started
            yield runtime

    async def reply(request: Request, runtime: Runtime, handle: RequestHandle, stream: bool,
                    renderer: OllamaRenderer, body: dict[str, Any]) -> Response:
        seconds = keep_alive(body)
        if seconds is not None:
            pool.keep(runtime, seconds)
        if stream:
            return event_stream(renderer.frames(handle.events()), [handle], NDJSON)
        (events,) = await collect([handle], request)
        if isinstance(events[-1], Failed):
            raise failure_error(events[-1])
        return json_response(renderer.body(events))

    async def load_only(name: str, body: dict[str, Any], chat: bool) -> Response:
        """A body without messages or prompt loads the model (keep_alive 0: unloads it)."""
        seconds = keep_alive(body)
        if seconds == 0:
            await pool.unload_named(name)
            reason = "unload"
        else:
            async with pool.use(name) as runtime:
                if seconds is not None:
                    pool.keep(runtime, seconds)
            reason = "load"
        piece: dict[str, Any] = {"model": name, "created_at": timestamp()}
        piece |= {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
        return json_response({**piece, "done": True, "done_reason": reason})

    async def start(request: Request, runtime: Runtime, body: dict[str, Any], chat: bool) -> RequestHandle:
        """Queue the reply: a chat, a generate prompt through the template, or a raw prompt."""
        if not chat and body.get("raw"):
            call = await off_loop(parse_completion, raw_body(body), runtime.model.tokenizer)
            plan = await off_loop(runtime.plan_completion, call.output_format)
            (handle,) = runtime.start_completion(call.prompts, call.sampling, call.max_tokens, call.stop, plan,
                                                 None, observe(request, runtime))
            return handle
        fields = chat_body(body) if chat else generate_body(body)
        parsed, _ = await off_loop(parse_chat, fields, runtime.model.tokenizer.vocab_size)
        prepared = await off_loop(runtime.prepare_chat, parsed)
        return runtime.start_prepared(prepared, observe(request, runtime))

    async def answer(request: Request, chat: bool) -> Response:
        body = await read_json(request)
        name, stream = model_name(body), wants_stream(body)
        if not body.get("messages" if chat else "prompt"):
            return await load_only(name, body, chat)
        timing = Timing()
        async with timed(name, timing) as runtime:
            handle = await start(request, runtime, body, chat)
        return await reply(request, runtime, handle, stream, OllamaRenderer(name, chat, timing), body)

    @post("/api/chat", status_code=200)
    async def chat(request: Request) -> Response:
        return await answer(request, chat=True)

    @post("/api/generate", status_code=200)
    async def generate(request: Request) -> Response:
        return await answer(request, chat=False)

    async def embed_texts(request: Request, body: dict[str, Any], texts: list[str], truncate: bool) -> tuple:
        timing = Timing()
        async with timed(model_name(body), timing) as runtime:
            encode = runtime.model.tokenizer.encode
            inputs = await off_loop(lambda: [encode(t, add_special=True, parse_special=False) for t in texts])
            if truncate:
                inputs = [ids[:runtime.ctx] for ids in inputs]
            pending = runtime.embed(inputs)
            observe(request, runtime)
        seconds = keep_alive(body)
        if seconds is not None:
            pool.keep(runtime, seconds)
        vectors = await result_unless_gone(pending, request)
        return vectors, inputs, timing

    @post("/api/embed", status_code=200)
    async def embed(request: Request) -> Response:
        body = await read_json(request)
        texts = body.get("input")
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise invalid("input", "must be a string or a non-empty array of strings")
        truncate = body.get("truncate", True)
        vectors, inputs, timing = await embed_texts(request, body, texts, truncate is not False)
        dimensions = body.get("dimensions")
        out = [v[:dimensions] if isinstance(dimensions, int) and dimensions > 0 else v for v in vectors]
        return json_response({"model": model_name(body), "embeddings": [v.tolist() for v in out],
                              "total_duration": int((time.perf_counter() - timing.started) * 1e9),
                              "load_duration": int(timing.load_seconds * 1e9),
                              "prompt_eval_count": sum(len(ids) for ids in inputs)})

    @post("/api/embeddings", status_code=200)
    async def embeddings(request: Request) -> Response:
        body = await read_json(request)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise invalid("prompt", "must be a string")
        vectors, _, _ = await embed_texts(request, body, [prompt], True)
        return json_response({"embedding": vectors[0].tolist()})

    @get("/api/tags")
    async def tags() -> Response:
        choices = await off_loop(pool.directory.listing)
        return json_response({"models": await off_loop(lambda: [tag(c) for c in choices])})

    @get("/api/ps")
    async def ps() -> Response:
        entries = [running(r, pool.kept_for(r)) for r in pool.residents()]
        return json_response({"models": await off_loop(lambda: entries)})

    @post("/api/show", status_code=200)
    async def show_model(request: Request) -> Response:
        body = await read_json(request)
        choice = await off_loop(pool.directory.find, model_name(body), False)
        resident = next((r for r in pool.residents() if r.choice.key == choice.key), None)
        parameters = ""
        if resident is not None:  # Modelfile lines: Continue reads its context length from num_ctx
            values = {"num_ctx": resident.runtime.ctx, **resident.runtime.sampling_defaults.values()}
            parameters = "\n".join(f"{k} {v}" for k, v in values.items() if v is not None)
        return json_response(await off_loop(show, choice, parameters))

    @get("/api/version")
    async def version() -> Response:
        return json_response({"version": OLLAMA_API_VERSION})

    return [chat, generate, embed, embeddings, tags, ps, show_model, version]
