"""Fuzzing every route: hostile bodies from hypothesis (tests/fuzz_strategies.py) and schema-driven
cases from schemathesis against /openapi.json. Every reply must be a 4xx in the route's dialect
envelope or a well-formed 200; never a 5xx, a hang or a traceback; the server keeps serving.

CI runs LMSERVE_FUZZ_EXAMPLES (default 30) derandomized examples per test; `scripts/fuzz.py
--examples N` runs more, with fresh randomness.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.fuzz_strategies import GENERATING, PATHS, Case, body_cases, raw_cases
from tests.wire_check import check_body, check_error, check_no_traceback, check_stream

EXAMPLES = int(os.environ.get("LMSERVE_FUZZ_EXAMPLES", "30"))
LONG_RUN = bool(os.environ.get("LMSERVE_FUZZ_RANDOM"))  # scripts/fuzz.py: fresh randomness, and shrinking
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True, derandomize=not LONG_RUN,
                suppress_health_check=list(HealthCheck),
                # Shrinking against a live server can take many minutes; CI reports the first failure.
                phases=list(Phase) if LONG_RUN else [Phase.explicit, Phase.generate])
TIMEOUT = 120.0  # valid cases reply within seconds: reaching this is a hang
ROUTES = {path: route for route, path in PATHS.items()}
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
DEFAULT_LENGTH_FIELD = {PATHS["chat"]: "max_tokens", PATHS["completions"]: "max_tokens",
                        PATHS["responses"]: "max_output_tokens", PATHS["messages"]: "max_tokens"}


def check_reply(path: str, status: int, content_type: str, text: str) -> None:
    """4xx in the dialect's envelope, or a well-formed 200; nothing else."""
    check_no_traceback(text)
    assert status < 500, f"{status} on {path}: {text[:500]}"
    if status >= 400:
        assert content_type.startswith("application/json"), f"{status} as {content_type}"
        check_error(path, status, json.loads(text))
        return
    route = ROUTES.get(path)
    if route in GENERATING:
        stream = content_type.startswith("text/event-stream")
        reply = check_stream(route, text) if stream else check_body(route, json.loads(text))
        assert reply.error is None, f"in-band error: {reply.error}"
    elif content_type.startswith("application/json"):
        json.loads(text)


def exchange(base_url: str, case: Case) -> None:
    note(repr(case))  # printed with a failing example
    headers = {} if case.content_type is None else {"content-type": case.content_type}
    r = httpx.request(case.method, base_url + case.path, content=case.body, headers=headers, timeout=TIMEOUT)
    if case.method == "HEAD":  # no body to check
        assert r.status_code < 500, r.status_code
        return
    check_reply(case.path, r.status_code, r.headers.get("content-type", ""), r.text)


def assert_still_serving(server) -> None:
    """A normal request gets its usual greedy answer, and nothing is left queued or held."""
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
        "max_tokens": 16})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    health = httpx.get(server.base_url + "/health", timeout=30).json()
    assert (health["queue_depth"], health["active_sequences"], health["kv"]["in_use"]) == (0, 0, 0), health


def fuzz(strategy: st.SearchStrategy, run: Callable) -> None:
    """Run `run` on FUZZ's number of examples of `strategy`; prints the count (pytest -s shows it)."""
    count = 0

    def counted(case) -> None:
        nonlocal count
        count += 1
        run(case)

    given(strategy)(FUZZ(counted))()
    print(f"fuzz: {count} examples")


@pytest.mark.parametrize("route", sorted(PATHS))
def test_fuzz_hostile_bodies(smollm2_server, route):
    fuzz(body_cases(route), lambda case: exchange(smollm2_server.base_url, case))
    assert_still_serving(smollm2_server)


def test_fuzz_raw_bytes_and_content_types(smollm2_server):
    fuzz(raw_cases(), lambda case: exchange(smollm2_server.base_url, case))
    assert_still_serving(smollm2_server)


@pytest.fixture(scope="module")
def openapi(smollm2_server):
    schema = schemathesis.openapi.from_url(smollm2_server.base_url + "/openapi.json")
    return schema.include(path_regex=r"^/(v1/|tokenize|detokenize|health|metrics)")


def cap_length(path: str, body: dict) -> None:
    """Keep a schema-generated reply at 2 tokens (the rest of the body is what is under test):
    cap a valid length field, set one where none is given (the defaults run to thousands)."""
    for key in LENGTH_FIELDS:
        if isinstance(body.get(key), int | float) and not isinstance(body[key], bool):
            body[key] = min(body[key], 2)
    key = DEFAULT_LENGTH_FIELD.get(path)
    if key and body.get(key) is None and body.get("max_completion_tokens") is None:
        body[key] = 2


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_fuzz_openapi_document(smollm2_server, openapi, mode):
    """Schemathesis cases for every documented operation, valid (positive) and invalid (negative)."""

    def run(case) -> None:
        note(f"{case.method} {case.formatted_path} {case.body!r:.2000}")
        if isinstance(case.body, dict):
            cap_length(case.formatted_path, case.body)
        r = case.call(base_url=smollm2_server.base_url, timeout=TIMEOUT)
        content_type = r.headers.get("content-type") or [""]  # schemathesis keeps every value of a header
        check_reply(case.formatted_path, r.status_code, content_type[0], r.text)

    fuzz(openapi.as_strategy(generation_mode=mode), run)
    assert_still_serving(smollm2_server)


def test_openapi_document_declares_every_request_body(smollm2_server):
    doc = httpx.get(smollm2_server.base_url + "/openapi.json", timeout=30).json()
    for path in PATHS.values():
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["type"] == "object" and body["properties"], path


# -- regressions found by the fuzzers -------------------------------------------------------------

def post_raw(server, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(server.base_url + path, content=raw, headers={"content-type": "application/json"},
                      timeout=TIMEOUT)


SURROGATE_BODIES = {
    "chat": '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
    "responses": '{"input": "a\\ud800b", "max_output_tokens": 2}',
    "completions": '{"prompt": "a\\udfffb", "max_tokens": 2}',
    "messages": '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}], "max_tokens": 2}',
    "count_tokens": '{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
    "tokenize": '{"content": "a\\ud800b"}',
    "detokenize": '{"tokens": [1], "x\\udfff": 1}',
}


@pytest.mark.parametrize("route", sorted(SURROGATE_BODIES))
def test_regression_lone_surrogate_in_content_is_400(smollm2_server, route):
    r = post_raw(smollm2_server, PATHS[route], SURROGATE_BODIES[route].encode())
    assert r.status_code == 400, r.text
    assert "surrogate" in check_error(PATHS[route], 400, r.json())


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_regression_lone_surrogate_in_a_key_is_400_not_a_plain_500(smollm2_server, path):
    """The refusal names the field, and the field's name is the surrogate: the envelope must
    still encode (it once failed inside the error handler, leaving uvicorn's plain-text 500)."""
    r = post_raw(smollm2_server, path, b'{"messages": [], "\\ud800": [{"\\udb43\\udc77": 1}]}')
    assert r.status_code == 400, r.text
    assert "surrogate" in check_error(path, 400, r.json())


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_regression_deeply_nested_body_is_400_not_recursion_error(smollm2_server, path):
    for raw in ("[" * 100_000 + "]" * 100_000, '{"metadata": ' + '{"a":' * 200 + "1" + "}" * 201):
        r = post_raw(smollm2_server, path, raw.encode())
        assert r.status_code == 400, r.text
        assert "nests deeper" in check_error(path, 400, r.json())


def test_regression_integer_with_5000_digits_is_400(smollm2_server):
    r = post_raw(smollm2_server, "/v1/chat/completions",
                 b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}")
    assert r.status_code == 400, r.text
    assert "too many digits" in check_error("/v1/chat/completions", 400, r.json())


@pytest.mark.parametrize("seed", [-1, -(2**63)])
def test_regression_negative_seed_is_served_not_failed_in_the_worker(smollm2_server, seed):
    r = httpx.post(smollm2_server.base_url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": seed, "temperature": 1})
    assert r.status_code == 200, r.text
    check_body("chat", r.json())


@pytest.mark.parametrize("penalty", [0, 5e-324, 0.001])
def test_regression_repeat_penalty_near_zero_is_400_not_nan_probabilities(smollm2_server, penalty):
    r = httpx.post(smollm2_server.base_url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "repeat_penalty": penalty})
    assert r.status_code == 400, r.text
    assert check_error("/v1/chat/completions", 400, r.json()).startswith("repeat_penalty:")


@pytest.mark.parametrize("temperature", [5e-324, 1e-310])
def test_regression_denormal_temperature_samples_instead_of_nan_probabilities(smollm2_server, temperature):
    """A temperature this small is greedy in effect; dividing unshifted logits by it overflowed."""
    r = httpx.post(smollm2_server.base_url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
        "temperature": temperature})
    assert r.status_code == 200, r.text
    assert check_body("chat", r.json()).text == "The capital of France is Paris."


@pytest.mark.parametrize(("route", "body", "param"), [
    ("chat", {"messages": [{"role": [], "content": "x"}], "max_tokens": 2}, "messages[0].role"),
    ("responses", {"input": [{"type": []}], "max_output_tokens": 2}, "input[0].type"),
    ("messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tool_choice": {"type": {}}},
     "tool_choice.type"),
])
def test_regression_list_or_object_where_a_role_or_type_goes_is_400_not_unhashable_500(smollm2_server, route, body,
                                                                                         param):
    r = httpx.post(smollm2_server.base_url + PATHS[route], json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert check_error(PATHS[route], 400, r.json()).startswith(param)
