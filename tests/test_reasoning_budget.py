"""Reasoning budgets, end to end: a model that would reason forever still gives a forced call
within max_tokens, in all three dialects, streamed and not, on a `<think>` family (Qwen3.5, whose
generation prompt opens the block) and on harmony (gpt-oss); every budget field lands in the
usage's reasoning tokens; reasoning_format none and parallel_tool_calls false as llama-server and
OpenAI have them.

The model is the ScriptedEngine (tests/engine_proxies.py) over the tiny fixtures: it reasons
without end, and only where the server forces the close of its reasoning does the script go on
(`Rule.resync`), so a reply that gets its call or answer got it because the budget closed the block.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from lmserve.chat.reasoning import think_budget
from tests.engine_proxies import Rule, Script
from tests.families import Fixture
from tests.hooked_server import Hooks
from tests.server_util import Server, start_server
from tests.wire_check import PATHS, Reply, check_body, check_stream

SERVER_BUDGET = 40  # --reasoning-budget of the servers below
FOREVER = "hmm " * 4000  # more reasoning than any max_tokens here
NIHON = "日本語"  # three characters of three bytes, each byte one token of the fixtures' vocabularies
CLOSES = {"qwen35": "\n</think>\n\n", "gpt-oss": "<|end|><|start|>assistant"}  # what the server forces
CALL = {"qwen35": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                  "</tool_call>",
        "gpt-oss": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
                   "<|call|>"}
ANSWER = {"qwen35": "It is sunny.", "gpt-oss": "<|channel|>final<|message|>It is sunny."}
OPENS = {"qwen35": "", "gpt-oss": "<|channel|>analysis<|message|>"}  # the reply's own opening of its reasoning
TWO_CALLS = "ok\n</think>\n\n" + CALL["qwen35"] + "\n" + CALL["qwen35"].replace("Paris", "Rome")
WEATHER_TOOL = {"name": "get_weather", "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def script(family: str) -> Script:
    opens, close = OPENS[family], CLOSES[family]
    return Script((Rule("WEATHER", opens + FOREVER, close, CALL[family]),
                   Rule("ANSWER", opens + FOREVER, close, ANSWER[family]),
                   Rule("NIHON", opens + NIHON * 2000, close, CALL[family]),
                   Rule("TWICE", TWO_CALLS)))


@pytest.fixture(scope="module", params=["qwen35", "gpt-oss"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Server]]:
    family = request.param
    path = tmp_path_factory.mktemp("script") / "script.json"
    script(family).dump(path)
    with start_server(str(Fixture(family, "Q8_0").path), "--engine", "cpu", "--ctx", "4096", "--speculate", "off",
                      "--reasoning-budget", str(SERVER_BUDGET), hooks=Hooks(script=path)) as server:
        yield family, server


def body_for(dialect: str, text: str, max_tokens: int, stream: bool, tools: bool, forced: bool) -> dict:
    """One user turn in `dialect`'s shape, with get_weather offered (and forced) when asked."""
    body: dict = {"stream": stream, "temperature": 0}
    if dialect == "messages":
        body |= {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
        if tools:
            body["tools"] = [{"name": WEATHER_TOOL["name"], "description": WEATHER_TOOL["description"],
                              "input_schema": WEATHER_TOOL["parameters"]}]
            body["tool_choice"] = {"type": "any" if forced else "auto"}
    elif dialect == "responses":
        body |= {"input": text, "max_output_tokens": max_tokens, "store": False}
        if tools:
            body["tools"] = [{"type": "function", **WEATHER_TOOL}]
            body["tool_choice"] = "required" if forced else "auto"
    else:
        body |= {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if tools:
            body["tools"] = [{"type": "function", "function": WEATHER_TOOL}]
            body["tool_choice"] = "required" if forced else "auto"
    return body


def send(server: Server, dialect: str, body: dict) -> Reply:
    url = server.base_url + PATHS[dialect]
    if body.get("stream"):
        with httpx.stream("POST", url, json=body, timeout=300) as r:
            raw = r.read().decode()
        assert r.status_code == 200, raw
        reply = check_stream(dialect, raw)
    else:
        r = httpx.post(url, json=body, timeout=300)
        assert r.status_code == 200, r.text
        reply = check_body(dialect, r.json())
    assert reply.error is None, reply.error
    return reply


def close_tokens(family: str) -> int:
    """An upper bound on the forced close's tokens that usage counts as reasoning."""
    return len(CLOSES[family])


def check_budget(family: str, reply: Reply, budget: int) -> None:
    """Reasoning stopped at the budget: the close the server forced is all it spent beyond it."""
    if reply.reasoning_tokens is not None:
        assert budget <= reply.reasoning_tokens <= budget + close_tokens(family), (reply.reasoning_tokens, budget)
    assert reply.reasoning.startswith("hmm") or budget == 0
    assert len(reply.reasoning) <= len("hmm ") * (budget + close_tokens(family))


FINISHED_BY_CALL = {"chat": "tool_calls", "responses": "completed", "messages": "tool_use"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_a_forced_call_arrives_from_a_model_that_would_reason_forever(served: tuple[str, Server], dialect: str,
                                                                      stream: bool) -> None:
    family, server = served
    body = body_for(dialect, "WEATHER in Paris?", 300, stream, tools=True, forced=True)
    if dialect == "messages":
        body["thinking"] = {"type": "adaptive"}  # reasoning on (Anthropic's API thinks only when asked)
    reply = send(server, dialect, body)
    assert reply.calls and [(n, json.loads(a)) for n, a in reply.calls] == [("get_weather", {"city": "Paris"})]
    assert reply.finish == FINISHED_BY_CALL[dialect] and not reply.text
    check_budget(family, reply, min(SERVER_BUDGET, think_budget(None, 300, governed=True)))


@pytest.mark.parametrize("budget", [10, 11, 12])
def test_a_budget_that_ends_inside_a_character_closes_after_it(served: tuple[str, Server], budget: int) -> None:
    """Reasoning in characters of several tokens: the forced close waits for the character to end
    (a close after a lone lead byte broke the call grammar, and the reply ended without its call)."""
    family, server = served
    body = body_for("chat", "NIHON", 300, False, tools=True, forced=True) | {"thinking_token_budget": budget}
    reply = send(server, "chat", body)
    assert reply.calls and [(n, json.loads(a)) for n, a in reply.calls] == [("get_weather", {"city": "Paris"})]
    assert reply.finish == "tool_calls" and not reply.text
    whole = -(-budget // 3)  # the characters begun within the budget
    assert reply.reasoning.strip() == (NIHON * 2000)[:whole], reply.reasoning
    assert reply.reasoning_tokens is None or 3 * whole <= reply.reasoning_tokens <= 3 * whole + close_tokens(family)


@pytest.mark.parametrize(("dialect", "fields", "max_tokens", "budget"), [
    ("chat", {}, 300, SERVER_BUDGET),  # the server's --reasoning-budget
    ("chat", {"thinking_token_budget": 12}, 300, 12),
    ("chat", {"thinking_token_budget": -1}, 200, 150),  # no budget of its own: 3/4 of max_tokens
    ("chat", {"reasoning_effort": "low", "thinking_token_budget": 20}, 300, 20),  # the explicit budget wins
    ("chat", {"reasoning_effort": "low"}, 1600, 1024),
    ("responses", {"thinking_token_budget": 16}, 300, 16),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 10}}, 300, 10),
], ids=["server", "thinking_token_budget", "unlimited", "explicit-wins", "effort-low", "responses", "anthropic"])
def test_every_budget_field_bounds_the_reasoning(served: tuple[str, Server], dialect: str, fields: dict,
                                                 max_tokens: int, budget: int) -> None:
    family, server = served
    body = body_for(dialect, "ANSWER me.", max_tokens, False, tools=False, forced=False) | fields
    reply = send(server, dialect, body)
    check_budget(family, reply, budget)
    assert reply.text == "It is sunny." and reply.finish in ("stop", "completed", "end_turn")


def test_reasoning_effort_none_turns_reasoning_off(served: tuple[str, Server]) -> None:
    """Qwen3.5 renders thinking off; gpt-oss, which cannot, has its analysis closed as it opens."""
    family, server = served
    reply = send(server, "chat", body_for("chat", "ANSWER me.", 40, False, tools=False, forced=False)
                 | {"reasoning_effort": "none"})
    assert not reply.reasoning
    if family == "qwen35":  # no think block to close, so the script reasons on as answer text
        assert reply.reasoning_tokens == 0 and reply.text.startswith("hmm") and reply.finish == "length"
    else:
        assert reply.reasoning_tokens <= close_tokens(family) and reply.text == "It is sunny."


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_reasoning_format_none_leaves_the_reasoning_in_the_content(served: tuple[str, Server], stream: bool) -> None:
    family, server = served
    body = body_for("chat", "ANSWER me.", 300, stream, tools=False, forced=False)
    reply = send(server, "chat", body | {"reasoning_format": "none", "thinking_token_budget": 8})
    opener, closer = ("<think>", "</think>") if family == "qwen35" else ("<|channel|>analysis<|message|>", "<|end|>")
    assert not reply.reasoning and reply.text.startswith(opener + "hmm") and reply.text.endswith(closer + "It is sunny.")


def test_reasoning_format_must_be_one_llama_server_knows(served: tuple[str, Server]) -> None:
    _, server = served
    body = body_for("chat", "ANSWER me.", 8, False, tools=False, forced=False) | {"reasoning_format": "deepseek-legacy"}
    r = httpx.post(server.base_url + PATHS["chat"], json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_format", r.text


@pytest.mark.parametrize(("dialect", "fields", "calls"), [
    ("chat", {}, 2),
    ("chat", {"parallel_tool_calls": True}, 2),
    ("chat", {"parallel_tool_calls": False}, 1),
    ("responses", {"parallel_tool_calls": False}, 1),
    ("messages", {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}, 1),
], ids=["chat-default", "chat-parallel", "chat-one", "responses-one", "messages-one"])
def test_parallel_tool_calls_false_gives_at_most_one_call(served: tuple[str, Server], dialect: str, fields: dict,
                                                          calls: int) -> None:
    family, server = served
    if family != "qwen35":
        pytest.skip("harmony ends the turn at its first call")
    reply = send(server, dialect, body_for(dialect, "TWICE please", 300, False, tools=True, forced=False) | fields)
    assert [json.loads(a)["city"] for _, a in reply.calls] == ["Paris", "Rome"][:calls]
    assert reply.finish == FINISHED_BY_CALL[dialect]


def test_responses_echo_the_parallel_tool_calls_they_honoured(served: tuple[str, Server]) -> None:
    _, server = served
    body = body_for("responses", "TWICE please", 300, False, tools=True, forced=False) | {"parallel_tool_calls": False}
    r = httpx.post(server.base_url + PATHS["responses"], json=body, timeout=300)
    assert r.status_code == 200 and r.json()["parallel_tool_calls"] is False, r.text
