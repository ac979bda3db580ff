"""vLLM / llama.cpp request extensions: `chat_template_kwargs` reaches the chat template (Chat
Completions and Responses), `guided_grammar` constrains like `grammar`, `guided_choice` and
`response_format` of type `regex` / `grammar` constrain chat replies, and /v1/completions reads
the same grammar fields as chat into an OutputFormat that ReplyPlanner.plan_completion compiles."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from lmserve.chat.planner import ReplyPlanner
from lmserve.chat.prompt import PromptBuilder
from lmserve.chat.reply import ReplyDecoder
from lmserve.core.errors import RequestError
from lmserve.core.events import TextDelta
from lmserve.core.types import OutputFormat
from lmserve.http.openai_chat import parse_chat
from lmserve.http.openai_completions import parse_completion
from lmserve.http.openai_responses import parse_responses
from lmserve.http.response_store import ResponseStore
from lmserve.model.chat_template import ChatTemplate
from lmserve.model.gguf_file import GGUFFile
from lmserve.model.tokenizer import Tokenizer
from tests.fixture_models import QWEN3_TEMPLATE, write_model
from tests.server_util import Server, start_server

EMPTY_THINK = "<think>\n\n</think>\n\n"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("q3") / "tiny-qwen3.gguf", "qwen3")


@pytest.fixture(scope="module")
def qwen3(qwen3_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(qwen3_path))


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(QWEN3_TEMPLATE.read_text())


@pytest.fixture(scope="module")
def planner(qwen3: Tokenizer, template: ChatTemplate) -> ReplyPlanner:
    return ReplyPlanner(qwen3, template)


def rejects(call, param: str) -> RequestError:
    with pytest.raises(RequestError) as info:
        call()
    assert info.value.status == 400 and info.value.param == param, (info.value.param, info.value.message)
    return info.value


# -- chat_template_kwargs ----------------------------------------------------------------------------

def chat_prompt(builder: PromptBuilder, **extra) -> str:
    request, _ = parse_chat({"messages": USER, **extra}, 1000)
    return builder.render(request)


def responses_prompt(builder: PromptBuilder, **extra) -> str:
    return builder.render(parse_responses({"input": "hi", **extra}, 1000, ResponseStore()).chat)


@pytest.mark.parametrize("prompt", [chat_prompt, responses_prompt], ids=["chat", "responses"])
def test_template_kwargs_change_the_rendered_prompt(qwen3: Tokenizer, template: ChatTemplate, prompt) -> None:
    builder = PromptBuilder(qwen3, template)
    effort = {"reasoning_effort": "high"} if prompt is chat_prompt else {"reasoning": {"effort": "high"}}
    thinking = prompt(builder, **effort)
    assert not thinking.endswith(EMPTY_THINK)
    off = prompt(builder, **effort, chat_template_kwargs={"enable_thinking": False})  # explicit wins
    assert off.endswith(EMPTY_THINK) and off == thinking + EMPTY_THINK
    assert len(builder.encode(off)) > len(builder.encode(thinking))
    assert prompt(builder) == thinking  # a request that says nothing gets the template's default: on
    assert prompt(builder, chat_template_kwargs={"enable_thinking": True}) == thinking


@pytest.mark.parametrize("value,param", [([1], "chat_template_kwargs"), ("x", "chat_template_kwargs"),
                                         ({"messages": []}, "chat_template_kwargs.messages"),
                                         ({"add_generation_prompt": False},
                                          "chat_template_kwargs.add_generation_prompt")])
def test_template_kwargs_must_be_an_object_of_template_variables(value, param: str) -> None:
    rejects(lambda: parse_chat({"messages": USER, "chat_template_kwargs": value}, 1000), param)
    rejects(lambda: parse_responses({"input": "hi", "chat_template_kwargs": value}, 1000, ResponseStore()), param)


@pytest.fixture(scope="module")
def qwen3_server(qwen3_path: Path) -> Iterator[Server]:
    with start_server(str(qwen3_path), "--engine", "cpu", "--ctx", "512") as server:
        yield server


def test_template_kwargs_end_to_end(qwen3_server: Server) -> None:
    def prompt_tokens(path: str, body: dict) -> int:
        r = httpx.post(qwen3_server.base_url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        return usage.get("prompt_tokens", usage.get("input_tokens"))

    chat = {"messages": USER, "max_tokens": 1, "reasoning_effort": "high"}
    responses = {"input": "hi", "max_output_tokens": 1, "reasoning": {"effort": "high"}}
    for path, body in (("/v1/chat/completions", chat), ("/v1/responses", responses)):
        plain = prompt_tokens(path, body)
        off = prompt_tokens(path, {**body, "chat_template_kwargs": {"enable_thinking": False}})
        assert off > plain, (path, plain, off)
    r = httpx.post(qwen3_server.base_url + "/v1/chat/completions",
                   json={**chat, "chat_template_kwargs": "enable_thinking=false"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


# -- guided_grammar -----------------------------------------------------------------------------------

def test_guided_grammar_is_gbnf_like_grammar() -> None:
    request, _ = parse_chat({"messages": USER, "guided_grammar": 'root ::= "yes"'}, 1000)
    assert request.output_format == OutputFormat("gbnf", 'root ::= "yes"', "guided_grammar")
    rejects(lambda: parse_chat({"messages": USER, "guided_grammar": 3}, 1000), "guided_grammar")
    error = rejects(lambda: parse_chat({"messages": USER, "grammar": "root ::= \"a\"", "guided_grammar": "x"}, 1000),
                    "guided_grammar")
    assert "only one constraint" in error.message


def test_guided_grammar_constrains_smollm2(smollm2_server: Server) -> None:
    url = smollm2_server.base_url + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
            "max_tokens": 8}
    r = httpx.post(url, json={**body, "guided_grammar": 'root ::= "yes" | "no"'}, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] in ("yes", "no") and choice["finish_reason"] == "stop", choice
    r = httpx.post(url, json={**body, "guided_grammar": "root ::= ("}, timeout=300)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_grammar", r.text


CHAT_FORMATS = [
    ({"guided_choice": ["yes", "no"]}, OutputFormat("choice", ["yes", "no"], "guided_choice")),
    ({"response_format": {"type": "regex", "regex": "[0-9]+"}}, OutputFormat("regex", "[0-9]+", "response_format.regex")),
    ({"response_format": {"type": "grammar", "grammar": 'root ::= "a"'}},
     OutputFormat("gbnf", 'root ::= "a"', "response_format.grammar")),
]


@pytest.mark.parametrize("extra,expected", CHAT_FORMATS, ids=["guided_choice", "regex", "grammar"])
def test_chat_reads_choice_regex_and_grammar_formats(extra: dict, expected: OutputFormat) -> None:
    request, _ = parse_chat({"messages": USER, **extra}, 1000)
    assert request.output_format == expected


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "regex"}}, "response_format.regex"),
    ({"response_format": {"type": "grammar", "grammar": ""}}, "response_format.grammar"),
    ({"response_format": {"type": "regex", "regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice[1]"),
    ({"guided_choice": ["a"], "regex": "a"}, "guided_choice"),
])
def test_chat_format_fields_that_cannot_be_honoured_are_400s(extra: dict, param: str) -> None:
    rejects(lambda: parse_chat({"messages": USER, **extra}, 1000), param)


@pytest.mark.parametrize("extra,check", [
    ({"guided_choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ({"response_format": {"type": "regex", "regex": "[0-9]{3}-[a-z]{2}"}},
     lambda text: len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()),
    ({"response_format": {"type": "grammar", "grammar": 'root ::= "up" | "down"'}}, lambda text: text in ("up", "down")),
], ids=["guided_choice", "regex", "grammar"])
def test_chat_honours_choice_regex_and_grammar_end_to_end(smollm2_server: Server, extra: dict, check) -> None:
    body = {"messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 16, "temperature": 1.0, "seed": 3}
    r = httpx.post(smollm2_server.base_url + "/v1/chat/completions", json={**body, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert check(choice["message"]["content"]), choice
    assert choice["finish_reason"] == "stop"


# -- /v1/completions grammar fields -----------------------------------------------------------------

COMPLETION_FORMATS = [
    ({"response_format": {"type": "json_object"}}, OutputFormat("json_object", None, "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     OutputFormat("json_schema", {"type": "object"}, "response_format.json_schema.schema")),
    ({"response_format": {"type": "text"}}, None),
    ({"regex": "a+"}, OutputFormat("regex", "a+", "regex")),
    ({"lark": 'start: "a"'}, OutputFormat("lark", 'start: "a"', "lark")),
    ({"grammar": 'root ::= "a"'}, OutputFormat("gbnf", 'root ::= "a"', "grammar")),
    ({"guided_grammar": 'root ::= "a"'}, OutputFormat("gbnf", 'root ::= "a"', "guided_grammar")),
    ({"json_schema": {"type": "string"}}, OutputFormat("json_schema", {"type": "string"}, "json_schema")),
    ({"guided_json": '{"type": "integer"}'}, OutputFormat("json_schema", {"type": "integer"}, "guided_json")),
    ({"guided_regex": "[0-9]"}, OutputFormat("regex", "[0-9]", "guided_regex")),
    ({}, None),
]


@pytest.mark.parametrize("extra,expected", COMPLETION_FORMATS, ids=[str(list(e)) for e, _ in COMPLETION_FORMATS])
def test_completions_read_the_grammar_fields(qwen3: Tokenizer, extra: dict, expected: OutputFormat | None) -> None:
    assert parse_completion({"prompt": "hi", **extra}, qwen3).output_format == expected


@pytest.mark.parametrize("extra,param", [
    ({"regex": "a", "lark": "start: \"a\""}, "lark"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"grammar": 5}, "grammar"),
])
def test_completions_grammar_fields_fail_as_on_chat(qwen3: Tokenizer, extra: dict, param: str) -> None:
    chat = rejects(lambda: parse_chat({"messages": USER, **extra}, qwen3.vocab_size), param)
    completion = rejects(lambda: parse_completion({"prompt": "hi", **extra}, qwen3), param)
    assert completion.message == chat.message


def drive(decoder: ReplyDecoder, tokenizer: Tokenizer, text: str) -> list:
    rng = np.random.default_rng(0)
    events = []
    for token in tokenizer.encode(text, add_special=False, parse_special=True):
        masked = decoder.mask(rng.standard_normal(tokenizer.vocab_size).astype(np.float32))
        assert np.isfinite(masked[token]), f"{tokenizer.piece(token)!r} was masked out"
        events += decoder.push(token)
    return events


def test_plan_completion_grammar_constrains_the_reply(planner: ReplyPlanner, qwen3: Tokenizer) -> None:
    call = parse_completion({"prompt": "Answer:", "guided_regex": "(yes|no)!"}, qwen3)
    plan = planner.plan_completion(call.output_format)
    assert plan.grammar is not None and not plan.think and plan.calls is None and plan.call_grammar is None
    decoder = ReplyDecoder(plan, qwen3.token_bytes, call.stop, 20)
    assert decoder.needs_logits
    allowed = np.flatnonzero(np.isfinite(decoder.mask(np.zeros(qwen3.vocab_size, dtype=np.float32))))
    assert {qwen3.piece(i) for i in allowed} <= {"y", "n", "ye", "yes", "no"} and len(allowed) > 0
    events = drive(decoder, qwen3, "yes!")
    assert decoder.done
    assert "".join(e.text for e in events + decoder.finish() if isinstance(e, TextDelta)) == "yes!"


def test_plan_completion_json_and_no_format(planner: ReplyPlanner, qwen3: Tokenizer) -> None:
    plan = planner.plan_completion(OutputFormat("json_object", None, "response_format"))
    decoder = ReplyDecoder(plan, qwen3.token_bytes, [], 20)
    allowed = np.flatnonzero(np.isfinite(decoder.mask(np.zeros(qwen3.vocab_size, dtype=np.float32))))
    assert [qwen3.piece(i) for i in allowed] == ["{"]
    plain = planner.plan_completion(None)  # a raw prompt: no think routing even on a thinking model
    assert planner.think and plain.grammar is None and not plain.think and not plain.close_think
    decoder = ReplyDecoder(plain, qwen3.token_bytes, [], 20)
    events = drive(decoder, qwen3, "<think>x</think>y") + decoder.finish()
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "<think>x</think>y"


@pytest.mark.parametrize("fmt", [OutputFormat("regex", "[a-", "regex"), OutputFormat("lark", "start: nope", "lark"),
                                 OutputFormat("gbnf", "root ::= (", "guided_grammar"),
                                 OutputFormat("json_schema", {"type": "nope"}, "response_format.json_schema.schema")])
def test_plan_completion_compile_errors_are_400s(planner: ReplyPlanner, fmt: OutputFormat) -> None:
    error = rejects(lambda: planner.plan_completion(fmt), fmt.param)
    assert error.message.startswith(f"{fmt.param}: ")


@pytest.mark.parametrize("extra, check", [
    ({"regex": "(yes|no)"}, lambda text: text in ("yes", "no")),
    ({"grammar": 'root ::= "red" | "green" | "blue"'}, lambda text: text in ("red", "green", "blue")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
        "additionalProperties": False}}}}, lambda text: isinstance(json.loads(text)["n"], int)),
])
@pytest.mark.parametrize("stream", [False, True])
def test_completions_honour_grammars_end_to_end(smollm2_server: Server, extra: dict, check, stream: bool) -> None:
    body = {"prompt": "Answer: ", "max_tokens": 24, "temperature": 1.0, "seed": 7, "stream": stream, **extra}
    if stream:
        with httpx.stream("POST", smollm2_server.base_url + "/v1/completions", json=body, timeout=120) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    else:
        r = httpx.post(smollm2_server.base_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        text, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    assert check(text), text
    assert finish == "stop"  # the grammar completed: the turn ended there, not at max_tokens


def test_completions_grammar_that_does_not_compile_is_a_400(smollm2_server: Server) -> None:
    r = httpx.post(smollm2_server.base_url + "/v1/completions", timeout=60,
                   json={"prompt": "x", "max_tokens": 4, "grammar": "root ::= ("})
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"
