"""Reasoning and tool-call routing on synthetic token streams, and the reply's constraints (call
grammar under tool_choice auto, the thinking budget) on the tiny Qwen3 fixture's tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lmserve.chat.grammar import ForcedTokens, GrammarConstraint
from lmserve.chat.planner import ReplyPlanner
from lmserve.chat.reply import ReplyDecoder, ReplyPlan
from lmserve.chat.reply_router import GEMMA4_THINK, CallRouting
from lmserve.chat.tool_format import HERMES, HERMES_END, HERMES_LEAD, HERMES_START, ToolFormat
from lmserve.core.events import Event, ReasoningDelta, TextDelta, TokenLogprob, ToolCallEvent
from lmserve.core.types import ChatRequest, Message, OutputFormat, Tool
from lmserve.model.tokenizer import Tokenizer

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

WEATHER = Tool("get_weather", "Weather for a city",
               {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, strict=True)
HERMES_FORMAT = ToolFormat(HERMES, HERMES_START, HERMES_END, lambda body, tools: json.loads(body),
                           lead=HERMES_LEAD)
CALLS = CallRouting(HERMES_FORMAT, [WEATHER.to_template()], frozenset({WEATHER.name}))


def run(pieces: list[str], plan: ReplyPlan) -> list[Event]:
    """Feed text pieces as tokens (token i spells pieces[i]) through a reply decoder."""
    table = [p.encode() for p in pieces]
    decoder = ReplyDecoder(plan, table.__getitem__, [], max_tokens=1000)
    events = [e for i in range(len(table)) for e in decoder.push(i)]
    return events + decoder.finish()


def texts(events: list[Event], kind: type) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


# -- think routing ---------------------------------------------------------------------------------

def test_leading_think_block_is_reasoning_with_split_markers() -> None:
    events = run(["\n<thi", "nk>\nweigh", " it</th", "ink>\n\nThe ans", "wer"], ReplyPlan(think=True))
    assert texts(events, ReasoningDelta) == "weigh it"
    assert texts(events, TextDelta) == "The answer"
    assert all("<" not in e.text for e in events if isinstance(e, TextDelta))


def test_stray_closer_of_an_empty_think_block_never_reaches_content() -> None:
    events = run(["</think>", "\n\n", "Hello"], ReplyPlan(think=True))
    assert texts(events, TextDelta) == "Hello" and not texts(events, ReasoningDelta)


def test_prompt_opened_think_block_and_unclosed_reasoning() -> None:
    events = run(["\nstep one", "</think>\n", "Done"], ReplyPlan(think=True, in_think=True))
    assert texts(events, ReasoningDelta) == "step one" and texts(events, TextDelta) == "Done"
    events = run(["<think>", "still going"], ReplyPlan(think=True))
    assert texts(events, ReasoningDelta) == "still going" and not texts(events, TextDelta)


def test_no_reasoning_channel_leaves_text_alone() -> None:
    events = run(["<think>x</think>", "y"], ReplyPlan())
    assert texts(events, TextDelta) == "<think>x</think>y"


def test_think_only_routes_at_the_start() -> None:
    events = run(["Sure. ", "<think>x</think>"], ReplyPlan(think=True))
    assert texts(events, TextDelta) == "Sure. <think>x</think>"


def test_gemma4_thought_channels_anywhere_with_split_markers() -> None:
    """Gemma 4's `<|channel>thought...<channel|>` is reasoning where the reply starts and later in it
    too (llama.cpp's rule for Gemma 4); a stray closer is dropped; no piece of a marker streams."""
    gemma = ReplyPlan(think=True, think_markers=GEMMA4_THINK)
    events = run(["<|chan", "nel>thou", "ght\nweigh", " it<chan", "nel|>The ans", "wer<|chan", "nel>thought\n",
                  "<channel|>"], gemma)
    assert texts(events, ReasoningDelta) == "weigh it" and texts(events, TextDelta) == "The answer"
    events = run(["Sure.<cha", "nnel|> Done.<|channel>", "thought\nmore"], gemma)
    assert texts(events, TextDelta) == "Sure. Done." and texts(events, ReasoningDelta) == "more"
    events = run(["<|channel> is a token"], gemma)  # only the thought channel is reasoning
    assert texts(events, TextDelta) == "<|channel> is a token"


# -- tool calls ----------------------------------------------------------------------------------------

def test_call_split_across_tokens_becomes_one_event() -> None:
    pieces = ["Let me check.", "\n<tool", "_call>\n{\"name\": \"get_weather\", \"argu",
              "ments\": {\"city\": \"Par", "is\"}}\n</tool", "_call>", "\n"]
    events = run(pieces, ReplyPlan(calls=CALLS))
    assert texts(events, TextDelta) == "Let me check.\n"
    calls = [e for e in events if isinstance(e, ToolCallEvent)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_two_calls_and_the_whitespace_between_them() -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    events = run([call % "A", "\n", call % "B"], ReplyPlan(calls=CALLS))
    assert [json.loads(e.arguments)["city"] for e in events if isinstance(e, ToolCallEvent)] == ["A", "B"]
    assert not texts(events, TextDelta)


@pytest.mark.parametrize("body", ["not json", '{"name": "rm_rf", "arguments": {}}', '{"name": "get_weather", '
                                  '"arguments": [1]}'])
def test_malformed_or_unknown_call_passes_through_as_text(body: str) -> None:
    whole = f"<tool_call>\n{body}\n</tool_call>"
    events = run([whole[:9], whole[9:]], ReplyPlan(calls=CALLS))
    assert texts(events, TextDelta) == whole and not any(isinstance(e, ToolCallEvent) for e in events)


def test_unclosed_call_and_false_marker_prefix_are_text() -> None:
    events = run(["a <tool_ca", "ll>\n{\"name\""], ReplyPlan(calls=CALLS))
    assert texts(events, TextDelta) == 'a <tool_call>\n{"name"'
    events = run(["a <to", "y"], ReplyPlan(calls=CALLS))
    assert [e.text for e in events] == ["a ", "<toy"]  # "<to" held back until it proved harmless


BARE = '{"name": "get_weather", "arguments": {"city": "%s"}}'  # a hermes call without its markers


def calls_of(events: list[Event]) -> list[tuple[str, dict]]:
    return [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCallEvent)]


def test_bare_hermes_call_where_the_answer_starts() -> None:
    """Streamed a character at a time (the lead held back until it shows) and in one piece."""
    reply = f"\n{BARE % 'Paris'}\n"
    for pieces in (list(reply), [reply]):
        events = run(pieces, ReplyPlan(calls=CALLS))
        assert calls_of(events) == [("get_weather", {"city": "Paris"})] and not texts(events, TextDelta)


def test_bare_and_marked_hermes_calls_in_a_row() -> None:
    marked = f"{HERMES_START}\n{BARE % 'B'}\n{HERMES_END}"
    reply = f"{BARE % 'A'}\n{marked}\n{BARE % 'C'}{BARE % 'D'}\nDone."
    for pieces in (list(reply), [reply]):
        events = run(pieces, ReplyPlan(calls=CALLS))
        assert [args["city"] for _, args in calls_of(events)] == ["A", "B", "C", "D"]
        assert texts(events, TextDelta) == "Done."


def test_bare_hermes_call_after_a_think_block() -> None:
    reply = f"<think>\nweather, so a call\n</think>\n\n{BARE % 'Oslo'}"
    events = run(list(reply), ReplyPlan(think=True, calls=CALLS))
    assert texts(events, ReasoningDelta) == "weather, so a call\n" and not texts(events, TextDelta)
    assert calls_of(events) == [("get_weather", {"city": "Oslo"})]


def test_bare_json_later_in_the_answer_is_text() -> None:
    prose = f"The call would be {BARE % 'Rome'}, and a marked one follows.\n"
    events = run(list(prose + f"{HERMES_START}{BARE % 'Bern'}{HERMES_END}"), ReplyPlan(calls=CALLS))
    assert texts(events, TextDelta) == prose
    assert calls_of(events) == [("get_weather", {"city": "Bern"})]


@pytest.mark.parametrize("body", [
    '{"name": "rm_rf", "arguments": {}}', '{"name": "get_weather"}', '{"a": 1}',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}', '{"name": "get_weather", "arguments": [1]}',
    '{"name', '{"name": "get_weather", '])
def test_bare_json_that_is_no_call_passes_through_byte_exact(body: str) -> None:
    """JSON naming no offered tool, not shaped as a call, or cut short: exactly what was written,
    the whitespace before and after it included (only a call swallows them)."""
    whole = f" \n{body}\n\nSo that is it. {BARE % 'Paris'}"
    for pieces in (list(whole), [whole], [whole[:3], whole[3:9], whole[9:]]):
        events = run(pieces, ReplyPlan(calls=CALLS))
        assert texts(events, TextDelta) == whole and not calls_of(events)
    events = run(list(f"\n{body}"), ReplyPlan(calls=CALLS))  # the reply ends there
    assert texts(events, TextDelta) == f"\n{body}" and not calls_of(events)


def test_text_after_a_malformed_marked_call_keeps_its_whitespace() -> None:
    whole = f"{HERMES_START}\nnot json\n{HERMES_END}\n\nMore."
    events = run(list(whole), ReplyPlan(calls=CALLS))
    assert texts(events, TextDelta) == whole


def test_logprobs_stay_with_answer_text() -> None:
    table = [b"<think>", b"r", b"</think>", b"A"]
    decoder = ReplyDecoder(ReplyPlan(think=True), table.__getitem__, [], 100)
    events = []
    for i in range(4):
        events += decoder.push(i, TokenLogprob(str(i), -0.1, []))
    events += decoder.finish()
    answer = [e for e in events if isinstance(e, TextDelta)]
    assert [e.text for e in answer] == ["A"] and [lp.token for lp in answer[0].logprobs] == ["3"]
    assert decoder.reasoning_tokens == 2  # "r" and the closing tag were spent thinking


# -- constraints on the real fixture tokenizer ----------------------------------------------------------


def drive(decoder: ReplyDecoder, tokenizer: Tokenizer, text: str, rng: np.random.Generator) -> list[Event]:
    """Push `text`'s tokens, checking each against the decoder's mask over random logits."""
    events: list[Event] = []
    for token in tokenizer.encode(text, add_special=False, parse_special=True):
        if decoder.needs_logits:
            masked = decoder.mask(rng.standard_normal(tokenizer.vocab_size).astype(np.float32))
            assert np.isfinite(masked[token]), f"{tokenizer.piece(token)!r} was masked out"
        events += decoder.push(token)
    return events


def test_call_grammar_takes_over_once_the_opener_is_written(planner: ReplyPlanner, qwen3: Tokenizer) -> None:
    plan = planner.plan(ChatRequest([Message("user", "x")], tools=[WEATHER]), "")
    assert plan.call_grammar is not None and plan.grammar is None and plan.calls.format.hermes
    decoder = ReplyDecoder(plan, qwen3.token_bytes, [], 200)
    rng = np.random.default_rng(0)
    events = drive(decoder, qwen3, "Hi ", rng)
    assert not decoder.needs_logits  # prose decodes exactly as without tools
    events += drive(decoder, qwen3, "<tool_call>", rng)
    assert isinstance(decoder.constraint, GrammarConstraint)
    masked = decoder.mask(np.zeros(qwen3.vocab_size, dtype=np.float32))
    assert [qwen3.piece(i) for i in np.flatnonzero(np.isfinite(masked))] == ["\n"]
    events += drive(decoder, qwen3, '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', rng)
    assert decoder.constraint is None and not decoder.done  # released: the model may go on
    events += decoder.finish()
    assert texts(events, TextDelta) == "Hi "
    assert [e.name for e in events if isinstance(e, ToolCallEvent)] == ["get_weather"]


def test_call_grammar_guards_a_bare_hermes_call_too(planner: ReplyPlanner, qwen3: Tokenizer) -> None:
    """A call written without its markers is held to the same grammar once its lead shows: only
    offered names, JSON arguments, and the reply free again after it."""
    plan = planner.plan(ChatRequest([Message("user", "x")], tools=[WEATHER]), "")
    decoder = ReplyDecoder(plan, qwen3.token_bytes, [], 200)
    rng = np.random.default_rng(0)
    events = drive(decoder, qwen3, '{"name": "get_', rng)
    assert isinstance(decoder.constraint, GrammarConstraint)
    allowed = np.flatnonzero(np.isfinite(decoder.mask(np.zeros(qwen3.vocab_size, dtype=np.float32))))
    assert [qwen3.piece(i) for i in allowed] == ["w"]
    events += drive(decoder, qwen3, 'weather", "arguments": {"city": "Oslo"}}', rng)
    assert decoder.constraint is None
    events += decoder.finish()
    assert [(e.name, e.arguments) for e in events if isinstance(e, ToolCallEvent)] == [("get_weather", '{"city": "Oslo"}')]


def test_call_grammar_rejects_unknown_names_and_bad_arguments(planner: ReplyPlanner, qwen3: Tokenizer) -> None:
    plan = planner.plan(ChatRequest([Message("user", "x")], tools=[WEATHER]), "")
    decoder = ReplyDecoder(plan, qwen3.token_bytes, [], 200)
    drive(decoder, qwen3, '<tool_call>\n{"name": "get_', np.random.default_rng(1))
    allowed = np.flatnonzero(np.isfinite(decoder.mask(np.zeros(qwen3.vocab_size, dtype=np.float32))))
    assert [qwen3.piece(i) for i in allowed] == ["w"]


def test_thinking_budget_forces_the_closing_tag(planner: ReplyPlanner, qwen3: Tokenizer) -> None:
    plan = planner.plan(ChatRequest([Message("user", "x")], reasoning=True), "")
    decoder = ReplyDecoder(plan, qwen3.token_bytes, [], max_tokens=8)  # thinking may use 6 tokens
    rng = np.random.default_rng(2)
    drive(decoder, qwen3, "<think>abcdef", rng)
    assert isinstance(decoder.constraint, ForcedTokens)
    forced = []
    while decoder.constraint is not None:
        token = int(np.argmax(decoder.mask(rng.standard_normal(qwen3.vocab_size).astype(np.float32))))
        forced.append(token)
        decoder.push(token)
    assert qwen3.decode(forced) == "\n</think>\n\n" and not decoder.router.thinking
    events = drive(decoder, qwen3, "Answer", rng) + decoder.finish()
    assert texts(events, TextDelta) == "Answer"


def test_thinking_budget_of_the_request_is_honoured(planner: ReplyPlanner, qwen3: Tokenizer) -> None:
    plan = planner.plan(ChatRequest([Message("user", "x")], reasoning=True, thinking_budget=2), "")
    decoder = ReplyDecoder(plan, qwen3.token_bytes, [], max_tokens=1000)
    drive(decoder, qwen3, "<think>ab", np.random.default_rng(3))
    assert isinstance(decoder.constraint, ForcedTokens)


def test_whole_reply_grammar_ends_the_turn(planner: ReplyPlanner, qwen3: Tokenizer) -> None:
    request = ChatRequest([Message("user", "x")], output_format=OutputFormat("regex", "(yes|no)!", "regex"))
    decoder = ReplyDecoder(planner.plan(request, ""), qwen3.token_bytes, [], 50)
    events = drive(decoder, qwen3, "yes!", np.random.default_rng(4))
    assert decoder.done and texts(events + decoder.finish(), TextDelta) == "yes!"
