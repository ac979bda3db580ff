"""Operations: /metrics in Prometheus format, X-Request-Id, one structured log line per request."""

from __future__ import annotations

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

CAPITAL = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}


def scrape(server) -> dict[str, dict]:
    text = httpx.get(server.base_url + "/metrics").text
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_metrics_move_after_a_request_and_parse(smollm2_server):
    before = scrape(smollm2_server)
    r = httpx.post(smollm2_server.base_url + "/v1/chat/completions", json={**CAPITAL, "stream": True},
                   timeout=120)
    assert r.status_code == 200
    after = scrape(smollm2_server)
    route = (("route", "/chat/completions"), ("status", "200"))
    assert after["lmserve_requests_total"][route] == before["lmserve_requests_total"].get(route, 0) + 1
    assert after["lmserve_completion_tokens_total"][()] - before["lmserve_completion_tokens_total"][()] == 7
    assert after["lmserve_prompt_tokens_total"][()] - before["lmserve_prompt_tokens_total"][()] == 37
    count = "lmserve_time_to_first_token_seconds_count"
    assert after[count][()] == before[count][()] + 1
    assert after["lmserve_inter_token_latency_seconds_count"][()] >= \
        before["lmserve_inter_token_latency_seconds_count"][()] + 6
    for gauge in ("lmserve_queue_depth", "lmserve_active_sequences", "lmserve_kv_bytes",
                  "lmserve_cached_tokens_total"):
        assert gauge in after


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
