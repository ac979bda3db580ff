"""Error envelopes: OpenAI's on the OpenAI routes, Anthropic's on /v1/messages, Ollama's on /api/*."""

from __future__ import annotations

from typing import Any

from litestar import Response

from lmserve.core.errors import RequestError
from lmserve.http.common import json_response


def openai_payload(err: RequestError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.error_type, "param": err.param, "code": err.code}}


def anthropic_payload(err: RequestError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": err.error_type, "message": err.message}}


def ollama_payload(err: RequestError) -> dict[str, Any]:
    return {"error": err.message}


def is_anthropic_path(path: str) -> bool:
    return "/messages" in path


def is_ollama_path(path: str) -> bool:
    return path.startswith("/api/")


def error_payload(err: RequestError, path: str) -> dict[str, Any]:
    """The envelope of the dialect that `path` belongs to."""
    if is_ollama_path(path):
        return ollama_payload(err)
    return anthropic_payload(err) if is_anthropic_path(path) else openai_payload(err)


def openai_error(err: RequestError) -> Response:
    return json_response(openai_payload(err), err.status, err.headers)


def anthropic_error(err: RequestError) -> Response:
    return json_response(anthropic_payload(err), err.status, err.headers)


def ollama_error(err: RequestError) -> Response:
    return json_response(ollama_payload(err), err.status, err.headers)


def renderer_for_path(path: str):
    """Which envelope an error on `path` gets (used where no route handler caught it)."""
    if is_ollama_path(path):
        return ollama_error
    return anthropic_error if is_anthropic_path(path) else openai_error
