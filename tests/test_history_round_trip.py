"""History round trip: calls the server emitted, sent back by a client with their results (chat
`tool_calls` + `tool` messages, Responses `function_call` + `function_call_output` items,
Anthropic `tool_use` + `tool_result` blocks), render through every family's template exactly as
transformers renders the same conversation in Hugging Face's own shape (arguments a dict, results
`{"role": "tool", "content", "tool_call_id", "name"}`, reasoning under the field the template reads).

Where a template cannot take the conversation as it stands, lmserve reshapes it and the reference is
transformers rendering the same reshaped conversation (QUIRKS):

- mistral-small-3.2 wants call ids of 9 alphanumerics: every id becomes `short_call_id(id)`; it also
  refuses a user turn right after tool results, so such text joins the last result;
- llama-3.1 raises on two calls in one turn and gpt-oss renders only the first (naming every result
  after it): such a turn becomes one assistant turn per call, each followed by its result;
- gemma and phi-3.5 take no tools: tools, calls and results are folded into plain turns the hermes
  way (`hermes.fold`), and gemma, which has no system role, gets the system turn folded into the first
  user turn (`fold_system`); templates insisting on alternating roles get consecutive user turns joined;
- gpt-oss refuses a call turn with both text and reasoning: the text joins the reasoning;
- gemma-4-interleaved (Gemma 4's older template) reads results only from the call turn's
  `tool_responses`: they are folded there as llama.cpp folds them (`results_onto_call_turns`).
"""

from __future__ import annotations

import json
import warnings
from functools import cache
from typing import Any

import pytest

from lmserve.chat import hermes
from lmserve.chat.prompt import PromptBuilder, fold_system, results_onto_call_turns, short_call_id
from lmserve.core.types import ChatRequest, Message, Tool, ToolCall
from lmserve.model.chat_template import ChatTemplate
from lmserve.model.gguf_file import GGUFFile
from lmserve.model.tokenizer import Tokenizer
from tests.conftest import TEMPLATES, TINY_LLAMA
from tests.test_chat_template import _parse as parse

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "PyTorch was not found"
    from transformers.utils.chat_template_utils import render_jinja_template

FAMILIES = ("devstral", "gemma", "gemma-4", "gemma-4-interleaved", "gpt-oss", "llama-3.1", "mistral-small-3.2",
            "phi-3.5", "qwen2.5", "qwen3-coder", "qwen3", "qwen3.5")
SPECIAL = {  # each family's own bos/eos strings, as its tokenizer config passes them
    "devstral": ("<s>", "</s>"), "gemma": ("<bos>", "<eos>"), "gemma-4": ("<bos>", "<eos>"),
    "gemma-4-interleaved": ("<bos>", "<eos>"), "gpt-oss": ("<|startoftext|>", "<|return|>"),
    "llama-3.1": ("<|begin_of_text|>", "<|eot_id|>"), "mistral-small-3.2": ("<s>", "</s>"),
    "phi-3.5": ("<s>", "<|endoftext|>"), "qwen2.5": ("<|endoftext|>", "<|im_end|>"),
    "qwen3-coder": ("<|endoftext|>", "<|im_end|>"), "qwen3": ("<|endoftext|>", "<|im_end|>"),
    "qwen3.5": ("<|endoftext|>", "<|im_end|>"),
}
SHORT_IDS, ONE_CALL_PER_TURN, HERMES, NO_SYSTEM = "short ids", "one call per turn", "hermes", "no system"
RESULTS_ON_CALL_TURN = "results on the call turn"
QUIRKS = {"mistral-small-3.2": {SHORT_IDS}, "llama-3.1": {ONE_CALL_PER_TURN}, "gpt-oss": {ONE_CALL_PER_TURN},
          "gemma": {HERMES, NO_SYSTEM}, "phi-3.5": {HERMES}, "gemma-4-interleaved": {RESULTS_ON_CALL_TURN}}

SYSTEM, QUESTION, REASONING = "Be brief.", "What are the weather and the time in my city?", "Look both up."
ANSWER, FOLLOW_UP = "Mild, midday.", "And tomorrow?"
PENDING_REASONING = {  # how the reasoning of the call turn still waiting for its results is shown
    "qwen3": f"<think>\n{REASONING}\n</think>", "qwen3.5": f"<think>\n{REASONING}\n</think>",
    "gpt-oss": f"<|channel|>analysis<|message|>{REASONING}<|end|>",
    "gemma-4": f"<|channel>thought\n{REASONING}\n<channel|>", "gemma-4-interleaved": f"<|channel>thought\n{REASONING}<channel|>",
}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "clock": {"type": "string"}},
          "required": ["city"]}
TOOL_DEFS = [("get_weather", "Wetter für eine Stadt"), ("get_time", "The local time")]
# (name, arguments, result) of the calls the server emitted, in order, and a mark of each result
CALLS = [("get_weather", {"city": "Zürich"}, '{"temp_c": 17.5}'),
         ("get_time", {"city": "Zürich", "clock": "24h"}, "noon sharp")]
RESULT_MARKS = ("17.5", "noon sharp")
ID_PREFIX = {"chat": "call_", "responses": "call_", "anthropic": "toolu_"}  # as each dialect emits them
DIALECTS = tuple(ID_PREFIX)


def call_ids(dialect: str, n: int) -> list[str]:
    return [f"{ID_PREFIX[dialect]}{k:x}f3a9c07d1e5b48a2c6d9e0f{k}" for k in range(n)]


# -- the conversation each dialect sends ----------------------------------------------------------------


def chat_body(ids: list[str], follow_up: bool) -> dict:
    calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}}
             for i, (n, a, _) in zip(ids, CALLS, strict=False)]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": None, "reasoning_content": REASONING, "tool_calls": calls},
                *({"role": "tool", "tool_call_id": i, "content": r} for i, (_, _, r) in zip(ids, CALLS, strict=False))]
    if follow_up:
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FOLLOW_UP}]
    tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": SCHEMA}} for n, d in TOOL_DEFS]
    return {"messages": messages, "tools": tools, "reasoning_effort": "high"}


def responses_body(ids: list[str], follow_up: bool) -> dict:
    items: list[dict] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": REASONING}]},
        *({"type": "function_call", "id": f"fc_{i}", "call_id": i, "name": n, "status": "completed",
           "arguments": json.dumps(a, ensure_ascii=False)} for i, (n, a, _) in zip(ids, CALLS, strict=False)),
        *({"type": "function_call_output", "call_id": i, "output": r} for i, (_, _, r) in zip(ids, CALLS, strict=False)),
    ]
    if follow_up:
        items += [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": ANSWER, "annotations": []}]},
                  {"role": "user", "content": FOLLOW_UP}]
    tools = [{"type": "function", "name": n, "description": d, "parameters": SCHEMA} for n, d in TOOL_DEFS]
    return {"instructions": SYSTEM, "input": items, "tools": tools, "reasoning": {"effort": "high"}}


def anthropic_body(ids: list[str], follow_up: bool) -> dict:
    uses = [{"type": "tool_use", "id": i, "name": n, "input": a} for i, (n, a, _) in zip(ids, CALLS, strict=False)]
    results = [{"type": "tool_result", "tool_use_id": i, "content": r} for i, (_, _, r) in zip(ids, CALLS, strict=False)]
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": REASONING, "signature": "0f"}, *uses]},
                {"role": "user", "content": results}]
    if follow_up:
        messages += [{"role": "assistant", "content": [{"type": "text", "text": ANSWER}]},
                     {"role": "user", "content": FOLLOW_UP}]
    tools = [{"name": n, "description": d, "input_schema": SCHEMA} for n, d in TOOL_DEFS]
    return {"system": SYSTEM, "max_tokens": 1000, "messages": messages, "tools": tools,
            "thinking": {"type": "enabled", "budget_tokens": 31999}}


BODIES = {"chat": chat_body, "responses": responses_body, "anthropic": anthropic_body}


# -- the same conversation in Hugging Face's shape -------------------------------------------------------


def hf_conversation(ids: list[str], follow_up: bool, reasoning_key: str, split: bool) -> list[dict]:
    """`split`: one assistant turn per call, each followed by its result (reasoning on the first)."""
    calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
             for i, (n, a, _) in zip(ids, CALLS, strict=False)]
    results = [{"role": "tool", "content": r, "tool_call_id": i, "name": n}
               for i, (n, _, r) in zip(ids, CALLS, strict=False)]
    turns = [{"role": "assistant", "content": "", reasoning_key: REASONING, "tool_calls": calls}]
    if split:
        turns = []
        for k, (call, result) in enumerate(zip(calls, results, strict=True)):
            turn = {"role": "assistant", "content": "", "tool_calls": [call]}
            turns += [{**turn, reasoning_key: REASONING} if k == 0 else turn, result]
        results = []
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}, *turns, *results]
    if follow_up:
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FOLLOW_UP}]
    return messages


def hf_tools() -> list[dict]:
    return [{"type": "function", "function": {"name": n, "description": d, "parameters": SCHEMA}} for n, d in TOOL_DEFS]


def as_messages(conversation: list[dict]) -> list[Message]:
    """Hugging Face's dicts as lmserve messages, for the hermes fold of a template without tools."""
    return [Message(m["role"], m["content"], tool_calls=[
        ToolCall(c["id"], c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False))
        for c in m.get("tool_calls", [])], tool_call_id=m.get("tool_call_id"), name=m.get("name"),
        reasoning=m.get("reasoning_content")) for m in conversation]


def transformers_render(family: str, messages: list[dict], tools: list[dict] | None, **kwargs: Any) -> str:
    bos, eos = SPECIAL[family]
    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=source(family),
                                        add_generation_prompt=True, bos_token=bos, eos_token=eos, **kwargs)
    return rendered[0]


def reference(family: str, dialect: str, n_calls: int, follow_up: bool) -> str:
    """transformers' prompt for the conversation, reshaped as QUIRKS says for the family."""
    quirks = QUIRKS.get(family, set())
    ids = call_ids(dialect, n_calls)
    if SHORT_IDS in quirks:
        ids = [short_call_id(i) for i in ids]
    reasoning_key = "thinking" if "message.thinking" in source(family) else "reasoning_content"
    split = ONE_CALL_PER_TURN in quirks and n_calls > 1
    messages, tools = hf_conversation(ids, follow_up, reasoning_key, split), hf_tools()
    if HERMES in quirks:
        folded = hermes.fold(as_messages(messages), [Tool(n, d, SCHEMA) for n, d in TOOL_DEFS])
        if NO_SYSTEM in quirks:
            folded = fold_system(folded)
        messages, tools = [m.to_template() for m in folded], None
    if RESULTS_ON_CALL_TURN in quirks:
        messages = results_onto_call_turns(messages)
    return transformers_render(family, messages, tools, enable_thinking=True, reasoning_effort="high")


@cache
def source(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text()


@cache
def template(family: str) -> ChatTemplate:
    bos, eos = SPECIAL[family]
    return ChatTemplate(source(family), {"bos_token": bos, "eos_token": eos})


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(TINY_LLAMA / "tiny-llama-F32.gguf"))


def render(tokenizer: Tokenizer, family: str, request: ChatRequest) -> str:
    return PromptBuilder(tokenizer, template(family)).render(request)


def test_every_template_is_covered() -> None:
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(FAMILIES)


@pytest.mark.parametrize("follow_up", [False, True], ids=["pending", "follow-up"])
@pytest.mark.parametrize("n_calls", [1, 2], ids=["one-call", "two-calls"])
@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_history_renders_as_transformers_renders_it(tokenizer: Tokenizer, family: str, dialect: str,
                                                    n_calls: int, follow_up: bool) -> None:
    request = parse(dialect, BODIES[dialect](call_ids(dialect, n_calls), follow_up))
    ours = render(tokenizer, family, request)
    assert ours == reference(family, dialect, n_calls, follow_up)
    for (name, arguments, _), mark in zip(CALLS[:n_calls], RESULT_MARKS, strict=False):  # nothing dropped
        assert ours.count(name) >= 2 and mark in ours  # declared and called; its result
        assert all(value in ours for value in arguments.values())
    if not follow_up and family in PENDING_REASONING:  # reasoning of the pending call turn is shown
        assert PENDING_REASONING[family] in ours


# -- the quirks, as probed from each template --------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_template_traits_are_probed(family: str) -> None:
    t, quirks = template(family), QUIRKS.get(family, set())
    assert t.supports_tools is (HERMES not in quirks)
    assert t.supports_system is (NO_SYSTEM not in quirks)
    assert t.short_call_ids is (SHORT_IDS in quirks)
    assert t.parallel_calls is (ONE_CALL_PER_TURN not in quirks)
    assert t.results_on_call_turn is (RESULTS_ON_CALL_TURN in quirks)
    assert t.calls_take_text_and_thinking is (family != "gpt-oss")
    assert t.alternates is (family in ("gemma", "mistral-small-3.2"))
    assert t.user_after_results is (family != "mistral-small-3.2")
    assert t.supports_effort is (family == "gpt-oss")


def test_short_call_ids_are_stable_and_keep_mistral_shaped_ones() -> None:
    assert short_call_id("a1B2c3D4e") == "a1B2c3D4e"
    assert short_call_id("call_0f3a") == short_call_id("call_0f3a") != short_call_id("call_0f3b")
    for call_id in ("x", "toolu_01A-b", "ü" * 9):
        assert len(short_call_id(call_id)) == 9 and short_call_id(call_id).isascii() and short_call_id(call_id).isalnum()


def test_split_calls_find_their_results_by_id(tokenizer: Tokenizer) -> None:
    """Results sent in another order than the calls still follow their own call (Llama 3.1)."""
    ids = call_ids("chat", 2)
    body = chat_body(ids, False)
    body["messages"][3:] = body["messages"][3:][::-1]
    assert render(tokenizer, "llama-3.1", parse("chat", body)) == reference("llama-3.1", "chat", 2, False)


def test_a_gpt_oss_call_turn_with_text_and_thinking_keeps_both_as_its_analysis(tokenizer: Tokenizer) -> None:
    """gpt-oss's template refuses a call turn with both (Anthropic clients replay thinking, text
    and tool_use blocks): the text joins the reasoning, both before the call."""
    body = anthropic_body(call_ids("anthropic", 1), False)
    body["messages"][1]["content"].insert(1, {"type": "text", "text": "Checking."})
    ours = render(tokenizer, "gpt-oss", parse("anthropic", body))
    messages = hf_conversation(call_ids("anthropic", 1), False, "thinking", False)
    messages[2]["thinking"] = f"{REASONING}\n\nChecking."
    assert ours == transformers_render("gpt-oss", messages, hf_tools(), reasoning_effort="high")
    assert f"<|channel|>analysis<|message|>{REASONING}\n\nChecking.<|end|>" in ours


def test_arguments_reach_the_template_as_a_dict(tokenizer: Tokenizer) -> None:
    """Compact JSON text renders in the template's own layout, the one the model writes; text that
    is not a JSON object is shown as sent instead of failing the request."""
    body = chat_body(call_ids("chat", 1), False)
    body["messages"][2]["tool_calls"][0]["function"]["arguments"] = '{"city":"Zürich"}'
    ours = render(tokenizer, "qwen3", parse("chat", body))
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in ours
    assert ours == reference("qwen3", "chat", 1, False)
    for text, shown in (("city=Zürich", "city=Zürich"), ("", "{}")):
        body["messages"][2]["tool_calls"][0]["function"]["arguments"] = text
        assert f'"arguments": {shown}}}' in render(tokenizer, "qwen3", parse("chat", body))


def test_gemma_takes_claude_codes_results_and_text_in_one_turn(tokenizer: Tokenizer) -> None:
    """Tool results and text in one Anthropic user message fold into two user turns, which Gemma's
    alternating roles refuse: they are joined into one."""
    body = anthropic_body(call_ids("anthropic", 1), False)
    body["messages"][2]["content"].append({"type": "text", "text": FOLLOW_UP})
    ours = render(tokenizer, "gemma", parse("anthropic", body))
    assert f'<tool_response>\n{CALLS[0][2]}\n</tool_response>\n\n{FOLLOW_UP}<end_of_turn>' in ours
    assert ours.endswith("<start_of_turn>model\n")


def test_mistral_takes_claude_codes_results_and_text_in_one_turn(tokenizer: Tokenizer) -> None:
    """Mistral's template refuses a user turn right after tool results: the text joins the last
    result, as transformers renders that conversation."""
    ids = call_ids("anthropic", 2)
    body = anthropic_body(ids, False)
    body["messages"][2]["content"].append({"type": "text", "text": FOLLOW_UP})
    ours = render(tokenizer, "mistral-small-3.2", parse("anthropic", body))
    messages = hf_conversation([short_call_id(i) for i in ids], False, "reasoning_content", False)
    messages[-1]["content"] += f"\n\n{FOLLOW_UP}"
    assert ours == transformers_render("mistral-small-3.2", messages, hf_tools())
    assert ours.endswith(f"[TOOL_CONTENT]{CALLS[1][2]}\n\n{FOLLOW_UP}[/TOOL_RESULTS]")


def test_tool_results_are_named_after_their_call() -> None:
    for dialect in DIALECTS:
        ids = call_ids(dialect, 2)
        results = [m for m in parse(dialect, BODIES[dialect](ids, False)).messages if m.role == "tool"]
        assert [(m.tool_call_id, m.name) for m in results] == [(i, c[0]) for i, c in zip(ids, CALLS, strict=True)]


def test_chat_reasoning_under_vllms_name(tokenizer: Tokenizer) -> None:
    body = chat_body(call_ids("chat", 1), False)
    body["messages"][2]["reasoning"] = body["messages"][2].pop("reasoning_content")
    assert render(tokenizer, "qwen3", parse("chat", body)) == reference("qwen3", "chat", 1, False)


# -- reasoning effort: gpt-oss's `reasoning_effort`, the others' `enable_thinking` ----------------------------

USER = [{"role": "user", "content": "hi"}]


def effort_shown(tokenizer: Tokenizer, dialect: str, body: dict) -> str:
    prompt = render(tokenizer, "gpt-oss", parse(dialect, body))
    return prompt.split("Reasoning: ", 1)[1].split("\n", 1)[0]


@pytest.mark.parametrize(("effort", "level"), [(None, "medium"), ("none", "low"), ("minimal", "low"), ("low", "low"),
                                               ("medium", "medium"), ("high", "high"), ("xhigh", "high")])
def test_openai_effort_sets_gpt_oss_reasoning(tokenizer: Tokenizer, effort: str | None, level: str) -> None:
    """None: the client did not say, the template's default (medium, OpenAI's too)."""
    chat = {"messages": USER, **({"reasoning_effort": effort} if effort else {})}
    responses = {"input": "hi", **({"reasoning": {"effort": effort}} if effort else {})}
    assert effort_shown(tokenizer, "chat", chat) == level
    assert effort_shown(tokenizer, "responses", responses) == level


@pytest.mark.parametrize(("thinking", "level"), [
    (None, "low"), ({"type": "disabled"}, "low"), ({"type": "adaptive"}, "medium"), ({"type": "enabled"}, "medium"),
    ({"type": "enabled", "budget_tokens": 1024}, "low"), ({"type": "enabled", "budget_tokens": 4000}, "low"),
    ({"type": "enabled", "budget_tokens": 10000}, "medium"), ({"type": "enabled", "budget_tokens": 31999}, "high"),
])
def test_anthropic_thinking_sets_gpt_oss_reasoning(tokenizer: Tokenizer, thinking: dict | None, level: str) -> None:
    """Absent thinking is Anthropic's "disabled"; budgets map as Claude Code's think (4000),
    think hard (10000) and ultrathink (31999)."""
    body = {"max_tokens": 100, "messages": USER, **({"thinking": thinking} if thinking else {})}
    assert effort_shown(tokenizer, "anthropic", body) == level


def test_effort_under_a_grammar_and_from_template_kwargs(tokenizer: Tokenizer) -> None:
    """Under a grammar the client's effort is used as sent (its reasoning budget keeps room for the
    grammar), and low when it gives none. An explicit chat_template_kwargs value wins."""
    constrained = {"messages": USER, "reasoning_effort": "high", "response_format": {"type": "json_object"}}
    assert effort_shown(tokenizer, "chat", constrained) == "high"
    assert effort_shown(tokenizer, "chat", {**constrained, "reasoning_effort": None}) == "low"
    explicit = {"messages": USER, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}
    assert effort_shown(tokenizer, "chat", explicit) == "high"


def test_other_families_keep_enable_thinking(tokenizer: Tokenizer) -> None:
    request = parse("chat", {"messages": USER, "reasoning_effort": "low"})
    assert request.reasoning and request.reasoning_effort == "low"
    assert render(tokenizer, "qwen3", request) == transformers_render("qwen3", USER, None, enable_thinking=True)
    off = parse("anthropic", {"max_tokens": 100, "messages": USER})
    assert render(tokenizer, "qwen3", off).endswith("<think>\n\n</think>\n\n")
