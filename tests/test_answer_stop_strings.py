"""Stop strings match the answer only: StopFilter on its own, and the reply decoder running it on
the router's answer text, so a stop string inside the think block or a tool call's body does not
end the reply (on the tiny Qwen3 fixture's tokenizer and template, and on scripted tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from lmserve.chat.planner import ReplyPlanner
from lmserve.chat.reply import ReplyDecoder, ReplyPlan
from lmserve.chat.token_stream import StopFilter
from lmserve.core.events import Event, ReasoningDelta, TextDelta, TokenLogprob, ToolCallEvent
from lmserve.core.types import ChatRequest, Message
from lmserve.model.tokenizer import Tokenizer
from tests.test_reply_routing import CALLS, WEATHER, drive

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "STOP"}}\n</tool_call>'


def lp(name: str) -> TokenLogprob:
    return TokenLogprob(name, -0.5, [])


def texts(events: list[Event], kind: type) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


# -- StopFilter ------------------------------------------------------------------------------------

def test_filter_holds_a_possible_stop_and_keeps_its_logprobs() -> None:
    stops = StopFilter(["<|end|>"])
    assert stops.feed(TextDelta("Hi <", [lp("a")])) == TextDelta("Hi ", [lp("a")])
    assert stops.feed(TextDelta("|", [lp("b")])) is None  # "<|" may still become the stop
    assert stops.feed(TextDelta("x", [lp("c")])) == TextDelta("<|x", [lp("b"), lp("c")])
    assert not stops.stopped
    assert stops.feed(TextDelta("<|en", [lp("d")])) is None
    assert stops.feed(TextDelta("d|> after", [lp("e")])) is None
    assert stops.stopped and stops.stop_sequence == "<|end|>"
    assert stops.feed(TextDelta("more")) is None and stops.flush() is None


def test_filter_flush_releases_a_held_prefix_and_earliest_stop_wins() -> None:
    stops = StopFilter(["END"])
    assert stops.feed(TextDelta("the EN")) == TextDelta("the ")
    assert stops.flush() == TextDelta("EN") and not stops.stopped
    stops = StopFilter(["ld", "o w"])
    assert stops.feed(TextDelta("Hello world")) == TextDelta("Hell")
    assert stops.stop_sequence == "o w"
    assert StopFilter().feed(TextDelta("no stops")) == TextDelta("no stops")


# -- the reply decoder: stop strings on answer text only ------------------------------------------

def run(pieces: list[str], plan: ReplyPlan, stop: list[str]) -> tuple[list[Event], ReplyDecoder]:
    """Token i spells pieces[i]; every token is pushed (the decoder drops what follows a stop)."""
    table = [p.encode() for p in pieces]
    decoder = ReplyDecoder(plan, table.__getitem__, stop, max_tokens=1000)
    events = [e for i in range(len(table)) for e in decoder.push(i, lp(str(i)))]
    return events + decoder.finish(), decoder


def test_stop_split_across_tokens_ends_the_answer() -> None:
    events, decoder = run(["The ans", "wer ST", "O", "P more", " and more"], ReplyPlan(think=True), ["STOP"])
    answer = [e for e in events if isinstance(e, TextDelta)]
    assert "".join(e.text for e in answer) == "The answer " and decoder.stop_sequence == "STOP"
    assert all("S" not in e.text for e in answer)  # the held "ST" never streamed
    assert [x.token for e in answer for x in e.logprobs] == ["0", "1"]


def test_stop_inside_the_think_block_is_reasoning() -> None:
    events, decoder = run(["<think>", "I will say ST", "OP here", "</think>", "The answer ", "STOP ignored"],
                          ReplyPlan(think=True), ["STOP"])
    assert texts(events, ReasoningDelta) == "I will say STOP here"
    assert texts(events, TextDelta) == "The answer " and decoder.stop_sequence == "STOP"
    answer = [e for e in events if isinstance(e, TextDelta)]
    assert [x.token for e in answer for x in e.logprobs] == ["4"]  # the stop's own token is not sent


def test_text_held_before_a_call_keeps_its_place_and_cannot_join_text_after_it() -> None:
    events, decoder = run(["Say ST", CALL, "OP now"], ReplyPlan(calls=CALLS), ["STOP"])
    kinds = [(type(e).__name__, getattr(e, "text", None)) for e in events]
    assert kinds == [("TextDelta", "Say "), ("TextDelta", "ST"), ("ToolCallEvent", None), ("TextDelta", "OP now")]
    assert decoder.stop_sequence is None and decoder.tool_calls == 1


def test_nothing_follows_a_stop() -> None:
    events, decoder = run(["a STOP ", CALL, "b"], ReplyPlan(calls=CALLS), ["STOP"])
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["a "]
    assert not any(isinstance(e, ToolCallEvent) for e in events) and decoder.tool_calls == 0


# -- on the real Qwen3 template, tokenizer and planner ---------------------------------------------

# `qwen3` and `planner` come from tests/conftest.py.
def push_text(decoder: ReplyDecoder, tokenizer: Tokenizer, text: str) -> list[Event]:
    return drive(decoder, tokenizer, text, np.random.default_rng(0))


def test_thinking_reply_on_the_qwen3_fixture(planner: ReplyPlanner, qwen3: Tokenizer) -> None:
    plan = planner.plan(ChatRequest([Message("user", "x")], reasoning=True), "")
    assert plan.think
    decoder = ReplyDecoder(plan, qwen3.token_bytes, ["STOP"], 200)
    events = push_text(decoder, qwen3, "<think>I will say STOP here</think>")
    assert not decoder.done  # (STOP is four byte tokens here: split across tokens)
    events += push_text(decoder, qwen3, "The answer STOP")
    assert decoder.done and decoder.stop_sequence == "STOP"
    events += push_text(decoder, qwen3, " ignored") + decoder.finish()
    assert "STOP" in texts(events, ReasoningDelta)
    assert texts(events, ReasoningDelta) == "I will say STOP here"
    assert texts(events, TextDelta) == "The answer "


def test_stop_inside_a_hermes_call_body_does_not_cut_the_call(planner: ReplyPlanner, qwen3: Tokenizer) -> None:
    plan = planner.plan(ChatRequest([Message("user", "x")], tools=[WEATHER]), "")
    decoder = ReplyDecoder(plan, qwen3.token_bytes, ["STOP"], 200)
    events = push_text(decoder, qwen3, "Checking. " + CALL)
    assert not decoder.done
    calls = [e for e in events if isinstance(e, ToolCallEvent)]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "STOP"}')]
    events += push_text(decoder, qwen3, "\nDone STOP")
    assert decoder.done and decoder.stop_sequence == "STOP"
    events += decoder.finish()
    assert texts(events, TextDelta) == "Checking. Done "
    assert decoder.tool_calls == 1
