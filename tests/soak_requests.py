"""The request mix a soak client draws from: one body builder per dialect (the three chat
dialects and legacy /v1/completions), the behaviours (plain, tools, grammar, long prompts at the
context limit, over-long prompts, bad requests, streams cut or stalled by the client, non-streaming
requests the client hangs up on) and what a correct reply to each looks like beyond being well
formed.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from tests.wire_check import Reply

DIALECTS = ("chat", "responses", "messages", "completions")
PROMPTS = ["Say hello.", "Name three colors.", "What is 2+2?", "Write a haiku about rain.",
           "Describe a cat in one sentence.", "List two fruits.", "What is the capital of France?"]
STORIES = ["a lighthouse keeper", "a dragon who learns to cook", "a train that runs at night", "a lost map"]
FILLER = "The quick brown fox jumps over the lazy dog near the river bank. "
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                  "additionalProperties": False}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 24}},
                 "required": ["answer"], "additionalProperties": False}
TOOLS = {
    "chat": [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                               "parameters": WEATHER_SCHEMA, "strict": True}}],
    "responses": [{"type": "function", "name": "get_weather", "description": "Weather for a city.",
                   "parameters": WEATHER_SCHEMA, "strict": True}],
    "messages": [{"name": "get_weather", "description": "Weather for a city.", "input_schema": WEATHER_SCHEMA}],
}
FORCED = {"chat": "required", "responses": "required", "messages": {"type": "any"}}
ANSWER_REGEX = r"(Yes|No|Maybe)\. [A-Z][a-z]{2,12}( [a-z]{2,12}){0,3}\."  # bounded: it ends by itself
GRAMMAR = {
    "chat": {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}},
    "completions": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}},
    "responses": {"text": {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA}}},
    "messages": {"output_config": {"format": {"type": "json_schema", "schema": ANSWER_SCHEMA}}},
}
BAD = {
    "chat": [{"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
             {"messages": [{"role": "user", "content": "x"}], "temperature": 9}, {"messages": "x", "n": 3}],
    "responses": [{"input": 5}, {"input": "x", "previous_response_id": "resp_gone"},
                  {"input": [{"type": "mystery"}]}, {"input": "x", "max_output_tokens": -1}],
    "messages": [{"messages": [{"role": "user", "content": "x"}]}, {"max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image"}]}]}, {"max_tokens": 5, "messages": [], "top_k": -2}],
    "completions": [{"max_tokens": 5}, {"prompt": "x", "n": 3}, {"prompt": "x", "echo": True},
                    {"prompt": [1, 2, 10**9]}, {"prompt": [[5, -1]]}, {"prompt": "x", "suffix": "y"},
                    {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "regex": "(unclosed"}],
}
# Weights of the behaviours; "disconnect" and "stalled" are streams the client cuts or stops reading,
# "hangup" a non-streaming request whose client gives up before the reply (Soak.execute).
KINDS = {"plain": 30, "tools": 10, "grammar": 10, "disconnect": 10, "stalled": 8, "hangup": 8, "bad": 8,
         "long": 6, "overflow": 4}
# /v1/completions has no tools; every other behaviour applies to every dialect.
DIALECT_KINDS = {d: tuple(k for k in KINDS if not (d == "completions" and k == "tools")) for d in DIALECTS}
STREAMED, UNSTREAMED = ("disconnect", "stalled"), ("hangup",)
FINISHED_BY_LENGTH = ("length", "incomplete", "max_tokens")
MESSAGE_KEY = {"chat": "messages", "responses": "input", "messages": "messages"}


@dataclass
class Planned:
    """One request: where it goes, what it sends, and what its reply must satisfy."""

    dialect: str
    kind: str
    body: dict[str, Any]
    max_tokens: int | None = None
    expect_status: int = 200


def body(dialect: str, text: str, max_tokens: int, stream: bool, temperature: float) -> dict[str, Any]:
    """A one-turn request in `dialect`'s shape."""
    if dialect == "responses":
        out: dict[str, Any] = {"input": text, "max_output_tokens": max_tokens, "store": False}
    elif dialect == "completions":  # a raw prompt: no chat template, so ask in a completable shape
        out = {"prompt": f"Question: {text}\nAnswer:", "max_tokens": max_tokens}
    else:
        out = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    out.update(stream=stream, temperature=temperature)
    if dialect in ("chat", "completions") and stream:
        out["stream_options"] = {"include_usage": True}
    return out


class Mix:
    """Draws requests; `filler_repeats` are the FILLER counts for a prompt just under the context
    and one well over it (measured by Soak._calibrate)."""

    def __init__(self, rng: random.Random, ctx: int, filler_repeats: tuple[int, int]) -> None:
        self.rng = rng
        self.ctx = ctx
        self.long_repeats, self.overflow_repeats = filler_repeats

    def draw(self, kind: str | None = None) -> Planned:
        rng = self.rng
        if kind is None:
            dialect = rng.choice(DIALECTS)
            kinds = DIALECT_KINDS[dialect]
            kind = rng.choices(kinds, weights=[KINDS[k] for k in kinds])[0]
        else:
            dialect = rng.choice([d for d in DIALECTS if kind in DIALECT_KINDS[d]])
        stream = kind in STREAMED or (kind not in UNSTREAMED and rng.random() < 0.6)
        temperature = rng.choice([0.0, 0.0, 0.7])
        if kind == "bad":
            return Planned(dialect, kind, {**rng.choice(BAD[dialect]), "stream": stream}, expect_status=400)
        if kind in ("long", "overflow"):
            repeats = self.long_repeats if kind == "long" else self.overflow_repeats
            # A long shared opening (an agent's system prompt, say) and a varying end.
            text = FILLER * repeats + f"Summarize item {rng.randrange(10**6)}."
            return Planned(dialect, kind, body(dialect, text, self.ctx, stream, temperature),
                           expect_status=200 if kind == "long" else 400)
        if kind == "hangup":  # long enough that the client's 0.2-3 s patience usually runs out first
            max_tokens = rng.randint(96, 160)
            subject = rng.choice(STORIES)
            out = body(dialect, f"Write a long story about {subject}.", max_tokens, stream, temperature)
            if dialect == "completions":  # a story already begun goes on; a question may get a line
                out["prompt"] = f"A long story about {subject}.\n\nOnce upon a time,"
            return Planned(dialect, kind, out, max_tokens)
        max_tokens = rng.randint(32, 48) if kind in ("tools", "grammar") else rng.randint(4, 24)
        out = body(dialect, rng.choice(PROMPTS), max_tokens, stream, temperature)
        if kind == "tools":
            out["tools"] = TOOLS[dialect]
            if rng.random() < 0.5:
                out["tool_choice"] = FORCED[dialect]
            out[MESSAGE_KEY[dialect]] = _as_input(dialect, "What is the weather in Paris? Use the tool.")
        elif kind == "grammar" and dialect == "completions" and rng.random() < 0.5:
            out["regex"] = ANSWER_REGEX
        elif kind == "grammar":
            out.update(GRAMMAR[dialect])
        return Planned(dialect, kind, out, max_tokens)


def _as_input(dialect: str, text: str) -> Any:
    return text if dialect == "responses" else [{"role": "user", "content": text}]


def check_semantics(plan: Planned, reply: Reply, ctx: int) -> None:
    """What a well-formed reply to this plan must also satisfy."""
    if plan.max_tokens is not None:
        assert reply.completion_tokens <= plan.max_tokens, (reply.completion_tokens, plan.max_tokens)
    assert reply.prompt_tokens + reply.completion_tokens <= ctx, (reply.prompt_tokens, reply.completion_tokens)
    if plan.kind == "long" and reply.finish in FINISHED_BY_LENGTH:
        assert reply.prompt_tokens + reply.completion_tokens == ctx, "a reply cut short of the context"
    if plan.kind == "tools":
        for name, arguments in reply.calls:
            assert name == "get_weather", name
            jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)
    if plan.kind == "grammar" and reply.finish not in FINISHED_BY_LENGTH:
        if "regex" in plan.body:
            assert re.fullmatch(ANSWER_REGEX, reply.text), f"reply outside the regex: {reply.text!r}"
        else:
            jsonschema.validate(json.loads(reply.text), ANSWER_SCHEMA)
