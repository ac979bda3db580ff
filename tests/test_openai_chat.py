"""/v1/chat/completions end to end on SmolLM2 through real HTTP."""

from __future__ import annotations

import json

import httpx
import pytest

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def post(server, path: str, body, **kwargs) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120, **kwargs)


def stream_chunks(server, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        chunks.append(json.loads(line[6:]))
    return chunks


def test_curl_form_encoded_body_answers_paris(smollm2_server):
    # curl -d sends application/x-www-form-urlencoded; the body is JSON all the same.
    body = json.dumps({"messages": CAPITAL, "temperature": 0})
    r = httpx.post(smollm2_server.base_url + "/v1/chat/completions", content=body,
                   headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "The capital of France is Paris.",
                                             "refusal": None, "annotations": []}
    assert data["choices"][0]["finish_reason"] == "stop"
    usage = data["usage"]
    assert usage["prompt_tokens"] == 37 and usage["completion_tokens"] == 7  # the end-of-turn token is not counted, as OpenAI
    assert usage["total_tokens"] == 44


def test_every_golden_chat_greedy_reply_over_http(smollm2_server, chat_goldens):
    for golden in chat_goldens:
        r = post(smollm2_server, "/v1/chat/completions",
                 {"messages": golden["messages"], "temperature": 0, "max_tokens": 32})
        assert r.status_code == 200, r.text
        expected = golden["greedy_text"].removesuffix("<|im_end|>")
        assert r.json()["choices"][0]["message"]["content"] == expected


def test_stream_concatenation_equals_non_stream(smollm2_server, chat_goldens):
    messages = chat_goldens[1]["messages"]
    body = {"messages": messages, "temperature": 0, "max_tokens": 24}
    whole = post(smollm2_server, "/v1/chat/completions", body).json()
    chunks = stream_chunks(smollm2_server, {**body, "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finals] == [whole["choices"][0]["finish_reason"]]
    # The counts match; the cached share is the KV cache's state at each request: the non-streamed
    # reply meets whatever earlier tests left, and the streamed one adopts all but the last prompt
    # token that the non-streamed reply just left behind.
    streamed_usage = chunks[-1]["usage"]
    streamed_cached = streamed_usage.pop("prompt_tokens_details")["cached_tokens"]
    whole_usage = {k: v for k, v in whole["usage"].items() if k != "prompt_tokens_details"}
    assert chunks[-1]["choices"] == [] and streamed_usage == whole_usage
    assert streamed_cached == whole_usage["prompt_tokens"] - 1
    assert all(c["id"] == chunks[0]["id"] and c["object"] == "chat.completion.chunk" for c in chunks)


def test_stop_string_spanning_tokens_never_streams(smollm2_server):
    body = {"messages": CAPITAL, "temperature": 0, "stop": ["is Par"]}
    chunks = stream_chunks(smollm2_server, body)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "The capital of France "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    whole = post(smollm2_server, "/v1/chat/completions", body).json()
    assert whole["choices"][0]["message"]["content"] == "The capital of France "


def test_max_tokens_gives_length(smollm2_server):
    r = post(smollm2_server, "/v1/chat/completions", {"messages": CAPITAL, "temperature": 0, "max_tokens": 3})
    data = r.json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["choices"][0]["message"]["content"] == "The capital of"
    assert data["usage"]["completion_tokens"] == 3


def test_multibyte_characters_stream_intact(smollm2_server):
    body = {"messages": [{"role": "user", "content": "Repeat exactly: 🎉🎉 café 日本"}],
            "temperature": 0, "max_tokens": 24}
    chunks = stream_chunks(smollm2_server, body)
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    whole = post(smollm2_server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    assert "".join(pieces) == whole
    assert "\ufffd" not in whole
    assert any(ord(ch) > 0xFFFF for ch in whole), whole  # an emoji made it through


def test_models_and_health(smollm2_server):
    models = httpx.get(smollm2_server.base_url + "/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == "SmolLM2-135M-Instruct.Q4_1" and card["context_window"] == 8192
    assert httpx.get(smollm2_server.base_url + "/models").json() == models
    health = httpx.get(smollm2_server.base_url + "/health").json()
    assert health["status"] == "ok" and health["engine"] == "cpu"


def test_tokenize_and_detokenize_goldens(smollm2_server, tokenizer_goldens):
    for line in tokenizer_goldens:
        r = post(smollm2_server, "/tokenize", {"content": line["text"]})
        assert r.json()["tokens"] == line["ids"], line["text"]
        back = post(smollm2_server, "/detokenize", {"tokens": line["ids"]}).json()["content"]
        assert back == line["decoded"]
    pieces = post(smollm2_server, "/tokenize", {"content": "Hello world", "with_pieces": True}).json()
    assert pieces["tokens"] == [{"id": 19556, "piece": "Hello"}, {"id": 905, "piece": " world"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": CAPITAL, "temperature": "hot"}, "temperature"),
    ({"messages": CAPITAL, "temperature": 3}, "temperature"),
    ({"messages": CAPITAL, "n": 2}, "n"),
    ({"messages": CAPITAL, "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": CAPITAL, "functions": [{"name": "f"}]}, "functions"),
    ({"messages": CAPITAL, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": CAPITAL, "logit_bias": {"999999": 1}}, "logit_bias"),
])
def test_invalid_fields_get_openai_400_naming_the_field(smollm2_server, body, param):
    r = post(smollm2_server, "/v1/chat/completions", body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert error["type"] == "invalid_request_error"


def test_invalid_json_is_400(smollm2_server):
    r = httpx.post(smollm2_server.base_url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "body"


def test_prompt_longer_than_context_names_both_numbers(smollm2_server):
    long = "lorem ipsum " * 5000
    r = post(smollm2_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "8192" in message and "tokens" in message
    n = int(message.split("the prompt has ")[1].split(" ")[0])
    assert n > 8192
    r = post(smollm2_server, "/v1/chat/completions",
             {"messages": [{"role": "user", "content": long}], "stream": True})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/nope"), ("POST", "/v1/chat/nope"), ("GET", "/nope")])
def test_unknown_route_is_404_in_openai_envelope(smollm2_server, method, path):
    r = httpx.request(method, smollm2_server.base_url + path, json={} if method == "POST" else None, timeout=30)
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert error["type"] == "not_found_error" and error["param"] is None and error["code"] is None
    assert isinstance(error["message"], str) and error["message"]


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/messages/nope"), ("POST", "/v1/messages/batches")])
def test_unknown_route_under_messages_is_404_in_anthropic_envelope(smollm2_server, method, path):
    r = httpx.request(method, smollm2_server.base_url + path, json={} if method == "POST" else None, timeout=30)
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == "not_found_error"
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def test_unknown_route_message_names_the_path(smollm2_server):
    """As OpenAI's API words it: "Invalid URL (GET /v1/nope)"."""
    r = httpx.get(smollm2_server.base_url + "/v1/nope", timeout=30)
    assert r.json()["error"]["message"].startswith("Invalid URL (GET /v1/nope)")
