"""Ollama's own API (`/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`): bodies onto
the neutral request path, events into Ollama's NDJSON.

A chat or generate body is rewritten as the Chat Completions body it means and parsed by
`openai_chat.parse_chat`, so every check, template, grammar and tool format is the one the other
dialects get: `options` are its sampling fields (`num_predict` its `max_tokens`), `format` its
`response_format` (`"json"`, or a JSON schema), `think` its reasoning effort, Ollama's tool calls
(arguments as an object, results matched to calls by order and `tool_name`) its tool calls.
`/api/generate` is one user turn (with `system` before it) through the model's template; `raw`
prompts skip the template as `/v1/completions` does. Replies stream as NDJSON by default, one
object a delta, and end with Ollama's counts and durations (nanoseconds).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from lmserve.core.errors import invalid
from lmserve.core.events import Event, Failed, Finished, ReasoningDelta, Started, TextDelta, ToolCallEvent
from lmserve.http.reply_summary import ReplySummary

SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repeat_penalty", "seed", "stop")
# Options that change nothing here: the context, threads and the rest are the server's settings.
IGNORED_OPTIONS = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "repeat_last_n",
                   "typical_p", "use_mmap", "use_mlock", "numa", "low_vram", "vocab_only", "penalize_newline")


def timestamp(seconds: float | None = None) -> str:
    """RFC 3339 with nanoseconds, as Ollama writes `created_at`."""
    moment = datetime.fromtimestamp(time.time() if seconds is None else seconds, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%f") + "000Z"


def _object(body: dict[str, Any], name: str) -> dict[str, Any]:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(name, "must be an object")
    return value


def common_fields(body: dict[str, Any]) -> dict[str, Any]:
    """Sampling, format and reasoning, as the Chat Completions body fields they are."""
    options = _object(body, "options")
    out = {key: options[key] for key in SAMPLING_OPTIONS if options.get(key) is not None}
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    predict = options.get("num_predict")
    if predict is not None:
        if not isinstance(predict, int) or isinstance(predict, bool) or predict == 0 or predict < -2:
            raise invalid("options.num_predict", "must be a positive count, or -1 / -2 for no limit")
        if predict > 0:
            out["max_tokens"] = predict
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise invalid("format", 'must be "json" or a JSON schema object')
    think = body.get("think")
    if think is True:
        out["reasoning_effort"] = "medium"
    elif think is False:
        out["reasoning_effort"] = "none"
    elif think in ("low", "medium", "high"):
        out["reasoning_effort"] = think
    elif think is not None:
        raise invalid("think", 'must be true, false, "low", "medium" or "high"')
    return out


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """`/api/chat`'s body as the Chat Completions body it means."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise invalid("messages", "must be an array of messages")
    pending: list[tuple[str, str]] = []  # (call id, tool name) of the last assistant turn's calls
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}]", "must be an object")
        if message.get("images"):
            raise invalid(f"messages[{i}].images", "images are not supported: the served models read text")
        role = message.get("role")
        item: dict[str, Any] = {"role": role, "content": message.get("content") or ""}
        if role == "assistant":
            if message.get("thinking"):
                item["reasoning_content"] = message["thinking"]
            calls = _tool_calls(message.get("tool_calls"), i)
            if calls:
                item["tool_calls"] = calls
            pending = [(c["id"], c["function"]["name"]) for c in calls]
        elif role == "tool":
            name = message.get("tool_name")
            match = next((p for p in pending if name in (None, p[1])), None)
            if match is not None:
                pending.remove(match)
                item["tool_call_id"] = match[0]
        out.append(item)
    fields = {"messages": out, "stream": False, **common_fields(body)}
    if body.get("tools"):
        fields["tools"] = body["tools"]
    return fields


def _tool_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    if not calls:
        return []
    if not isinstance(calls, list):
        raise invalid(f"messages[{index}].tool_calls", "must be an array")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f"messages[{index}].tool_calls[{j}]", "must be {\"function\": {\"name\", \"arguments\"}}")
        arguments = function.get("arguments", {})
        out.append({"id": f"call_{index}_{j}", "type": "function",
                    "function": {"name": function["name"],
                                 "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
    return out


def generate_body(body: dict[str, Any]) -> dict[str, Any]:
    """`/api/generate`'s body (not raw) as a Chat Completions body: `system`, then the prompt."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise invalid("prompt", "must be a string")
    if body.get("images"):
        raise invalid("images", "images are not supported: the served models read text")
    if body.get("suffix"):
        raise invalid("suffix", "fill-in-the-middle is not supported")
    if body.get("template"):
        raise invalid("template", "a per-request template is not supported; raw prompts are (raw: true)")
    messages = [{"role": "system", "content": body["system"]}] if body.get("system") else []
    return {"messages": [*messages, {"role": "user", "content": prompt}], "stream": False, **common_fields(body)}


def raw_body(body: dict[str, Any]) -> dict[str, Any]:
    """A raw `/api/generate` body as the `/v1/completions` body it means (no template)."""
    fields = common_fields(body)
    fields.pop("reasoning_effort", None)
    return {"prompt": body.get("prompt") or "", "stream": False, **fields}


def wants_stream(body: dict[str, Any]) -> bool:
    """Ollama streams unless told not to."""
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise invalid("stream", "must be true or false")
    return stream


@dataclass
class Timing:
    """What Ollama's final object reports, in nanoseconds."""

    started: float = field(default_factory=time.perf_counter)
    load_seconds: float = 0.0
    first: float | None = None  # the first output
    prefilled: float | None = None  # the worker took the request

    def counts(self, finished: Finished) -> dict[str, Any]:
        end = time.perf_counter()
        first = self.first or end
        return {"total_duration": _ns(end - self.started), "load_duration": _ns(self.load_seconds),
                "prompt_eval_count": finished.usage.prompt_tokens,
                "prompt_eval_duration": _ns(first - (self.prefilled or self.started)),
                "eval_count": finished.usage.completion_tokens, "eval_duration": _ns(end - first)}


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def done_reason(finished: Finished) -> str:
    return "length" if finished.reason == "length" else "stop"


def tool_call_json(event: ToolCallEvent) -> dict[str, Any]:
    try:
        arguments = json.loads(event.arguments or "{}")
    except ValueError:
        arguments = {}
    return {"function": {"name": event.name, "arguments": arguments}}


class OllamaRenderer:
    """One job's events as Ollama's NDJSON objects (`chat`: `message`s; else generate's `response`)."""

    def __init__(self, model_id: str, chat: bool, timing: Timing) -> None:
        self.model, self.chat, self.timing = model_id, chat, timing

    def _piece(self, text: str = "", thinking: str = "", calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": timestamp()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        return out

    def _note(self, event: Event) -> None:
        now = time.perf_counter()
        if isinstance(event, Started):
            self.timing.prefilled = now
        elif isinstance(event, TextDelta | ReasoningDelta | ToolCallEvent) and self.timing.first is None:
            self.timing.first = now

    def _last(self, finished: Finished) -> dict[str, Any]:
        return {**self._piece(), "done": True, "done_reason": done_reason(finished), **self.timing.counts(finished)}

    async def frames(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        async for event in events:
            self._note(event)
            piece = None
            if isinstance(event, TextDelta):
                piece = self._piece(event.text)
            elif isinstance(event, ReasoningDelta):
                piece = self._piece(thinking=event.text)
            elif isinstance(event, ToolCallEvent):
                piece = self._piece(calls=[tool_call_json(event)])
            elif isinstance(event, Finished):
                yield _line(self._last(event))
            elif isinstance(event, Failed):
                yield _line({"error": event.message})
            if piece is not None:
                yield _line({**piece, "done": False})

    def body(self, events: list[Event]) -> dict[str, Any]:
        for event in events:
            self._note(event)
        reply = ReplySummary.of(events)
        piece = self._piece(reply.text, reply.reasoning or "", [tool_call_json(c) for c in reply.calls] or None)
        return {**piece, **self._last(reply.finish), **({"message": piece["message"]} if self.chat else
                                                        {"response": piece["response"]})}


def _line(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
