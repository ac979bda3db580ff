"""Serving under load: queue limits, cancellation, stalled readers, batching, shutdown, security.

Every check counts what the engine did (tokens generated, queue depth, active sequences from
/health) instead of timing anything.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.server_util import health, start_server, wait_for

# A reply that cannot end early: SmolLM2's end-of-generation ids are banned.
LONG = {"messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "temperature": 0, "max_tokens": 400, "logit_bias": {"0": -100, "2": -100, "4": -100}}


def chat_text(server, messages: list[dict], max_tokens: int = 32) -> str:
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=300,
                   json={"messages": messages, "temperature": 0, "max_tokens": max_tokens})
    return r.json()["choices"][0]["message"]["content"]


def stream_lines(server, body: dict, **kwargs):
    return httpx.stream("POST", server.base_url + "/v1/chat/completions", json={**body, "stream": True},
                        timeout=300, **kwargs)


@pytest.fixture(scope="module")
def small_queue():
    with start_server("--engine", "cpu", "--queue", "1", "--batch", "1", "--ctx", "1024") as server:
        yield server


def test_full_queue_gets_429_with_retry_after_and_recovers(small_queue):
    with stream_lines(small_queue, LONG) as running:  # occupies the worker
        lines = running.iter_lines()  # kept: a discarded line iterator closes the stream
        next(lines)
        wait_for(lambda: health(small_queue)["active_sequences"] == 1)
        queued = threading.Thread(target=chat_text, args=(small_queue, LONG["messages"], 2))
        queued.start()
        wait_for(lambda: health(small_queue)["queue_depth"] == 1)
        r = httpx.post(small_queue.base_url + "/v1/chat/completions", json=LONG, timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        r = httpx.post(small_queue.base_url + "/v1/messages", json={**LONG, "max_tokens": 5}, timeout=30)
        assert r.status_code == 429 and r.json()["type"] == "error"
    queued.join()
    assert chat_text(small_queue, [{"role": "user", "content": "What is the capital of France?"}]) == \
        "The capital of France is Paris."


def test_disconnect_stops_generation_and_frees_the_queue_place(small_queue):
    with stream_lines(small_queue, LONG) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
    # Generation stops within a token of the disconnect: the counter stops growing.
    wait_for(lambda: health(small_queue)["active_sequences"] == 0)
    before = health(small_queue)["tokens_generated"]
    time.sleep(1.0)
    assert health(small_queue)["tokens_generated"] == before
    # A queued request whose client leaves gives its place back and is never generated.
    with stream_lines(small_queue, LONG) as running:
        lines = running.iter_lines()
        next(lines)
        client = httpx.Client(timeout=1.0)
        with pytest.raises(httpx.ReadTimeout):
            client.post(small_queue.base_url + "/v1/chat/completions", json=LONG)
        client.close()
        wait_for(lambda: health(small_queue)["queue_depth"] == 0)
    wait_for(lambda: health(small_queue)["active_sequences"] == 0)


def test_non_streaming_disconnect_cancels_generation(small_queue):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(small_queue.base_url + "/v1/chat/completions", json=LONG, timeout=2.0)
    wait_for(lambda: health(small_queue)["active_sequences"] == 0)
    before = health(small_queue)["tokens_generated"]
    time.sleep(1.0)
    assert health(small_queue)["tokens_generated"] == before


def test_stalled_reader_does_not_hold_up_a_sibling(smollm2_server):
    body = {"messages": [{"role": "user", "content": "Count from one to fifty in words."}],
            "temperature": 0, "max_tokens": 48}
    with stream_lines(smollm2_server, body) as stalled:  # never read until the sibling is done
        sibling = chat_text(smollm2_server, [{"role": "user", "content": "What is the capital of France?"}])
        assert sibling == "The capital of France is Paris."
        # The stalled stream was generated in full server-side meanwhile (buffered for it).
        wait_for(lambda: health(smollm2_server)["active_sequences"] == 0)
        chunks = [json.loads(line[6:]) for line in stalled.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        chat_text(smollm2_server, body["messages"], 48)


def test_batch_of_four_equals_solo_goldens(smollm2_server, chat_goldens):
    results: dict[int, str] = {}

    def run(i: int) -> None:
        results[i] = chat_text(smollm2_server, chat_goldens[i]["messages"], 32)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert results[i] == chat_goldens[i]["greedy_text"].removesuffix("<|im_end|>")


def test_request_joining_mid_batch_streams_correctly(smollm2_server, chat_goldens):
    golden = chat_goldens[2]
    with stream_lines(smollm2_server, LONG) as running:
        lines = running.iter_lines()
        for _ in range(4):
            next(lines)  # the long stream is decoding
        joined = chat_text(smollm2_server, golden["messages"], 32)
    assert joined == golden["greedy_text"].removesuffix("<|im_end|>")


def test_sigterm_mid_stream_ends_the_stream_and_exits_zero():
    with start_server("--engine", "cpu", "--ctx", "1024") as server:
        with stream_lines(server, LONG) as r:
            lines = r.iter_lines()
            next(lines)
            server.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert "shutting down" in rest[-2]
        assert server.process.wait(10) == 0


@pytest.fixture(scope="module")
def secured():
    with start_server("--engine", "cpu", "--ctx", "1024", "--api-key", "sekrit", "--max-body", "16384",
                      "--allow-host", "lmserve.test") as server:
        yield server


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 1}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
])
def test_api_key_on_every_dialect_with_both_headers(secured, path, body):
    url = secured.base_url + path
    denied = httpx.post(url, json=body, timeout=60)
    assert denied.status_code == 401
    envelope = denied.json()
    assert envelope["type"] == "error" if path == "/v1/messages" else "error" in envelope
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    for headers in ({"Authorization": "Bearer sekrit"}, {"x-api-key": "sekrit"}):
        assert httpx.post(url, json=body, headers=headers, timeout=120).status_code == 200
    assert httpx.get(secured.base_url + "/health").status_code == 200  # open for probes


def test_foreign_host_rejected_and_allowed_host_accepted(secured):
    key = {"x-api-key": "sekrit"}
    r = httpx.get(secured.base_url + "/v1/models", headers={**key, "Host": "evil.example:8080"})
    assert r.status_code == 403 and "evil.example" in r.json()["error"]["message"]
    assert httpx.get(secured.base_url + "/v1/models", headers={**key, "Host": "lmserve.test"}).status_code == 200
    assert httpx.get(secured.base_url + "/v1/models", headers={**key, "Host": "localhost:1"}).status_code == 200


def test_oversized_body_is_413(secured):
    big = {"messages": [{"role": "user", "content": "x" * 20000}], "max_tokens": 1}
    r = httpx.post(secured.base_url + "/v1/chat/completions", json=big, headers={"x-api-key": "sekrit"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"

    def chunks():
        yield json.dumps(big).encode()

    r = httpx.post(secured.base_url + "/v1/messages", content=chunks(), headers={"x-api-key": "sekrit"})
    assert r.status_code == 413 and r.json()["type"] == "error"


def test_non_loopback_bind_without_key_refuses_to_start():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "lmserve.cli", "--host", "0.0.0.0", "--port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "without an API key" in result.stderr
    assert "Traceback" not in result.stderr
