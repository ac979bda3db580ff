"""Every way a client can leave gives back everything its request held; streams speak at once.

Regression tests for a server that stopped serving for good after `--conns` non-streaming
clients hung up (their handlers never returned). Each hang-up is done on a raw socket at a
chosen moment (in the queue, during the prefill, mid-reply), then the test checks what the
server holds afterwards (/health), what it counted (/metrics) and what it logged (the access-log
line of that request id). Nothing is timed: the checks count tokens and order events.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.server_util import Server, health, start_server, wait_for

STORY = "Write a very long story about a dragon who learns to cook."
NO_EOS = {"0": -100, "1": -100, "2": -100}  # SmolLM2's end-of-turn ids, so replies cannot end early


def long_prompt(tag: str) -> str:
    """~1,800 tokens that begin differently for each tag, so no KV slot holds any of them."""
    return f"[{tag}] Summarise this. " + "The quick brown fox jumps over the lazy dog. " * 180

# One long non-streaming request per route, in that route's own shape.
DIALECTS = {
    "chat": ("/v1/chat/completions", lambda text: {
        "messages": [{"role": "user", "content": text}], "max_tokens": 400, "temperature": 0,
        "logit_bias": NO_EOS}),
    "responses": ("/v1/responses", lambda text: {"input": text, "max_output_tokens": 400, "temperature": 0}),
    "messages": ("/v1/messages", lambda text: {
        "messages": [{"role": "user", "content": text}], "max_tokens": 400, "temperature": 0}),
    "completions": ("/v1/completions", lambda text: {
        "prompt": text, "max_tokens": 400, "temperature": 0, "logit_bias": NO_EOS}),
}

chat_body = DIALECTS["chat"][1]


def occupier_body() -> dict:
    """A reply that cannot end while a test runs (speculation makes 400 tokens of a looping story
    take only seconds): it holds the worker until the test hangs it up."""
    return {**chat_body(STORY), "max_tokens": 3500}


def port_of(server: Server) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


@dataclass
class RawRequest:
    """A POST on its own socket, its answer unread; `rest` is the part of the body not sent yet."""

    sock: socket.socket
    rest: bytes

    def close(self) -> None:
        self.sock.close()

    def send_rest(self) -> None:
        self.sock.sendall(self.rest)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        """Status, headers and body of a (non-chunked) answer read to the end of the connection."""
        raw = b""
        while chunk := self.sock.recv(65536):
            raw += chunk
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def raw_post(server: Server, path: str, body: dict, request_id: str = "", hold_back: int = 0) -> RawRequest:
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port_of(server)}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n")
    if request_id:
        head += f"X-Request-Id: {request_id}\r\n"
    sock = socket.create_connection(("127.0.0.1", port_of(server)), timeout=60)
    sock.sendall(head.encode() + b"\r\n" + data[:len(data) - hold_back])
    return RawRequest(sock, data[len(data) - hold_back:])


def access_line(server: Server, request_id: str) -> dict:
    for line in server.log().splitlines():
        if "lmserve.access" in line and request_id in line:
            return json.loads(line.split("lmserve.access: ", 1)[1])
    raise AssertionError(f"no access-log line for {request_id}")


def assert_idle(server: Server) -> None:
    """Nothing held: no queued or running request, every KV slot free."""
    wait_for(lambda: (lambda h: h["queue_depth"] == 0 and h["active_sequences"] == 0
                      and h["kv"]["in_use"] == 0)(health(server)))


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with start_server("--engine", "cpu", "--conns", "3", "--batch", "1", "--queue", "4", "--ctx", "4096",
                      "--prefill-chunk", "128") as s:
        yield s


@pytest.mark.parametrize("dialect", DIALECTS)
def test_non_streaming_hang_up_in_the_queue_gives_the_place_back(server, dialect):
    path, body = DIALECTS[dialect]
    occupier = raw_post(server, "/v1/chat/completions", occupier_body())  # holds the worker
    wait_for(lambda: health(server)["active_sequences"] == 1)
    waiting = raw_post(server, path, body(STORY), request_id=f"queued-{dialect}")
    wait_for(lambda: health(server)["queue_depth"] == 1)
    waiting.close()
    wait_for(lambda: health(server)["queue_depth"] == 0)
    generated = health(server)["tokens_generated"]  # the running request is untouched: it goes on
    wait_for(lambda: health(server)["tokens_generated"] > generated)
    occupier.close()
    assert_idle(server)
    line = access_line(server, f"queued-{dialect}")
    assert line["outcome"] == "client_closed" and line["status"] == 499


@pytest.mark.parametrize("dialect", DIALECTS)
def test_non_streaming_hang_up_during_the_prefill_never_generates(server, dialect):
    path, body = DIALECTS[dialect]
    before = health(server)["tokens_generated"]
    sock = raw_post(server, path, body(long_prompt(f"prefill-{dialect}")), request_id=f"prefill-{dialect}")
    wait_for(lambda: health(server)["active_sequences"] == 1)  # admitted: its prompt is being prefilled
    sock.close()
    assert_idle(server)
    assert health(server)["tokens_generated"] == before  # dropped after its prefill chunk, before a token
    assert access_line(server, f"prefill-{dialect}")["outcome"] == "client_closed"


@pytest.mark.parametrize("dialect", DIALECTS)
def test_non_streaming_hang_up_mid_reply_stops_generation(server, dialect):
    path, body = DIALECTS[dialect]
    before = health(server)["tokens_generated"]
    sock = raw_post(server, path, body(STORY), request_id=f"mid-{dialect}")
    wait_for(lambda: health(server)["tokens_generated"] >= before + 3)
    sock.close()
    assert_idle(server)
    stopped_at = health(server)["tokens_generated"]
    time.sleep(0.5)
    assert health(server)["tokens_generated"] == stopped_at
    line = access_line(server, f"mid-{dialect}")
    assert line["outcome"] == "client_closed" and line["status"] == 499


def test_more_hang_ups_than_conns_leave_the_server_serving(server):
    for _ in range(4):  # one more than --conns 3
        before = health(server)["tokens_generated"]
        sock = raw_post(server, "/v1/chat/completions", occupier_body())
        wait_for(lambda b=before: health(server)["tokens_generated"] >= b + 1)
        sock.close()
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
        "max_tokens": 16})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    closed = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
              for line in metrics.splitlines() if line.startswith("lmserve_client_closed_total{")}
    assert closed['route="/chat/completions"'] >= 4
    assert_idle(server)


def test_health_and_metrics_answer_when_conns_are_exhausted(server):
    held = [raw_post(server, "/v1/chat/completions", occupier_body()) for _ in range(3)]
    wait_for(lambda: health(server)["queue_depth"] == 2)  # one running, two waiting: all 3 places taken
    r = httpx.post(server.base_url + "/v1/chat/completions", json=chat_body("hi"), timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
    m = httpx.get(server.base_url + "/metrics", timeout=30)
    assert m.status_code == 200 and "lmserve_queue_depth 2" in m.text
    for sock in held:
        sock.close()
    assert_idle(server)


def test_requests_arriving_during_the_drain_get_503_in_their_own_envelope():
    """Each request's headers reach the server before SIGTERM, its body after: it is answered
    while the server drains, with 503 and `Connection: close`, not a 429 to be retried."""
    with start_server("--engine", "cpu", "--ctx", "1024") as s:
        socks = {name: raw_post(s, path, body("hi"), hold_back=5) for name, (path, body) in DIALECTS.items()}
        in_flight = f"lmserve_requests_in_flight {len(socks)}"
        wait_for(lambda: in_flight in httpx.get(s.base_url + "/metrics", timeout=30).text)  # waiting for bodies
        s.process.send_signal(signal.SIGTERM)
        wait_for(lambda: "stopping (SIGTERM)" in s.log())  # the server drains before the bodies arrive
        for pending in socks.values():
            pending.send_rest()
        for name, pending in socks.items():
            status, headers, body = pending.response()
            assert status == 503, (name, body)
            assert headers["connection"] == "close" and headers["retry-after"] == "5"
            payload = json.loads(body)
            if name == "messages":
                assert payload["type"] == "error" and payload["error"]["type"] == "overloaded_error"
            else:
                assert payload["error"]["type"] == "overloaded_error"
                assert payload["error"]["code"] == "server_shutting_down"
        assert s.process.wait(15) == 0


def sse_lines(server: Server, path: str, body: dict) -> list[str]:
    """Every line of a stream, comments included, in order."""
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        return list(r.iter_lines())


@pytest.fixture(scope="module")
def pinging_server() -> Iterator[Server]:
    with start_server("--engine", "cpu", "--batch", "1", "--ctx", "4096", "--sse-keepalive", "0.2") as s:
        yield s


def test_messages_stream_opens_and_pings_before_the_first_token_of_a_long_prefill(pinging_server):
    path, body = DIALECTS["messages"]
    lines = sse_lines(pinging_server, path, {**body(long_prompt("ping-messages")), "max_tokens": 2})
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert events[0] == "message_start"
    first_block = events.index("content_block_start")
    assert "ping" in events[1:first_block]  # the prefill of ~1,800 tokens ran past 0.2 s
    assert events[-1] == "message_stop"
    pings = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and '"ping"' in line]
    assert pings and all(p == {"type": "ping"} for p in pings)


def test_responses_stream_opens_at_once_and_keeps_alive_during_a_long_prefill(pinging_server):
    path, body = DIALECTS["responses"]
    lines = sse_lines(pinging_server, path, {**body(long_prompt("ping-responses")), "max_output_tokens": 16})
    kinds = [line.removeprefix("event: ") if line.startswith("event: ") else line for line in lines
             if line.startswith(("event: ", ":"))]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2].startswith(":")  # a keep-alive comment before any output item
    assert kinds[-1] in ("response.completed", "response.incomplete")


@pytest.mark.parametrize("dialect", ["chat", "completions"])
def test_openai_streams_send_comments_during_a_long_prefill(pinging_server, dialect):
    path, body = DIALECTS[dialect]
    lines = sse_lines(pinging_server, path, {**body(long_prompt(f"ping-{dialect}")), "max_tokens": 2})
    comments = [line for line in lines if line.startswith(":")]
    assert comments and all(c == ": keep-alive" for c in comments)
    # For chat the role chunk comes at admission; the keep-alives surround it, before any content.
    first_text = next(i for i, line in enumerate(lines) if line.startswith("data: ")
                      and ('"text":' in line or '"content":"' in line) and '"content":""' not in line)
    assert any(line.startswith(":") for line in lines[:first_text])
    assert [line for line in lines if line][-1] == "data: [DONE]"


def test_a_request_refused_before_admission_still_gets_a_plain_json_error(pinging_server):
    r = httpx.post(pinging_server.base_url + "/v1/messages", timeout=30, json={
        "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "word " * 5000}]})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_streams_keep_decoding_while_a_long_prompt_is_prefilled_beside_them():
    """Chunked prefill: a stream running beside a ~1,800-token prefill gets tokens during it."""
    with start_server("--engine", "cpu", "--batch", "2", "--ctx", "4096", "--prefill-chunk", "128") as s:
        arrivals: list[float] = []
        sent: dict[str, float] = {}

        def long_prompt_request() -> None:
            sent["at"] = time.monotonic()
            with httpx.stream("POST", s.base_url + "/v1/completions", timeout=300, json={
                    "prompt": long_prompt("beside"), "max_tokens": 1, "stream": True, "temperature": 0}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and "first_token" not in sent:
                        sent["first_token"] = time.monotonic()

        with httpx.stream("POST", s.base_url + "/v1/completions", timeout=300, json={
                "prompt": STORY, "max_tokens": 300, "stream": True, "temperature": 0,
                "logit_bias": NO_EOS}) as running:
            lines = running.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            beside = threading.Thread(target=long_prompt_request)
            beside.start()
            for line in lines:
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                if "first_token" in sent:
                    break
            beside.join()
        during = [t for t in arrivals if sent["at"] < t < sent["first_token"]]
        assert len(during) >= 4, f"only {len(during)} tokens streamed during a 14-chunk prefill"
