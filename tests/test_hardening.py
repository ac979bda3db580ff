"""What a hostile request or a hostile file must not get (issue 32), on a real server: a Host
header that only looks local, a web page of another origin posting to the local server, a CORS
preflight turned away by the key it cannot carry, a grammar past the grammar engine's limits, a
tool result answering no call, an Ollama manifest pointing outside its blobs."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.server_util import start_server

QUESTION = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server():
    with start_server("--ctx", "2048", "--cors", "http://app.test") as s:
        yield s


@pytest.fixture(scope="module")
def keyed():
    with start_server("--ctx", "2048", "--cors", "http://app.test", "--api-key", "sekrit") as s:
        yield s


def generated(server) -> int:
    return httpx.get(server.base_url + "/health").json()["tokens_generated"]


def test_a_host_that_only_starts_like_a_local_one_is_refused(server) -> None:
    for host in ("127.0.0.1:80@evil.com", "localhost:8080/evil", "127.0.0.1 evil.com", "localhost:x"):
        r = httpx.get(server.base_url + "/v1/models", headers={"Host": host})
        assert r.status_code == 403 and "host_not_allowed" in r.text, host
    assert httpx.get(server.base_url + "/v1/models", headers={"Host": "[::1]:8080"}).status_code == 200


def test_a_page_of_another_origin_cannot_make_the_server_generate(server) -> None:
    """A browser sends a cross-origin text/plain POST without a preflight: it is refused before
    anything runs; the server's own page and --cors origins are served."""
    before = generated(server)
    r = httpx.post(server.base_url + "/v1/chat/completions", content=json.dumps(QUESTION),
                   headers={"Content-Type": "text/plain", "Origin": "http://evil.test"})
    assert r.status_code == 403 and "origin_not_allowed" in r.text and "http://evil.test" in r.text
    assert generated(server) == before
    own = httpx.post(server.base_url + "/v1/chat/completions", json=QUESTION, headers={"Origin": server.base_url})
    allowed = httpx.post(server.base_url + "/v1/chat/completions", json=QUESTION, headers={"Origin": "http://app.test"})
    assert own.status_code == allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "http://app.test"


def test_a_cors_preflight_is_answered_before_the_api_key(keyed) -> None:
    """A browser's preflight cannot carry the key: it gets the CORS answer; the request itself
    still needs the key."""
    preflight = httpx.options(keyed.base_url + "/v1/chat/completions", headers={
        "Origin": "http://app.test", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code in (200, 204), preflight.text
    assert preflight.headers["access-control-allow-origin"] == "http://app.test"
    url, origin = keyed.base_url + "/v1/chat/completions", {"Origin": "http://app.test"}
    assert httpx.post(url, json=QUESTION, headers=origin).status_code == 401
    assert httpx.post(url, json=QUESTION, headers={**origin, "Authorization": "Bearer sekrit"}).status_code == 200
    foreign = httpx.options(url, headers={"Origin": "http://evil.test", "Access-Control-Request-Method": "POST"})
    assert foreign.status_code == 403


def test_a_grammar_past_the_engines_limits_is_a_clean_400(server) -> None:
    """5,000 tools make llguidance panic: the 400 names the field and says so, without a backtrace."""
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}} for i in range(5000)]
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120,
                   json={**QUESTION, "tools": tools, "tool_choice": "required"})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("tools:") and "too large or too complex" in message
    assert "backtrace" not in message and "\n" not in message


def test_a_tool_result_must_answer_a_call_of_the_turn_before(server) -> None:
    body = {"max_tokens": 4, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "w", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "sunny"}]}]}
    r = httpx.post(server.base_url + "/v1/messages", json=body)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "messages[2].content[0].tool_use_id" in r.json()["error"]["message"]
    body["messages"][2]["content"][0]["tool_use_id"] = "toolu_1"
    assert httpx.post(server.base_url + "/v1/messages", json=body).status_code == 200


def test_an_ollama_manifest_cannot_point_outside_its_blobs(tmp_path: Path, monkeypatch) -> None:
    from lmserve.model.resolve import OllamaStore

    root = tmp_path / "models"
    secret = tmp_path / "secret.gguf"
    secret.write_bytes(b"GGUF")
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / "evil" / "latest"
    manifest.parent.mkdir(parents=True)
    (root / "blobs").mkdir()
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": "sha256:../../secret.gguf"}]}))
    assert OllamaStore().scan(root) == []
