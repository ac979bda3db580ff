"""Operations: /metrics in Prometheus format, X-Request-Id, one structured log line per request."""

from __future__ import annotations

import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server_util import start_server, wait_for

HISTOGRAMS = ("lmserve_time_to_first_token_seconds", "lmserve_inter_token_latency_seconds")
CAPITAL = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}


def scrape(server) -> dict[str, dict]:
    text = httpx.get(server.base_url + "/metrics").text
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def series_delta(before: dict, after: dict, name: str) -> dict[tuple, float]:
    """The series of `name` that moved between two scrapes, and by how much."""
    old, new = before.get(name, {}), after.get(name, {})
    return {labels: value - old.get(labels, 0) for labels, value in new.items() if value != old.get(labels, 0)}


def route(path: str, status: int) -> tuple:
    return (("route", path), ("status", str(status)))


def stream_chat(server, body: dict) -> tuple[list[str], dict, float]:
    """The text deltas and the usage of one streamed chat completion, and how long it took."""
    start = time.perf_counter()
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    elapsed = time.perf_counter() - start
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    deltas = [c["choices"][0]["delta"]["content"] for c in chunks
              if c["choices"] and c["choices"][0]["delta"].get("content")]
    return deltas, chunks[-1]["usage"], elapsed


def assert_histograms_consistent(metrics: dict) -> None:
    for name in HISTOGRAMS:
        buckets = sorted(((float(dict(labels)["le"]), n) for labels, n in metrics[name + "_bucket"].items()))
        counts = [n for _, n in buckets]
        assert counts == sorted(counts), name  # cumulative
        assert buckets[-1] == (float("inf"), metrics[name + "_count"][()]), name


def test_metrics_count_exactly_what_the_requests_did(smollm2_server):
    before = scrape(smollm2_server)
    body = {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "temperature": 0, "max_tokens": 5}
    deltas, usage, elapsed = stream_chat(smollm2_server, body)
    assert usage["completion_tokens"] == 5 and "".join(deltas) == "The answer to this question"
    refused = httpx.post(smollm2_server.base_url + "/v1/chat/completions", json={**body, "max_tokens": 0})
    assert refused.status_code == 400
    assert httpx.get(smollm2_server.base_url + "/v1/nope").status_code == 404
    after = scrape(smollm2_server)

    # one count per request, under its route and status, nothing else (the first scrape is one too)
    assert series_delta(before, after, "lmserve_requests_total") == {
        route("/chat/completions", 200): 1, route("/chat/completions", 400): 1, route("other", 404): 1,
        route("/metrics", 200): 1}
    # the tokens the reply reported, once; the refused request adds none
    tokens = {kind: after[f"lmserve_{kind}_tokens_total"][()] - before[f"lmserve_{kind}_tokens_total"][()]
              for kind in ("prompt", "completion", "cached")}
    assert tokens == {"prompt": usage["prompt_tokens"], "completion": 5,
                      "cached": usage["prompt_tokens_details"]["cached_tokens"]}
    # the first text piece once, then one gap per further piece: 5 pieces, 4 gaps
    count = {name: after[name + "_count"][()] - before[name + "_count"][()] for name in HISTOGRAMS}
    assert len(deltas) == 5
    assert count == {"lmserve_time_to_first_token_seconds": 1, "lmserve_inter_token_latency_seconds": 4}
    for name in HISTOGRAMS:  # in seconds: what was observed fits in the time the request took
        assert 0 < after[name + "_sum"][()] - before[name + "_sum"][()] < elapsed
    assert_histograms_consistent(after)
    assert series_delta(before, after, "lmserve_client_closed_total") == {}
    # the gauges read the server as it is now: idle, its KV bytes as /health reports them
    health = httpx.get(smollm2_server.base_url + "/health").json()
    assert after["lmserve_queue_depth"][()] == 0 and after["lmserve_active_sequences"][()] == 0
    assert after["lmserve_kv_bytes"][()] == health["kv"]["kv_bytes"] > 0


def test_metrics_count_a_non_streaming_reply(smollm2_server):
    before = scrape(smollm2_server)
    r = httpx.post(smollm2_server.base_url + "/v1/chat/completions", json=CAPITAL, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    usage = r.json()["usage"]
    after = scrape(smollm2_server)
    assert series_delta(before, after, "lmserve_requests_total") == {
        route("/chat/completions", 200): 1, route("/metrics", 200): 1}
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (37, 7)
    for kind, reported in (("prompt", 37), ("completion", 7),
                           ("cached", usage["prompt_tokens_details"]["cached_tokens"])):
        name = f"lmserve_{kind}_tokens_total"
        assert after[name][()] - before[name][()] == reported, name
    ttft, gaps = (after[name + "_count"][()] - before[name + "_count"][()] for name in HISTOGRAMS)
    assert ttft == 1 and gaps == 6  # one text piece per word of the reply, as it streams
    assert_histograms_consistent(after)


def test_a_client_leaving_a_stream_is_counted_once(smollm2_server):
    before = scrape(smollm2_server)
    body = {"messages": [{"role": "user", "content": "Write a long story about a dragon."}], "temperature": 0,
            "max_tokens": 300, "stream": True, "logit_bias": {"0": -100, "1": -100, "2": -100}}  # no early end
    with httpx.stream("POST", smollm2_server.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        read = 0
        for line in r.iter_lines():
            chunk = json.loads(line[6:]) if line.startswith("data: {") else {"choices": []}
            read += bool(chunk["choices"] and chunk["choices"][0]["delta"].get("content"))
            if read == 3:
                break  # leave after three text pieces
    key = (("route", "/chat/completions"),)
    closed_before = before.get("lmserve_client_closed_total", {}).get(key, 0)
    wait_for(lambda: scrape(smollm2_server).get("lmserve_client_closed_total", {}).get(key, 0) > closed_before)
    wait_for(lambda: httpx.get(smollm2_server.base_url + "/health").json()["active_sequences"] == 0)
    after = scrape(smollm2_server)
    assert series_delta(before, after, "lmserve_client_closed_total") == {key: 1}
    moved = series_delta(before, after, "lmserve_requests_total")
    assert moved.pop(route("/chat/completions", 200)) == 1  # the stream had started: its status was 200
    assert set(moved) <= {route("/metrics", 200), route("/health", 200)}  # only the polling besides
    assert after[HISTOGRAMS[0] + "_count"][()] == before[HISTOGRAMS[0] + "_count"][()] + 1
    assert after["lmserve_active_sequences"][()] == 0 and after["lmserve_queue_depth"][()] == 0


def test_request_id_round_trip_and_log_line(smollm2_server):
    r = httpx.post(smollm2_server.base_url + "/v1/chat/completions", json=CAPITAL, timeout=120,
                   headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    generated = httpx.get(smollm2_server.base_url + "/v1/models").headers["x-request-id"]
    assert len(generated) == 32
    refused = httpx.post(smollm2_server.base_url + "/v1/chat/completions", content=b"{",
                         headers={"X-Request-Id": "not a sane id; <script>"})
    assert refused.status_code == 400 and len(refused.headers["x-request-id"]) == 32
    lines = [line for line in smollm2_server.log().splitlines() if '"trace-42"' in line]
    assert len(lines) == 1
    entry = json.loads(lines[0][lines[0].index("{"):])
    assert entry["route"] == "/chat/completions" and entry["status"] == 200
    assert (entry["prompt_tokens"], entry["completion_tokens"]) == (37, 7)
    assert entry["cached_tokens"] >= 0 and entry["ttft_ms"] > 0 and entry["duration_ms"] >= entry["ttft_ms"]


def test_fit_answers_what_a_context_would_cost(smollm2_server):
    """GET /fit: the RAM guard's arithmetic for SmolLM2 on the NumPy engine (46,080 bytes of K/V a
    token); a bad value is a 400 naming it."""
    served = httpx.get(smollm2_server.base_url + "/fit").json()
    assert served["ctx"] == httpx.get(smollm2_server.base_url + "/health").json()["context"]
    fit = httpx.get(smollm2_server.base_url + "/fit", params={"ctx": 4096, "slots": 2}).json()
    assert (fit["kv_bytes_per_token"], fit["bytes_per_slot"], fit["kv_bytes"]) == (46_080, 46_080 * 4096,
                                                                                   2 * 46_080 * 4096)
    assert fit["fits"] and fit["weight_bytes"] > 0 and fit["largest_ctx_one_slot"] > 4096
    bad = httpx.get(smollm2_server.base_url + "/fit", params={"ctx": 0})
    assert bad.status_code == 400 and "ctx" in bad.text
    kv = httpx.get(smollm2_server.base_url + "/health").json()["kv"]
    assert (kv["type"], kv["bytes_per_token"]) == ("f32", 46_080)


def test_a_quantized_kv_cache_is_priced_reported_and_answers_right() -> None:
    """--kv-type q8_0: the banner and /health name it, the RAM guard prices a SmolLM2 position at
    q8_0's 12,240 bytes (34 per 32 values: 0.27x float32) in /fit and the slots it sizes, and the
    embedded model still answers the README's question right."""
    with start_server("--kv-type", "q8_0", "--ctx", "2048") as server:
        assert "keys and values as q8_0 (12.0 KiB a position)" in server.log()
        kv = httpx.get(server.base_url + "/health").json()["kv"]
        assert (kv["type"], kv["bytes_per_token"]) == ("q8_0", 12_240)
        fit = httpx.get(server.base_url + "/fit", params={"ctx": 4096, "slots": 2}).json()
        assert (fit["kv_bytes_per_token"], fit["bytes_per_slot"]) == (12_240, 12_240 * 4096)
        reply = httpx.post(server.base_url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16}).json()
        assert "Paris" in reply["choices"][0]["message"]["content"]
        assert httpx.get(server.base_url + "/health").json()["kv"]["kv_bytes"] > 0
