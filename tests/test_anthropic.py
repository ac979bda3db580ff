"""/v1/messages end to end: the official anthropic SDK, raw SSE, and replayed Claude Code traffic."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.conftest import CLIENTS

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the anthropic SDK 2.x has no sampling parameters; the API still takes them


@pytest.fixture(scope="module")
def client(smollm2_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=smollm2_server.base_url, api_key="local", max_retries=0)


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert data["type"] == name
            events.append((name, data))
    return events


def test_messages_create(client):
    msg = client.messages.create(model="claude-opus-4-8", max_tokens=64, extra_body=GREEDY, messages=CAPITAL)
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "text" and msg.content[0].text == "The capital of France is Paris."
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    # input_tokens is only the uncached part, as Anthropic counts: earlier tests may have warmed a slot.
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == 37 and msg.usage.output_tokens == 7


def test_messages_stream_with_text_stream_and_final_message(client):
    with client.messages.stream(model="claude-haiku-4-5", max_tokens=64, extra_body=GREEDY, messages=CAPITAL) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == "The capital of France is Paris."
    assert final.content[0].text == "".join(pieces)
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 7


def test_stop_sequence_attribution(client):
    msg = client.messages.create(model="claude-haiku-4-5", max_tokens=64, extra_body=GREEDY, messages=CAPITAL,
                                 stop_sequences=["Paris", "Berlin"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "Paris"
    assert msg.content[0].text == "The capital of France is "
    with client.messages.stream(model="claude-haiku-4-5", max_tokens=64, extra_body=GREEDY, messages=CAPITAL,
                                stop_sequences=["France is"]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "The capital of " and final.stop_sequence == "France is"


def test_max_tokens_stop_reason_and_clamping(client):
    msg = client.messages.create(model="claude-haiku-4-5", max_tokens=2, extra_body=GREEDY, messages=CAPITAL)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 2
    # Claude Code asks for 64000 output tokens: clamped to the context, never rejected.
    msg = client.messages.create(model="claude-haiku-4-5", max_tokens=64000, extra_body=GREEDY, messages=CAPITAL,
                                 timeout=120)  # the SDK insists on a timeout for such budgets
    assert msg.stop_reason == "end_turn"


def test_count_tokens_matches_generation_usage(client):
    counted = client.messages.count_tokens(model="claude-haiku-4-5", messages=CAPITAL)
    assert counted.input_tokens == 37
    with_system = client.messages.count_tokens(model="claude-haiku-4-5", messages=CAPITAL, system="Be brief.")
    assert with_system.input_tokens != counted.input_tokens


def test_missing_max_tokens_is_bad_request(smollm2_server, client):
    # The SDK's typed create() refuses to send without max_tokens, so send through its raw post().
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post("/v1/messages", body={"model": "claude-haiku-4-5", "messages": CAPITAL}, cast_to=object)
    assert "max_tokens" in str(info.value)
    r = httpx.post(smollm2_server.base_url + "/v1/messages", json={"messages": CAPITAL})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "max_tokens: is required"}}


@pytest.mark.parametrize(("body", "field"), [
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"max_tokens": 5, "messages": CAPITAL, "temperature": 1.5}, "temperature"),
    ({"max_tokens": -1, "messages": CAPITAL}, "max_tokens"),
    ({"max_tokens": 5, "messages": CAPITAL, "stop_sequences": [1]}, "stop_sequences"),
])
def test_invalid_fields_use_the_anthropic_envelope(smollm2_server, body, field):
    r = httpx.post(smollm2_server.base_url + "/v1/messages", json=body)
    assert r.status_code == 400
    data = r.json()
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
    assert field in data["error"]["message"]


def replay(server, capture: str, max_tokens: int = 24) -> tuple[int, list[tuple[str, dict]], dict]:
    """POST a captured Claude Code request (path, headers, body as captured) and read the stream.
    max_tokens is lowered from the captured 64000 to keep the reply short on a 2-core CI runner."""
    data = json.loads((CLIENTS / capture).read_text())
    body = {**data["body"], "max_tokens": max_tokens}
    headers = {k: v for k, v in data["headers"].items() if k.lower() not in ("content-length", "host")}
    with httpx.stream("POST", server.base_url + data["path"], headers=headers, json=body, timeout=600) as r:
        if r.status_code != 200:
            return r.status_code, [], json.loads(r.read())
        return 200, sse_events(r), {}


def assert_well_formed_message_stream(events: list[tuple[str, dict]]) -> None:
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop")
    start_usage = events[0][1]["message"]["usage"]
    final_usage = events[-2][1]["usage"]
    assert final_usage["input_tokens"] == start_usage["input_tokens"] > 0
    assert 0 < final_usage["output_tokens"] <= 24


def test_claude_code_capture_without_tools_streams_a_well_formed_message(smollm2_server):
    status, events, _ = replay(smollm2_server, "claude-code-2.1.197-messages-no-tools.json")
    assert status == 200
    assert_well_formed_message_stream(events)


def test_claude_code_capture_with_tools_streams_or_states_token_count_and_context(smollm2_server):
    status, events, error = replay(smollm2_server, "claude-code-2.1.197-messages-with-tools.json")
    if status == 200:
        assert_well_formed_message_stream(events)
        return
    assert status == 400 and error["error"]["type"] == "invalid_request_error"
    assert "tokens" in error["error"]["message"] and "8192" in error["error"]["message"]
