"""Ollama's API (issue 31) through the `ollama` Python client that Mac apps' integrations use: the
model list, chat and generate (NDJSON streams and single objects), options, format, tools, think,
keep_alive, show, ps, version, embed; errors in Ollama's shape; the same replies as the OpenAI
route for the same request."""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import ollama
import pytest

from tests.conftest import DATA
from tests.families import ARCH
from tests.server_util import start_server, wait_for

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 12}
EMBEDDER = DATA / "fixtures" / "embedding" / "tiny-qwen3-embedding-F16.gguf"


@pytest.fixture(scope="module")
def server():
    with start_server("--engine", "cpu", "--ctx", "4096", "--models-dir", str(EMBEDDER.parent)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.base_url)


@pytest.fixture(scope="module")
def served(client) -> str:
    """The startup model's name, as an app reads it from /api/tags."""
    return client.list().models[0].model


def test_the_model_list_and_version(client: ollama.Client, served: str) -> None:
    models = {m.model: m for m in client.list().models}
    assert served.startswith("SmolLM2") and "tiny-qwen3-embedding-F16" in models
    first = models[served]
    assert first.size > 50_000_000 and first.details.format == "gguf" and first.details.family == "llama"
    assert first.details.quantization_level == "Q4_1" and first.details.parameter_size == "135M"
    assert httpx.get(client._client.base_url.join("/api/version")).json()["version"].count(".") == 2


def test_chat_streams_ndjson_and_matches_the_openai_route(client: ollama.Client, server, served: str) -> None:
    parts = list(client.chat(model=served, messages=QUESTION, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason in ("stop", "length")
    text = "".join(p.message.content for p in parts)
    whole = client.chat(model=served, messages=QUESTION, options=GREEDY)
    assert whole.message.role == "assistant" and whole.message.content == text and "Paris" in text
    assert 0 < whole.eval_count <= 12 and whole.prompt_eval_count > 10 and whole.total_duration > 0
    openai = httpx.post(server.base_url + "/v1/chat/completions", json={
        "messages": QUESTION, "temperature": 0, "max_tokens": 12}).json()
    assert openai["choices"][0]["message"]["content"] == text
    raw = httpx.post(server.base_url + "/api/chat", json={"model": served, "messages": QUESTION, "options": GREEDY})
    assert raw.headers["content-type"].startswith("application/x-ndjson")
    assert [json.loads(line)["done"] for line in raw.text.splitlines()][-1] is True


def test_generate_with_system_and_raw(client: ollama.Client, served: str) -> None:
    reply = client.generate(model=served, prompt="What is the capital of France?", system="Answer in one word.",
                            options=GREEDY)
    assert reply.done and reply.response.strip()
    streamed = "".join(p.response for p in client.generate(model=served, prompt="What is the capital of France?",
                                                           system="Answer in one word.", options=GREEDY, stream=True))
    assert streamed == reply.response
    raw = client.generate(model=served, prompt="One, two, three,", raw=True, options={"temperature": 0, "num_predict": 4})
    assert raw.eval_count == 4 and raw.response


def test_format_and_tools(client: ollama.Client, served: str) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    reply = client.chat(model=served, messages=QUESTION, format=schema, options={"temperature": 0, "num_predict": 40})
    assert set(json.loads(reply.message.content)) == {"city"}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    ask = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    called = client.chat(model=served, messages=ask, tools=tools, options={"temperature": 0, "num_predict": 60})
    history = [*ask, called.message.model_dump(exclude_none=True),
               {"role": "tool", "content": "Sunny, 21 C", "tool_name": "get_weather"}]
    after = client.chat(model=served, messages=history, tools=tools, options=GREEDY)
    assert after.done and after.message.role == "assistant"
    if called.message.tool_calls:  # SmolLM2 may answer in prose: then the round trip is plain chat
        assert called.message.tool_calls[0].function.name == "get_weather"
        assert isinstance(called.message.tool_calls[0].function.arguments, dict)


def test_show_and_ps(client: ollama.Client, served: str) -> None:
    shown = client.show(served)
    assert "completion" in shown.capabilities and shown.template and "temperature" in shown.parameters
    assert shown.modelinfo["general.architecture"] == "llama"
    running = client.ps().models
    assert running[0].model == served and running[0].size > 0


def test_embed_loads_the_named_model_and_keep_alive_unloads_it(client: ollama.Client, server) -> None:
    result = client.embed(model="tiny-qwen3-embedding-F16", input=["hello world", "goodbye"], keep_alive="1s")
    assert len(result.embeddings) == 2 and len(result.embeddings[0]) == 64
    assert abs(np.linalg.norm(result.embeddings[0]) - 1) < 1e-5 and result.prompt_eval_count > 2
    legacy = client.embeddings(model="tiny-qwen3-embedding-F16", prompt="hello world")
    np.testing.assert_allclose(legacy.embedding, result.embeddings[0], rtol=1e-6)
    wait_for(lambda: "tiny-qwen3-embedding-F16" not in {m.model for m in client.ps().models}, timeout=30)


def test_errors_come_in_ollamas_shape(client: ollama.Client, server, served: str) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="qwen3:8b", messages=QUESTION)
    assert info.value.status_code == 404 and "qwen3:8b" in info.value.error
    r = httpx.post(server.base_url + "/api/chat", json={"model": served, "messages": QUESTION,
                                                        "options": {"temperature": 7}})
    assert r.status_code == 400 and set(r.json()) == {"error"} and "temperature" in r.json()["error"]
    r = httpx.post(server.base_url + "/api/chat", json={"messages": QUESTION})
    assert r.status_code == 400 and "model" in r.json()["error"]
    r = httpx.post(server.base_url + "/api/generate", json={"model": served, "prompt": "x", "images": ["aGk="]})
    assert r.status_code == 400 and "images" in r.json()["error"]


def test_a_load_request_without_messages(client: ollama.Client, server) -> None:
    """What apps send to preload a model: no messages; keep_alive 0 unloads it again."""
    models = ARCH / "qwen2" / "tiny-qwen2-Q8_0.gguf"
    with start_server("--engine", "cpu", "--ctx", "256", "--models-dir", str(models.parent)) as s:
        loaded = httpx.post(s.base_url + "/api/chat", json={"model": "tiny-qwen2-Q8_0", "messages": []}).json()
        assert loaded["done"] and loaded["done_reason"] == "load"
        assert "tiny-qwen2-Q8_0" in {m["model"] for m in httpx.get(s.base_url + "/api/ps").json()["models"]}
        gone = httpx.post(s.base_url + "/api/generate", json={"model": "tiny-qwen2-Q8_0", "keep_alive": 0}).json()
        assert gone["done_reason"] == "unload"
        assert "tiny-qwen2-Q8_0" not in {m["model"] for m in httpx.get(s.base_url + "/api/ps").json()["models"]}


# Continue's Ollama provider (continuedev/continue, core/llm/llms/Ollama.ts): the bodies it builds,
# written out from its source (no recording of the app itself was at hand). Options it leaves
# undefined are dropped by JSON.stringify; keep_alive is its 30-minute default in seconds.
CONTINUE_OPTIONS = {"temperature": 0, "top_p": 0.9, "top_k": 40, "num_predict": 12, "stop": ["\n\n"],
                    "num_ctx": 4096, "min_p": 0.05}
CONTINUE_MODELFILE_LINE = r'^(\S+)\s+((?:".*")|\S+)$'


def test_continues_ollama_provider(server, served: str) -> None:
    """What Continue reads and sends: /api/show by `name`, every `parameters` line its pattern
    parses (num_ctx gives it the context length; a template without `.Suffix` keeps it off
    fill-in-the-middle), a streamed chat and generate, and a chat with tools, which it sends
    unstreamed."""
    shown = httpx.post(server.base_url + "/api/show", json={"name": served}).json()
    lines = shown["parameters"].split("\n")
    assert all(re.match(CONTINUE_MODELFILE_LINE, line) for line in lines), lines
    assert "num_ctx 4096" in lines and ".Suffix" not in shown["template"]
    messages = [{"role": "system", "content": "You are a helpful assistant."}, *QUESTION]
    body = {"model": served, "messages": messages, "options": CONTINUE_OPTIONS, "keep_alive": 1800, "stream": True}
    with httpx.stream("POST", server.base_url + "/api/chat", json=body) as r:
        chunks = [json.loads(line) for line in r.iter_lines() if line.strip()]
    assert r.status_code == 200 and all(c["message"]["role"] == "assistant" for c in chunks)
    assert chunks[-1]["done"] and not any(c["done"] for c in chunks[:-1]) and chunks[-1]["eval_count"] <= 12
    assert "".join(c["message"]["content"] for c in chunks).strip()
    tool = {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                             "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                            "required": ["path"]}}}
    reply = httpx.post(server.base_url + "/api/chat", json={**body, "tools": [tool], "stream": False}).json()
    assert reply["done"] and reply["message"]["role"] == "assistant"
    for call in reply["message"].get("tool_calls", []):
        assert call["function"]["name"] == "read_file" and isinstance(call["function"]["arguments"], dict)
    generate = {"model": served, "prompt": "def fibonacci(n):", "options": CONTINUE_OPTIONS, "keep_alive": 1800,
                "stream": True}
    with httpx.stream("POST", server.base_url + "/api/generate", json=generate) as r:
        chunks = [json.loads(line) for line in r.iter_lines() if line.strip()]
    assert r.status_code == 200 and chunks[-1]["done"] and "".join(c["response"] for c in chunks)
