"""Structured output on SmolLM2 through every dialect: JSON schemas, regex, Lark and GBNF replies
match; invalid grammars are a 400 carrying llguidance's message before any stream starts."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

NAME = {"type": "string", "maxLength": 16}
SCHEMAS = {
    "nested objects": {"type": "object", "additionalProperties": False, "required": ["person"], "properties": {
        "person": {"type": "object", "additionalProperties": False, "required": ["name", "city"],
                   "properties": {"name": NAME, "city": NAME}}}},
    "arrays": {"type": "object", "additionalProperties": False, "required": ["colors"], "properties": {
        "colors": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 4}}},
    "enums": {"type": "object", "additionalProperties": False, "required": ["sentiment", "confidence"],
              "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                             "confidence": {"type": "string", "enum": ["low", "high"]}}},
    "bounded integers": {"type": "object", "additionalProperties": False, "required": ["year", "delta"],
                         "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                        "delta": {"type": "integer", "minimum": -5, "maximum": 5}}},
    "optional fields": {"type": "object", "additionalProperties": False, "required": ["title"], "properties": {
        "title": NAME, "subtitle": NAME, "pages": {"type": "integer", "minimum": 1, "maximum": 999}}},
}
PROMPTS = {
    "nested objects": "Describe a person and the city they live in as JSON.",
    "arrays": "List some colors of the rainbow as JSON.",
    "enums": "Classify the sentiment of 'I love this!' as JSON.",
    "bounded integers": "When did the first person walk on the moon? Answer as JSON.",
    "optional fields": "Describe a book as JSON.",
}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=300)


def chat(server, body: dict) -> dict:
    r = post(server, "/v1/chat/completions", {"temperature": 0, "max_tokens": 80, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_json_schema_replies_validate(smollm2_server) -> None:
    def ask(name: str) -> dict:
        fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMAS[name], "strict": True}}
        return chat(smollm2_server, {"messages": user(PROMPTS[name]), "response_format": fmt})

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # one batch: the server decodes them together
        choices = dict(zip(SCHEMAS, pool.map(ask, SCHEMAS), strict=True))
    for name, choice in choices.items():
        assert choice["finish_reason"] == "stop", (name, choice)  # the grammar's end ended the turn
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[name])


def test_json_in_responses_and_anthropic_and_json_object(smollm2_server) -> None:
    schema = SCHEMAS["enums"]
    bodies = [
        ("/v1/responses", {"input": PROMPTS["enums"], "temperature": 0, "max_output_tokens": 40,
                           "text": {"format": {"type": "json_schema", "name": "r", "schema": schema}}}),
        ("/v1/messages", {"messages": user(PROMPTS["enums"]), "temperature": 0, "max_tokens": 40,
                          "output_config": {"format": {"type": "json_schema", "schema": schema}}}),
        ("/v1/chat/completions", {"messages": user('Return {"capital": ...} for France as JSON.'), "temperature": 0,
                                  "max_tokens": 60, "response_format": {"type": "json_object"}}),
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda pb: post(smollm2_server, *pb), bodies))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    responses, messages, chat_reply = (r.json() for r in replies)
    assert responses["status"] == "completed"
    assert responses["text"]["format"]["type"] == "json_schema"
    jsonschema.validate(json.loads(responses["output"][0]["content"][0]["text"]), schema)
    assert messages["stop_reason"] == "end_turn"
    jsonschema.validate(json.loads(messages["content"][0]["text"]), schema)
    assert json.loads(chat_reply["choices"][0]["message"]["content"]) == {"capital": "Paris"}


GRAMMARS = [
    ({"regex": r"(Yes|No), because [a-z ]{3,30}\."}, r"(Yes|No), because [a-z ]{3,30}\."),
    ({"lark": 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,4}/'}, r"The answer is [0-9]{1,4}\."),
    ({"grammar": 'root ::= "Paris" | "London" | "Rome"'}, r"Paris|London|Rome"),
    ({"guided_regex": r"[A-Z][a-z]{2,9}"}, r"[A-Z][a-z]{2,9}"),
]


def test_regex_lark_and_gbnf_replies_match(smollm2_server) -> None:
    def ask(case: tuple[dict, str]) -> str:
        body = {"messages": user("Is the sky blue? What is 2+2? What is the capital of France?"), **case[0]}
        return chat(smollm2_server, body)["message"]["content"]

    with ThreadPoolExecutor(len(GRAMMARS)) as pool:
        replies = list(pool.map(ask, GRAMMARS))
    for (_, pattern), reply in zip(GRAMMARS, replies, strict=True):
        assert re.fullmatch(pattern, reply), (pattern, reply)


def test_stream_matches_the_grammar(smollm2_server) -> None:
    body = {"messages": user("What is the capital of France?"), "temperature": 0, "max_tokens": 20, "stream": True,
            "grammar": 'root ::= "Paris" | "London"'}
    with httpx.stream("POST", smollm2_server.base_url + "/v1/chat/completions", json=body, timeout=300) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) in ("Paris", "London")
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# -- errors, before any token ------------------------------------------------------------------------------

BAD = [
    ("/v1/chat/completions", {"regex": "[a-"}, "regex", "unclosed character class"),
    ("/v1/chat/completions", {"lark": "start: missing_rule"}, "lark", "unknown name"),
    ("/v1/chat/completions", {"grammar": "root ::= ("}, "grammar", ""),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "propertyNames": {"pattern": "^a"}}}}},
     "response_format.json_schema.schema", "propertyNames"),
    ("/v1/chat/completions", {"regex": "a", "lark": "start: \"a\""}, "lark", "only one constraint"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x",
                                           "schema": {"type": "string", "format": "weird"}}}},
     "text.format.schema", "weird"),
    ("/v1/messages", {"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
     "output_config.format.schema", ""),
]


@pytest.mark.parametrize("path,extra,param,needle", BAD, ids=[b[2] + ":" + b[0] for b in BAD])
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_grammar_is_a_400_before_the_stream(smollm2_server, path, extra, param, needle, stream) -> None:
    body = {"stream": stream, "max_tokens": 5, **extra}
    body.update({"input": "hi"} if path == "/v1/responses" else {"messages": user("hi")})
    r = post(smollm2_server, path, body)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["message"].startswith(param)
    if path == "/v1/messages":
        assert r.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert error["param"] == param
