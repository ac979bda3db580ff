"""Tool calling on SmolLM2 in all three dialects: forced calls stream in each dialect's native events
and non-streaming shapes, arguments always validate against the tool's schema, and a full round
trip (call -> result -> answer) works through each official SDK."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.openai_spec import validate

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
    "city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["city"], "properties": {
    "city": {"type": "string", "maxLength": 24}}}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
DESCRIPTIONS = {"get_weather": "Current weather in a city", "get_time": "Current local time in a city"}
QUESTION = "What is the weather in Paris right now?"
RESULT = "Sunny, 24 degrees celsius."
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "description": DESCRIPTIONS[n], "parameters": s,
                                                 "strict": True}} for n, s in SCHEMAS.items()]
RESPONSES_TOOLS = [{"type": "function", "name": n, "description": DESCRIPTIONS[n], "parameters": s, "strict": True}
                   for n, s in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": n, "description": DESCRIPTIONS[n], "input_schema": s} for n, s in SCHEMAS.items()]
GREEDY = {"temperature": 0}


def check_call(name: str, arguments: str | dict) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])


def sse(server, path: str, body: dict) -> list[dict]:
    """The stream's events in order; Anthropic's keep-alive pings (written whenever the stream is
    silent a while, as on a busy machine) are allowed anywhere and left out."""
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return [e for e in events if e.get("type") != "ping"]


# -- streaming, raw: each dialect's native events ----------------------------------------------------------

def test_chat_stream_forced_named_call(smollm2_server) -> None:
    chunks = sse(smollm2_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 60, "tools": CHAT_TOOLS, **GREEDY,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["index"] == 0 and calls[0][0]["id"].startswith("call_")
    validate("ChatCompletionMessageToolCallChunk", calls[0][0])
    assert calls[0][0]["function"]["name"] == "get_time"
    check_call("get_time", calls[0][0]["function"]["arguments"])
    assert not "".join(d.get("content") or "" for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_responses_stream_forced_call(smollm2_server) -> None:
    events = sse(smollm2_server, "/v1/responses", {"input": QUESTION, "max_output_tokens": 60,
                                                    "tools": RESPONSES_TOOLS, "tool_choice": "required", **GREEDY})
    for event in events:
        validate("ResponseStreamEvent", event)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    item = events[5]["item"]
    assert item["type"] == "function_call" and item["status"] == "completed"
    assert events[2]["item"]["id"] == item["id"] and events[4]["arguments"] == item["arguments"]
    check_call(item["name"], item["arguments"])
    assert events[-1]["response"]["output"] == [item]


def test_anthropic_stream_forced_any_call(smollm2_server) -> None:
    events = sse(smollm2_server, "/v1/messages", {"messages": [{"role": "user", "content": QUESTION}],
                                                   "max_tokens": 60, "tools": ANTHROPIC_TOOLS,
                                                   "tool_choice": {"type": "any"}, **GREEDY})
    kinds = [e["type"] for e in events]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    block, delta = events[1]["content_block"], events[2]["delta"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_") and block["input"] == {}
    assert delta["type"] == "input_json_delta"
    check_call(block["name"], delta["partial_json"])
    assert events[4]["delta"]["stop_reason"] == "tool_use"


# -- round trips through the official SDKs ---------------------------------------------------------------


@pytest.fixture(scope="module")
def oai(smollm2_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.base_url + "/v1", api_key="local", max_retries=0)


@pytest.fixture(scope="module")
def claude(smollm2_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=smollm2_server.base_url, api_key="local", max_retries=0)


def test_chat_round_trip(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    first = oai.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=CHAT_TOOLS, tool_choice="required",
                                        max_tokens=60, temperature=0)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    check_call(call.function.name, call.function.arguments)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    answer = oai.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=CHAT_TOOLS, max_tokens=24,
                                         temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the call and its result went in


def test_responses_round_trip(oai: openai.OpenAI) -> None:
    first = oai.responses.create(model="gpt-4o-mini", input=QUESTION, tools=RESPONSES_TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=60, temperature=0)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    check_call(call.name, call.arguments)
    answer = oai.responses.create(model="gpt-4o-mini", previous_response_id=first.id, tools=RESPONSES_TOOLS,
                                  input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}],
                                  max_output_tokens=24, temperature=0)
    assert answer.output_text and all(item.type == "message" for item in answer.output)
    assert answer.usage.input_tokens > first.usage.input_tokens + 20


def test_anthropic_round_trip(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    with claude.messages.stream(model="claude-haiku-4-5", max_tokens=60, messages=messages, tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY) as stream:
        first = stream.get_final_message()
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and first.stop_reason == "tool_use"
    check_call(use.name, use.input)
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
    answer = claude.messages.create(model="claude-haiku-4-5", max_tokens=24, messages=messages, tools=ANTHROPIC_TOOLS,
                                    extra_body=GREEDY)
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")
    prompt = [m.usage.input_tokens + m.usage.cache_read_input_tokens for m in (first, answer)]
    assert prompt[1] > prompt[0] + 20


# -- tool_choice errors ---------------------------------------------------------------------------------------

ERRORS = [
    ("/v1/chat/completions", {"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    ("/v1/chat/completions", {"tool_choice": "required"}),
    ("/v1/chat/completions", {"tools": CHAT_TOOLS, "tool_choice": "sometimes"}),
    ("/v1/responses", {"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}),
    ("/v1/messages", {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}),
    ("/v1/messages", {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool"}}),
]


@pytest.mark.parametrize("path,extra", ERRORS)
def test_bad_tool_choice_is_a_400(smollm2_server, path: str, extra: dict) -> None:
    body = {"max_tokens": 5, **extra}
    body.update({"input": "hi"} if path == "/v1/responses" else {"messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(smollm2_server.base_url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("tool_choice")
