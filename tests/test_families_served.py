"""Every family served end to end, and the two engines agreeing on it.

The tiny fixtures have random weights, so their words are noise; what is checked is what a user
of such a model would notice: the file loads and answers on both routes, the prompt it is given
is exactly what Hugging Face's `apply_chat_template` renders with the family's own template, stop
strings end the reply where they appear, and the NumPy and MLX engines continue a prompt alike.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator

import httpx
import jsonschema
import numpy as np
import pytest

from lmserve.chat.prompt import PromptBuilder, fold_system
from lmserve.core.types import ChatRequest, Message
from lmserve.model.loader import load_model
from tests.families import FAMILIES, Fixture, references
from tests.server_util import Server, start_server
from tests.wire_check import check_stream

CONVERSATION = [Message("system", "You are terse."), Message("user", "Name a colour."),
                Message("assistant", "Blue."), Message("user", "Another one?")]


def transformers_render(fixture: Fixture, messages: list[Message]) -> str:
    """The prompt Hugging Face renders from the file's own template and special tokens."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers.utils.chat_template_utils import render_jinja_template
    model = load_model(fixture.path)
    if not model.template.supports_system:  # Hugging Face would raise; lmserve folds it (tested below)
        messages = fold_system(messages)
    rendered, _ = render_jinja_template([[m.to_template() for m in messages]], add_generation_prompt=True,
                                        chat_template=model.template.source, **model.template.special_tokens)
    return rendered[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_prompt_is_what_transformers_renders(family: str) -> None:
    fixture = Fixture(family, "F16")
    model = load_model(fixture.path)
    ours = PromptBuilder(model.tokenizer, model.template).render(ChatRequest(CONVERSATION))
    assert ours == transformers_render(fixture, CONVERSATION)


def test_a_system_turn_is_folded_into_the_first_user_turn_for_a_template_without_one() -> None:
    model = load_model(Fixture("gemma3", "F16").path)
    assert not model.template.supports_system
    prompt = PromptBuilder(model.tokenizer, model.template).render(ChatRequest(CONVERSATION))
    assert "<start_of_turn>user\nYou are terse.\n\nName a colour.<end_of_turn>" in prompt
    assert load_model(Fixture("qwen2", "F16").path).template.supports_system


# Served end to end on both engines: every family but gemma4-dense, which differs from gemma4 only
# by lacking the MoE block (its engines are tested on it, and its prompt below; a server pair less).
SERVED = [f for f in FAMILIES if f != "gemma4-dense"]


@pytest.fixture(scope="module", params=[(f, e) for f in SERVED for e in ("cpu", "mlx")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def served(request: pytest.FixtureRequest) -> Iterator[tuple[Fixture, Server]]:
    family, engine = request.param
    fixture = Fixture(family, "Q8_0")
    with start_server(str(fixture.path), "--engine", engine, "--ctx", "4096") as server:  # room for tools
        yield fixture, server


def completion(server: Server, **body) -> dict:
    r = httpx.post(server.base_url + "/v1/completions", json={"temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_token_id_prompts_answer_and_stop_strings_cut_the_reply(served) -> None:
    fixture, server = served
    ids = references(fixture.family)["token_ids"][:24]
    first = completion(server, prompt=ids, max_tokens=12)
    assert first["usage"]["prompt_tokens"] == len(ids)
    text = first["choices"][0]["text"]
    assert first["choices"][0]["finish_reason"] in ("stop", "length") and first["usage"]["completion_tokens"] <= 12
    if len(text) < 4:
        pytest.skip(f"the greedy reply {text!r} is too short to cut")
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = completion(server, prompt=ids, max_tokens=12, stop=[stop])["choices"][0]
    assert cut["text"] == text[:text.index(stop)] and cut["finish_reason"] == "stop"


def test_chat_answers_through_the_family_template(served) -> None:
    fixture, server = served
    messages = [m.to_template() for m in CONVERSATION]
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120,
                   json={"messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    model = load_model(fixture.path)
    expected = model.tokenizer.encode(transformers_render(fixture, CONVERSATION), add_special=False,
                                      parse_special=True)
    assert body["usage"]["prompt_tokens"] == len(expected)
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    info = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["meta"]
    assert info["architecture"] == model.config.architecture and info["parameters"] == model.config.n_params


# Bounded, as real tool schemas are: under an unbounded integer a random-weight model writes digits
# until max_tokens (measured: 3 of 12 seeds on qwen2), and a cut-off call is text, not a call.
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14}}}
# OpenAI's `strict` asks for arguments held to the schema (docs/API.md); Anthropic's always are.
FORCED = {  # route and body
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                                      "tools": [{"type": "function", "function": {
                                          "name": "get_weather", "parameters": WEATHER, "strict": True}}],
                                      "tool_choice": "required", "max_tokens": 1500}),
    "responses": ("/v1/responses", {"input": "Weather in Paris?", "tool_choice": "required",
                                    "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER,
                                               "strict": True}],
                                    "max_output_tokens": 1500}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                                  "tools": [{"name": "get_weather", "input_schema": WEATHER}],
                                  "tool_choice": {"type": "any"}, "max_tokens": 1500}),
}


def calls_of(dialect: str, body: dict) -> list[tuple[str, dict]]:
    if dialect == "chat":
        message = body["choices"][0]["message"]
        return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    if dialect == "responses":
        return [(i["name"], json.loads(i["arguments"])) for i in body["output"] if i["type"] == "function_call"]
    return [(b["name"], b["input"]) for b in body["content"] if b["type"] == "tool_use"]


def streamed_body(dialect: str, server: Server, path: str, request: dict) -> dict:
    """The final reply object a stream adds up to, rebuilt by the project's own wire checker."""
    with httpx.stream("POST", server.base_url + path, json={**request, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    reply = check_stream(dialect, raw)
    return {"calls": [(name, json.loads(arguments)) for name, arguments in reply.calls]}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_forced_call_is_exactly_one_valid_call_in_every_dialect(served, stream: bool) -> None:
    """Random weights, but the family's own call grammar makes the forced call valid anyway. The
    reasoning a thinking family does first is bounded (test_reasoning_budget.py tests that path)."""
    _, server = served
    for dialect, (path, request) in FORCED.items():
        request = {**request, "temperature": 0.8, "seed": 3}
        if dialect != "messages":  # Anthropic's API thinks only when asked
            request["thinking_token_budget"] = 32
        if stream:
            calls = streamed_body(dialect, server, path, request)["calls"]
        else:
            r = httpx.post(server.base_url + path, json=request, timeout=300)
            assert r.status_code == 200, r.text
            calls = calls_of(dialect, r.json())
        assert len(calls) == 1, (dialect, calls)
        name, arguments = calls[0]
        assert name == "get_weather"
        jsonschema.validate(arguments, WEATHER)


@pytest.mark.parametrize("family", FAMILIES)
def test_both_engines_continue_a_prompt_alike(family: str) -> None:
    """Greedy continuations of the same prompt on the F16 file: identical ids on both engines."""
    from lmserve.engine.select import load_engine

    fixture = Fixture(family, "F16")
    model = load_model(fixture.path)
    prompt = references(family)["token_ids"][:32]
    continuations = []
    for name in ("cpu", "mlx"):
        engine = load_engine(name, model.gguf, model.config, None)
        cache = engine.new_cache(128)
        token = int(np.argmax(engine.prefill(cache, prompt)))
        ids = [token]
        for _ in range(15):
            token = int(np.argmax(engine.decode([cache], [token])[0]))
            ids.append(token)
        continuations.append(ids)
    assert continuations[0] == continuations[1]


def test_both_engines_apply_phi_longrope_alike() -> None:
    """Phi-3.5 / Phi-4-mini files carry LongRoPE factors as tensors; the fixture has none, so a
    stand-in (the first values of a norm weight) is attached and both engines must agree on it."""
    import dataclasses

    from lmserve.engine_cpu import CPUEngine
    from lmserve.engine_mlx import MLXEngine
    from lmserve.model.config import ModelConfig
    from lmserve.model.gguf_file import GGUFFile
    from tests.families import cosine

    gguf = GGUFFile(Fixture("phi3", "F16").path)
    norm = gguf.tensors["blk.0.attn_norm.weight"]
    for i, name in enumerate(("rope_factors_long.weight", "rope_factors_short.weight")):
        gguf.tensors[name] = dataclasses.replace(norm, name=name, shape=(32,), offset=norm.offset + 128 * i,
                                                 nbytes=128)
    gguf.metadata["phi3.rope.scaling.original_context_length"] = 64
    config = ModelConfig.from_gguf(gguf)
    prompt = references("phi3")["token_ids"][:48]
    plain = CPUEngine(GGUFFile(Fixture("phi3", "F16").path), config)
    logits = [e.prefill(e.new_cache(64), prompt, all_logits=True) for e in (CPUEngine(gguf, config),
                                                                             MLXEngine(gguf, config))]
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).mean() >= 0.98
    assert cosine(logits[0][-1], logits[1][-1]) > 0.9999
    assert cosine(logits[0][-1], plain.prefill(plain.new_cache(64), prompt)) < 0.9999  # the factors count
