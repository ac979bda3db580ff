"""What every reply on the wire must look like, per dialect: error envelopes, JSON bodies and SSE
streams (terminal event present, frames in order, usage consistent). Shared by the fuzz and soak
suites; each check raises AssertionError naming what is malformed and returns a normalized Reply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages",
         "completions": "/v1/completions"}
TRACEBACK_MARKS = ("Traceback (most recent call last)", 'File "/')


@dataclass
class Reply:
    """A finished reply, whatever the dialect: text, why it stopped, token counts, calls."""

    text: str = ""
    finish: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, JSON arguments)
    reasoning: str = ""
    reasoning_tokens: int | None = None  # where the dialect reports them (not Anthropic's)
    error: str | None = None  # an in-band error (stream error event, failed response)


def dialect_of(path: str) -> str:
    return "messages" if "/messages" in path else "openai"


def check_no_traceback(text: str) -> None:
    for mark in TRACEBACK_MARKS:
        assert mark not in text, f"traceback text in a response body: {text[:300]!r}"


def check_error(path: str, status: int, body: Any) -> str:
    """A 4xx/5xx body is the dialect's error envelope; returns its message."""
    assert isinstance(body, dict), f"{status}: error body is not a JSON object: {body!r}"
    if dialect_of(path) == "messages":
        assert body.get("type") == "error" and set(body) == {"type", "error"}, body
        err = body["error"]
        assert set(err) == {"type", "message"}, body
    else:
        assert set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, body
        assert err["param"] is None or isinstance(err["param"], str), body
        assert err["code"] is None or isinstance(err["code"], str), body
    assert isinstance(err["type"], str) and isinstance(err["message"], str) and err["message"], body
    return err["message"]


def _usage(reply: Reply, prompt: int, completion: int, cached: int) -> None:
    for n in (prompt, completion, cached):
        assert isinstance(n, int) and n >= 0, (prompt, completion, cached)
    assert cached <= prompt, f"cached {cached} > prompt {prompt}"
    reply.prompt_tokens, reply.completion_tokens, reply.cached_tokens = prompt, completion, cached


def _openai_usage(reply: Reply, usage: dict[str, Any], prompt_key: str, completion_key: str,
                  details_key: str) -> None:
    prompt, completion = usage[prompt_key], usage[completion_key]
    assert usage["total_tokens"] == prompt + completion, usage
    _usage(reply, prompt, completion, usage[details_key]["cached_tokens"])
    details = usage.get(completion_key.replace("tokens", "tokens_details"))
    if details is not None:
        reply.reasoning_tokens = details["reasoning_tokens"]
        assert 0 <= reply.reasoning_tokens <= completion, usage


def _anthropic_usage(reply: Reply, usage: dict[str, Any]) -> None:
    cached = usage["cache_read_input_tokens"]
    _usage(reply, usage["input_tokens"] + cached, usage["output_tokens"], cached)


# -- JSON bodies -------------------------------------------------------------------------------

def check_body(dialect: str, body: dict[str, Any]) -> Reply:
    reply = Reply()
    if dialect == "chat":
        assert body["object"] == "chat.completion" and len(body["choices"]) == 1, body
        choice = body["choices"][0]
        message = choice["message"]
        reply.text = message["content"] or ""
        reply.reasoning = message.get("reasoning_content") or ""
        reply.finish = choice["finish_reason"]
        reply.calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        _openai_usage(reply, body["usage"], "prompt_tokens", "completion_tokens", "prompt_tokens_details")
    elif dialect == "completions":
        assert body["object"] == "text_completion" and body["choices"], body
        reply.text = body["choices"][0]["text"]
        reply.finish = body["choices"][0]["finish_reason"]
        _openai_usage(reply, body["usage"], "prompt_tokens", "completion_tokens", "prompt_tokens_details")
    elif dialect == "responses":
        assert body["object"] == "response" and body["status"] in ("completed", "incomplete"), body
        reply.finish = body["status"]
        if body["status"] == "incomplete":
            assert body["incomplete_details"]["reason"] == "max_output_tokens", body
        for item in body["output"]:
            if item["type"] == "message":
                reply.text += "".join(p["text"] for p in item["content"] if p["type"] == "output_text")
            elif item["type"] == "function_call":
                reply.calls.append((item["name"], item["arguments"]))
            elif item["type"] == "reasoning":
                reply.reasoning += "".join(p["text"] for p in item["content"])
        _openai_usage(reply, body["usage"], "input_tokens", "output_tokens", "input_tokens_details")
    else:
        assert body["type"] == "message" and body["role"] == "assistant", body
        reply.finish = body["stop_reason"]
        for block in body["content"]:
            if block["type"] == "text":
                reply.text += block["text"]
            elif block["type"] == "thinking":
                reply.reasoning += block["thinking"]
            elif block["type"] == "tool_use":
                assert isinstance(block["input"], dict), block
                reply.calls.append((block["name"], json.dumps(block["input"])))
        _anthropic_usage(reply, body["usage"])
    assert reply.finish in FINISH_REASONS[dialect], f"{dialect}: unexpected finish {reply.finish!r}"
    return reply


FINISH_REASONS = {
    "chat": ("stop", "length", "tool_calls"),
    "completions": ("stop", "length"),
    "responses": ("completed", "incomplete"),
    "messages": ("end_turn", "max_tokens", "stop_sequence", "tool_use"),
}


# -- SSE streams -------------------------------------------------------------------------------

def parse_sse(raw: str) -> list[tuple[str | None, str]]:
    """(event name, data) per frame; every frame must carry data. Keep-alive comments (written
    while a request waits or prefills) are checked and skipped."""
    frames = []
    for block in raw.split("\n\n"):
        if not block.strip() or block == ": keep-alive":
            continue
        event, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
            else:
                raise AssertionError(f"not an SSE line: {line!r}")
        assert data, f"SSE frame without data: {block!r}"
        frames.append((event, "\n".join(data)))
    assert raw.endswith("\n\n"), f"stream cut mid-frame: {raw[-200:]!r}"
    return frames


def check_stream(dialect: str, raw: str) -> Reply:
    """A complete stream: ends in the dialect's terminal event (or an in-band error)."""
    check_no_traceback(raw)
    frames = parse_sse(raw)
    assert frames, "empty stream"
    if dialect in ("chat", "completions"):
        return _openai_stream(dialect, frames)
    if dialect == "responses":
        return _responses_stream(frames)
    return _messages_stream(frames)


def _openai_stream(dialect: str, frames: list[tuple[str | None, str]]) -> Reply:
    reply = Reply()
    assert frames[-1][1] == "[DONE]", f"no [DONE] at the end: {frames[-1]}"
    chunks = [json.loads(data) for _, data in frames[:-1]]
    assert chunks, "no chunk before [DONE]"
    if "error" in chunks[-1]:
        reply.error = check_error(PATHS[dialect], 500, chunks[-1])
        chunks = chunks[:-1]
    ids = {c["id"] for c in chunks}
    assert len(ids) <= 1, f"chunks of several ids: {ids}"
    finished: dict[int, str] = {}  # choice index -> finish reason (completions: one choice per prompt)
    for chunk in chunks:
        if not chunk["choices"]:  # the trailing usage chunk
            assert chunk is chunks[-1] and finished, "usage chunk not last or before the finish"
            _openai_usage(reply, chunk["usage"], "prompt_tokens", "completion_tokens", "prompt_tokens_details")
            continue
        choice = chunk["choices"][0]
        index = choice["index"]
        assert index not in finished, f"a chunk for choice {index} after its finish_reason {finished[index]!r}"
        if index == 0 and dialect == "chat":
            delta = choice["delta"]
            reply.text += delta.get("content") or ""
            reply.reasoning += delta.get("reasoning_content") or ""
            reply.calls += [(c["function"]["name"], c["function"]["arguments"]) for c in delta.get("tool_calls", [])]
        elif index == 0:
            reply.text += choice["text"]
        if choice["finish_reason"] is not None:
            finished[index] = choice["finish_reason"]
    reply.finish = finished.get(0)
    if reply.error is None:
        assert finished and all(f in FINISH_REASONS[dialect] for f in finished.values()), \
            f"stream ended without a finish: {chunks[-1:]}"
        assert sorted(finished) == list(range(len(finished))), f"finished choices {sorted(finished)}"
    return reply


def _responses_stream(frames: list[tuple[str | None, str]]) -> Reply:
    reply = Reply()
    events = [json.loads(data) for _, data in frames]
    for n, ((name, _), event) in enumerate(zip(frames, events, strict=True)):
        assert event["sequence_number"] == n, f"sequence_number {event['sequence_number']} at frame {n}"
        assert name == event["type"], (name, event["type"])
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds[:3]
    terminal = [k for k in kinds if k in ("response.completed", "response.incomplete", "response.failed")]
    assert terminal == [kinds[-1]], f"terminal events {terminal}, last {kinds[-1]}"
    final = events[-1]["response"]
    if kinds[-1] == "response.failed":
        reply.error = final["error"]["message"]
        return reply
    body = check_body("responses", final)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == body.text, "output_text deltas differ from the final response's text"
    return body


def _messages_stream(frames: list[tuple[str | None, str]]) -> Reply:
    reply = Reply()
    events = [json.loads(data) for _, data in frames]
    for (name, _), event in zip(frames, events, strict=True):
        assert name == event["type"], (name, event["type"])
    if [e["type"] for e in events] == ["error"]:  # failed before the worker took it (e.g. shutdown)
        reply.error = check_error("/v1/messages", 500, events[0])
        return reply
    assert events[0]["type"] == "message_start", events[0]
    start_usage = events[0]["message"]["usage"]
    if events[-1]["type"] == "error":
        reply.error = check_error("/v1/messages", 500, events[-1])
        return reply
    kinds = [e["type"] for e in events]
    assert kinds[-2:] == ["message_delta", "message_stop"], kinds[-3:]
    open_block: int | None = None
    blocks: dict[int, dict[str, Any]] = {}
    for event in events[1:-2]:
        kind = event["type"]
        if kind == "ping":
            continue
        index = event["index"]
        if kind == "content_block_start":
            assert open_block is None and index == len(blocks), f"block {index} opened out of order"
            open_block, blocks[index] = index, dict(event["content_block"])
        elif kind == "content_block_delta":
            assert open_block == index, f"delta for block {index}, open {open_block}"
            delta = event["delta"]
            if delta["type"] == "text_delta":
                reply.text += delta["text"]
            elif delta["type"] == "thinking_delta":
                reply.reasoning += delta["thinking"]
            elif delta["type"] == "input_json_delta":
                blocks[index]["arguments"] = blocks[index].get("arguments", "") + delta["partial_json"]
        elif kind == "content_block_stop":
            assert open_block == index, f"stop for block {index}, open {open_block}"
            open_block = None
        else:
            raise AssertionError(f"unexpected event {kind}")
    assert open_block is None, "a content block was never closed"
    reply.calls = [(b["name"], b["arguments"]) for b in blocks.values() if b["type"] == "tool_use"]
    delta = events[-2]
    reply.finish = delta["delta"]["stop_reason"]
    assert reply.finish in FINISH_REASONS["messages"], delta
    _anthropic_usage(reply, delta["usage"])
    assert delta["usage"]["input_tokens"] == start_usage["input_tokens"], (start_usage, delta["usage"])
    return reply
