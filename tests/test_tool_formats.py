"""Tool calls and reasoning in each family's own format, on the tiny fixtures' real tokenizers and
chat templates (tests/data/fixtures/arch; Gemma 4 on a vocabulary written as llama.cpp's converter
writes one, tests/gemma4_vocab.py): scripted replies fed through the real ReplyDecoder as the
tokenizer splits them, one byte per token and split in two at every byte, each yielding exactly the
right calls, text and reasoning; the call grammar guarding a call under tool_choice auto; a forced
tool_choice constraining random logits into exactly one call whose arguments validate; and a call as
the family's own template writes it, accepted by that grammar and read back by the parser."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass
from functools import cache

import jsonschema
import numpy as np
import pytest

from lmserve.chat import harmony
from lmserve.chat.gemma4 import parse_call
from lmserve.chat.grammar import ForcedTokens, GrammarConstraint
from lmserve.chat.planner import ReplyPlanner
from lmserve.chat.prompt import PromptBuilder
from lmserve.chat.reply import ReplyDecoder, ReplyPlan
from lmserve.chat.tool_format import GEMMA4, HARMONY, HERMES, LLAMA3, MISTRAL, QWEN3_CODER, family_of
from lmserve.core.events import Event, Finished, ReasoningDelta, TextDelta, ToolCallEvent
from lmserve.core.types import ChatRequest, Message, SamplingParams, Tool, ToolChoice
from lmserve.engine.select import load_engine
from lmserve.model.chat_template import ChatTemplate
from lmserve.model.gguf_file import GGUFFile
from lmserve.model.loader import load_model
from lmserve.model.tokenizer import Tokenizer
from lmserve.runtime import Runtime
from lmserve.settings import Settings
from tests.conftest import TEMPLATES
from tests.families import ARCH, FAMILIES
from tests.gemma4_vocab import write_gemma4_vocab
from tests.test_reply_routing import drive

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

WEATHER = Tool("get_weather", "Weather for a city", {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}, "exact": {"type": "boolean"},
        "where": {"type": "object", "additionalProperties": False, "required": ["lat"],
                  "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}}}}}, strict=True)
TIME = Tool("get_time", "Local time", {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "string", "maxLength": 6}}}, strict=True)
TOOLS = [WEATHER, TIME]
CHOICES = [ToolChoice("required"), ToolChoice("named", "get_time")]
FAMILY_FORMAT = {"llama3": LLAMA3, "qwen3moe": QWEN3_CODER, "gemma3": HERMES, "phi3": HERMES, "mistral": MISTRAL,
                 "qwen2": HERMES, "gpt-oss": HARMONY, "qwen35": QWEN3_CODER, "qwen35moe": QWEN3_CODER, "gemma4": GEMMA4,
                 "gemma4-dense": GEMMA4}


@dataclass(frozen=True)
class Model:
    tokenizer: Tokenizer
    planner: ReplyPlanner

    def plan(self, prompt: str = "", **request: object) -> ReplyPlan:
        return self.planner.plan(ChatRequest([Message("user", "x")], tools=TOOLS, **request), prompt)  # type: ignore[arg-type]


    def prompt(self, **request: object) -> str:
        """The prompt the family's template renders for a request offering TOOLS."""
        builder = PromptBuilder(self.tokenizer, self.planner.template)
        return builder.render(ChatRequest([Message("user", "x")], tools=TOOLS, **request))  # type: ignore[arg-type]


def model_of(gguf: GGUFFile, template: str | None = None) -> Model:
    tokenizer = Tokenizer.from_gguf(gguf)
    chat = ChatTemplate((TEMPLATES / template).read_text()) if template else ChatTemplate.from_gguf(gguf, tokenizer)
    return Model(tokenizer, ReplyPlanner(tokenizer, chat))


@cache
def model(family: str, template: str | None = None) -> Model:
    """A fixture family's tokenizer and planner (its own template, or one of tests/data/templates)."""
    return model_of(GGUFFile(ARCH / family / f"tiny-{family}-F16.gguf"), template)


@pytest.fixture(scope="module", params=["vocab", "fixture"])
def gemma4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    """Gemma 4's real template over a vocabulary small enough to reason about (tests/gemma4_vocab.py),
    and the tiny Gemma 4 fixture (its trained toy vocabulary, the template embedded)."""
    if request.param == "fixture":
        return model("gemma4")
    return model_of(GGUFFile(write_gemma4_vocab(tmp_path_factory.mktemp("gemma4") / "vocab.gguf")))


# -- what a reply routes to -------------------------------------------------------------------------


def segments(events: list[Event]) -> list[tuple]:
    """Events as ("text", s) / ("reasoning", s) / ("call", name, arguments) with consecutive deltas
    of one kind merged, so how the text was split does not matter."""
    out: list[tuple] = []
    for event in events:
        if isinstance(event, ToolCallEvent):
            out.append(("call", event.name, json.loads(event.arguments)))
            continue
        kind = "text" if isinstance(event, TextDelta) else "reasoning" if isinstance(event, ReasoningDelta) else None
        if kind is None:
            continue
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + event.text)
        else:
            out.append((kind, event.text))
    return out


def feed(plan: ReplyPlan, pieces: list[bytes]) -> list[tuple]:
    """Token i spells pieces[i]."""
    decoder = ReplyDecoder(plan, pieces.__getitem__, [], max_tokens=10_000)
    events = [e for i in range(len(pieces)) for e in decoder.push(i)]
    return segments(events + decoder.finish())


def check_every_split(m: Model, reply: str, expected: list[tuple], **request: object) -> None:
    """`reply` routes to `expected` as the tokenizer splits it (with the call grammar guarding each
    call and allowing every token), one byte per token, and split in two at every byte."""
    plan = m.plan(**request)
    decoder = ReplyDecoder(plan, m.tokenizer.token_bytes, [], max_tokens=10_000)
    events = drive(decoder, m.tokenizer, reply, np.random.default_rng(0))
    assert segments(events + decoder.finish()) == expected
    routing = dataclasses.replace(plan, call_grammar=None)  # scripted tokens are not the tokenizer's ids
    data = reply.encode()
    assert feed(routing, [data[i:i + 1] for i in range(len(data))]) == expected
    for cut in range(1, len(data)):
        assert feed(routing, [data[:cut], data[cut:]]) == expected, f"split at byte {cut}: {data[:cut]!r}"


def passes_through(m: Model, reply: str) -> None:
    """A malformed call is the answer text, exactly as written (no grammar: a guarded call could
    not be malformed)."""
    plan = dataclasses.replace(m.plan(), call_grammar=None)
    data = reply.encode()
    assert feed(plan, [data[i:i + 1] for i in range(len(data))]) == [("text", reply)]
    for cut in range(1, len(data)):
        assert feed(plan, [data[:cut], data[cut:]]) == [("text", reply)]


ZURICH = {"city": "Zürich", "unit": "celsius", "days": 3}


# -- detection ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_each_fixture_family_gets_its_own_format(family: str) -> None:
    m = model(family)
    assert m.planner.tool_format is not None and m.planner.tool_format.family == FAMILY_FORMAT[family]
    assert m.planner.tool_format.grammar
    assert m.planner.harmony == (family == "gpt-oss")


@pytest.mark.parametrize(("template", "family"), [
    ("qwen3.jinja", HERMES), ("qwen2.5.jinja", HERMES), ("qwen3-coder.jinja", QWEN3_CODER),
    ("llama-3.1.jinja", LLAMA3), ("devstral.jinja", MISTRAL), ("mistral-small-3.2.jinja", MISTRAL),
    ("gpt-oss.jinja", HARMONY), ("gemma.jinja", HERMES), ("phi-3.5.jinja", HERMES), ("qwen3.5.jinja", QWEN3_CODER),
    ("gemma-4.jinja", GEMMA4), ("gemma-4-interleaved.jinja", GEMMA4)])
def test_template_markers_name_the_family(template: str, family: str) -> None:
    assert family_of(ChatTemplate((TEMPLATES / template).read_text())) == family


def test_detecting_a_format_leaves_transformers_unimported() -> None:
    """The server's warm-up thread detects the format while the first replies decode: importing
    mlx_lm's package (transformers, about a second of Python holding the GIL) slowed them."""
    script = f"""
import sys
from lmserve.chat.tool_format import detect
from lmserve.model.chat_template import ChatTemplate
for name in ("qwen3.jinja", "qwen3-coder.jinja", "devstral.jinja"):
    found = detect(ChatTemplate(open({str(TEMPLATES)!r} + "/" + name).read()), {{}})
    assert found is not None and found.parser is not None, name
print(sorted(m for m in ("transformers", "mlx_lm") if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_harmony_end_only_closes_a_message() -> None:
    """gpt-oss's <|end|> closes the analysis, not the turn (llama.cpp's rule); Phi-3's still ends it."""
    gpt_oss, phi3 = model("gpt-oss").tokenizer, model("phi3").tokenizer
    end = gpt_oss.encode("<|end|>", add_special=False, parse_special=True)
    assert len(end) == 1 and end[0] not in gpt_oss.eog_ids
    assert {gpt_oss.piece(i) for i in gpt_oss.eog_ids} == {"<|endoftext|>", "<|return|>", "<|call|>"}
    assert "<|end|>" in {phi3.piece(i) for i in phi3.eog_ids}


# -- hermes: Qwen2.5 (special-token markers), Gemma 3 and Phi-3 (folded hermes, spelled-out markers) --

HERMES_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", '
                '"unit": "celsius", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
                '{"zone": "CET"}}\n</tool_call>')
HERMES_CALLS = [("text", "Let me check.\n"), ("call", "get_weather", ZURICH), ("call", "get_time", {"zone": "CET"})]


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "phi3"])
def test_hermes_calls(family: str) -> None:
    check_every_split(model(family), HERMES_REPLY, HERMES_CALLS)
    passes_through(model(family), '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>')
    passes_through(model(family), '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "phi3"])
def test_hermes_bare_calls_where_a_call_may_start(family: str) -> None:
    """Qwen2.5-Coder's habit: a call without its markers, where the answer starts or a call just
    ended; a marked call after it is still guarded. JSON that is no call stays text."""
    bare = '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius", "days": 3}}\n'
    check_every_split(model(family), bare + HERMES_REPLY[len("Let me check.\n"):],
                      [("call", "get_weather", ZURICH), *HERMES_CALLS[1:]])
    passes_through(model(family), '{"name": "get_weather", "description": "Weather for a city"}\nThat one.')
    passes_through(model(family), '\n{"name": "rm_rf", "arguments": {}}')


def test_qwen3_thinks_then_calls(planner: ReplyPlanner, qwen3: Tokenizer) -> None:
    m = Model(qwen3, planner)
    check_every_split(m, "<think>\nThe user wants weather.\n</think>\n\n" + HERMES_REPLY,
                      [("reasoning", "The user wants weather.\n"), *HERMES_CALLS], reasoning=True)


# -- Qwen3-Coder XML ----------------------------------------------------------------------------------

CODER_REPLY = ("I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
               "<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=exact>\n"
               'true\n</parameter>\n<parameter=where>\n{"lat": 47}\n</parameter>\n</function>\n</tool_call>\n'
               "<tool_call>\n<function=get_time>\n<parameter=zone>\n0100\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder_calls_are_typed_by_the_schema() -> None:
    weather = {**ZURICH, "exact": True, "where": {"lat": 47}}
    check_every_split(model("qwen3moe"), CODER_REPLY, [
        ("text", "I'll look.\n"), ("call", "get_weather", weather), ("call", "get_time", {"zone": "0100"})])
    passes_through(model("qwen3moe"), "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n"
                                      "</parameter>\n</function>\n</tool_call>")  # not an integer
    passes_through(model("qwen3moe"), "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>")


def test_qwen3_coder_without_strict_takes_any_parameters() -> None:
    loose = Tool("get_weather", None, {"type": "object", "properties": {"city": {"type": "string"},
                                                                        "days": {"type": "integer"}}})
    m = model("qwen3moe")
    plan = m.planner.plan(ChatRequest([Message("user", "x")], tools=[loose]), "")
    decoder = ReplyDecoder(plan, m.tokenizer.token_bytes, [], max_tokens=500)
    reply = ("<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n<parameter=note>\nhi\n"
             "</parameter>\n</function>\n</tool_call>")  # out of order, and a parameter never declared
    events = drive(decoder, m.tokenizer, reply, np.random.default_rng(0)) + decoder.finish()
    assert segments(events) == [("call", "get_weather", {"days": 3, "note": "hi"})]


# -- Llama 3.x JSON -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("reply", "expected"), [
    ('{"name": "get_weather", "parameters": {"city": "Zürich", "unit": "celsius", "days": 3}}',
     [("call", "get_weather", ZURICH)]),
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', [("call", "get_time", {"zone": "CET"})]),
    ('\n{"name": "get_time", "parameters": {"zone": "A"}}; {"name": "get_time", "parameters": {"zone": "B"}}\n'
     '{"name": "get_weather", "parameters": {"city": "C", "unit": "fahrenheit"}}',
     [("call", "get_time", {"zone": "A"}), ("call", "get_time", {"zone": "B"}),
      ("call", "get_weather", {"city": "C", "unit": "fahrenheit"})]),
    ('It is {probably} sunny.', [("text", "It is {probably} sunny.")]),  # a brace mid-answer is text
])
def test_llama_json_calls(reply: str, expected: list[tuple]) -> None:
    check_every_split(model("llama3"), reply, expected)


def test_llama_malformed_calls_pass_through() -> None:
    passes_through(model("llama3"), '{"name": "get_weather", "parameters": [1]}')
    passes_through(model("llama3"), '{"answer": 42}')  # JSON, but not a call
    passes_through(model("llama3"), '{"name": "get_time", "parameters": {"zone": "A"')  # cut short


# -- Mistral / Devstral ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("reply", "expected"), [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "unit": "celsius", "days": 3}'
     '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
     [("call", "get_weather", ZURICH), ("call", "get_time", {"zone": "CET"})]),
    ('Sure.[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', [("text", "Sure."), ("call", "get_time", {"zone": "CET"})]),
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "A"}}, {"name": "get_time", "arguments": '
     '{"zone": "B"}}]', [("call", "get_time", {"zone": "A"}), ("call", "get_time", {"zone": "B"})]),
])
def test_mistral_calls(reply: str, expected: list[tuple]) -> None:
    check_every_split(model("mistral"), reply, expected)


def test_mistral_small_call_ids_and_malformed_calls() -> None:
    small = model("mistral", "mistral-small-3.2.jinja")
    assert small.planner.tool_format.call_id
    check_every_split(small, '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "CET"}',
                      [("call", "get_time", {"zone": "CET"})])
    passes_through(model("mistral"), '[TOOL_CALLS]get_weather[ARGS]{"city": "A"')  # cut short
    passes_through(model("mistral"), '[TOOL_CALLS]rm_rf[ARGS]{}')


# -- gpt-oss harmony ------------------------------------------------------------------------------------

CALL_HEADER = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"


@pytest.mark.parametrize(("reply", "expected"), [
    ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant" + CALL_HEADER +
     '{"city": "Zürich", "unit": "celsius", "days": 3}',  # <|call|> ended the turn
     [("reasoning", "Need the weather."), ("call", "get_weather", ZURICH)]),
    ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
     [("reasoning", "Easy."), ("text", "It is 4.")]),
    (' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}',  # the template's header order
     [("call", "get_time", {"zone": "CET"})]),
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + CALL_HEADER + '{"city": "A", '
     '"unit": "celsius"}<|call|><|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json'
     '<|message|>{"zone": "B"}',  # a preamble, then two calls (were the turn to go on after <|call|>)
     [("text", "Checking."), ("call", "get_weather", {"city": "A", "unit": "celsius"}),
      ("call", "get_time", {"zone": "B"})]),
    ("A reply that never opened a channel.", [("text", "A reply that never opened a channel.")]),
])
def test_harmony_channels(reply: str, expected: list[tuple]) -> None:
    check_every_split(model("gpt-oss"), reply, expected)


def test_harmony_malformed_calls_pass_through_with_their_markers() -> None:
    passes_through(model("gpt-oss"), CALL_HEADER + '{"city": ')
    passes_through(model("gpt-oss"), "<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{}")


def close_at_budget(decoder: ReplyDecoder, tok, reasoning: list[int]) -> list[int]:
    """Feed reasoning tokens until the thinking budget forces its close; the tokens it forced."""
    for token in reasoning:
        if isinstance(decoder.constraint, ForcedTokens):
            break
        decoder.push(token)
    assert isinstance(decoder.constraint, ForcedTokens)
    forced = []
    while decoder.constraint is not None:
        forced.append(int(np.argmax(decoder.mask(np.zeros(tok.vocab_size, dtype=np.float32)))))
        decoder.push(forced[-1])
    return forced


def test_harmony_start_state_and_thinking_budget() -> None:
    assert harmony.start_state("<|start|>assistant", governed=False) == "header"
    assert harmony.start_state("<|start|>assistant<|channel|>analysis<|message|>", governed=False) == "analysis"
    assert harmony.start_state("<|start|>assistant", governed=True) == "final"
    m = model("gpt-oss")
    tok = m.tokenizer
    plan = m.plan("<|start|>assistant", reasoning=True, thinking_budget=3)
    decoder = ReplyDecoder(plan, tok.token_bytes, [], max_tokens=100)
    forced = close_at_budget(decoder, tok, tok.encode("<|channel|>analysis<|message|>a b c d", add_special=False,
                                                      parse_special=True))
    assert tok.decode(forced) == "<|end|><|start|>assistant" and not decoder.router.thinking
    events = [e for t in tok.encode("<|channel|>final<|message|>Hi", add_special=False, parse_special=True)
              for e in decoder.push(t)] + decoder.finish()
    assert segments(events)[-1] == ("text", "Hi")


# -- Qwen3.5 / 3.6: Qwen3-Coder's XML calls, thinking opened by the generation prompt -------------------

QWEN35 = ("qwen35",)  # the tiny Qwen3.5 fixture: its markers are USER_DEFINED tokens, as in real files


def template_call(m: Model, arguments: dict, opener: str, closer: str) -> str:
    """The call to get_weather as the model's own template renders it in history."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    rendered = m.planner.template.render([{"role": "user", "content": "x"}, {
        "role": "assistant", "content": "", "tool_calls": [call]}, {"role": "user", "content": "y"}],
        tools=[t.to_template() for t in TOOLS])
    return opener + rendered.rsplit(opener, 1)[1].split(closer, 1)[0] + closer  # past the system prompt's example


def test_qwen35_thinks_inside_the_opened_block_then_calls() -> None:
    """Thinking on, Qwen3.5's generation prompt opens `<think>`: the reply starts inside it."""
    m = model(*QWEN35)
    prompt = m.prompt(reasoning=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n") and m.plan(prompt, reasoning=True).in_think
    check_every_split(m, "The user wants weather.\n</think>\n\n" + CODER_REPLY, [
        ("reasoning", "The user wants weather.\n"), ("text", "I'll look.\n"),
        ("call", "get_weather", {**ZURICH, "exact": True, "where": {"lat": 47}}), ("call", "get_time", {"zone": "0100"})],
        prompt=prompt, reasoning=True)


@pytest.mark.parametrize("choice", CHOICES)
def test_qwen35_forced_call_after_its_think_block(choice: ToolChoice) -> None:
    """Thinking on, a forced call keeps the think block Qwen3.5's generation prompt opens: the
    reply reasons first and the call grammar governs from the block's close on."""
    m = model(*QWEN35)
    prompt = m.prompt(reasoning=True, tool_choice=choice)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n") and m.plan(prompt, tool_choice=choice).in_think
    check_forced(m, choice, prompt, reasoning=True)


@pytest.mark.parametrize("family_template", [QWEN35, ("qwen3moe",)], ids=["qwen3.5", "qwen3-coder"])
def test_xml_grammar_takes_the_call_its_template_writes(family_template: tuple[str, ...]) -> None:
    """The forced grammar accepts, token by token, the call exactly as the template renders it
    (booleans as Python's `True`), and the parser reads it back."""
    m = model(*family_template)
    arguments = {"city": "Zürich", "unit": "celsius", "days": 3, "exact": True, "where": {"lat": 47}}
    call = template_call(m, arguments, "<tool_call>", "</tool_call>")
    assert "<parameter=exact>\nTrue\n</parameter>" in call
    check_template_call(m, call, arguments)


def check_template_call(m: Model, call: str, arguments: dict) -> None:
    plan = m.plan(tool_choice=ToolChoice("named", "get_weather"))
    decoder = ReplyDecoder(plan, m.tokenizer.token_bytes, [], max_tokens=500)
    events = drive(decoder, m.tokenizer, call, np.random.default_rng(0))
    assert decoder.done
    assert segments(events + decoder.finish()) == [("call", "get_weather", arguments)]


# -- Gemma 4: call:NAME{...} in its own notation, reasoning in thought channels -------------------------

GEMMA_REPLY = ('Let me check.<|tool_call>call:get_weather{city:<|"|>Zürich<|"|>,days:3,unit:<|"|>celsius<|"|>}'
               '<tool_call|><|tool_call>call:get_time{zone:<|"|>CET<|"|>}<tool_call|>')


@pytest.mark.parametrize(("reply", "expected"), [
    (GEMMA_REPLY, [("text", "Let me check."), ("call", "get_weather", ZURICH), ("call", "get_time", {"zone": "CET"})]),
    ('<|channel>thought\nThe user wants weather.<channel|><|tool_call>call:get_weather{city:<|"|>a,{b}:c<|"|>,'
     'exact:true,unit:<|"|>fahrenheit<|"|>,where:{lat:-3}}<tool_call|>',
     [("reasoning", "The user wants weather."), ("call", "get_weather", {"city": "a,{b}:c", "exact": True,
                                                                       "unit": "fahrenheit", "where": {"lat": -3}})]),
    # llama.cpp has seen replies end in an extra empty thought channel, or a lone <channel|>
    ("<|channel>thought\nEasy.\n<channel|>It is 4.<|channel>thought\n<channel|>", [("reasoning", "Easy.\n"),
                                                                                 ("text", "It is 4.")]),
    ("It is 4.<channel|> Really.", [("text", "It is 4. Really.")]),
])
def test_gemma4_calls_and_thought_channels(gemma4: Model, reply: str, expected: list[tuple]) -> None:
    check_every_split(gemma4, reply, expected)


def test_gemma4_end_marker_inside_a_string_does_not_end_the_call(gemma4: Model) -> None:
    """The notation quotes strings with `<|"|>`, and one may hold `<tool_call|>` (the call grammar
    allows it, the parser reads it as text): the call ends at the marker outside quotes."""
    plan = dataclasses.replace(gemma4.plan(), call_grammar=None)
    data = b'<|tool_call>call:get_time{zone:<|"|>a<tool_call|>}<|"|>}<tool_call|>'
    expected = [("call", "get_time", {"zone": "a<tool_call|>}"})]
    assert feed(plan, [data[i:i + 1] for i in range(len(data))]) == expected
    for cut in range(1, len(data)):
        assert feed(plan, [data[:cut], data[cut:]]) == expected


def test_gemma4_malformed_calls_pass_through(gemma4: Model) -> None:
    passes_through(gemma4, '<|tool_call>call:get_weather{city:}<tool_call|>')
    passes_through(gemma4, '<|tool_call>call:rm_rf{}<tool_call|>')
    passes_through(gemma4, '<|tool_call>call:get_time{zone:1e999}<tool_call|>')  # no JSON number


ARGUMENTS = {"path": "src/a b.py", "Zed": -1, "edits": [{"old": "x = {1: 'a'}", "new": "y, z"}, {"old": "<b>"}],
             "count": 3, "ratio": 0.25, "tiny": 1e-05, "dry_run": False, "tags": ["a", "b"], "empty": [],
             "nested": {"deep": {"ok": True}}, "none": {}}


@pytest.mark.parametrize("template", ["gemma-4.jinja", "gemma-4-interleaved.jinja"])
def test_gemma4_reads_back_what_its_template_writes(template: str) -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "edit", "arguments": ARGUMENTS}}]
    prompt = ChatTemplate((TEMPLATES / template).read_text()).render([
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "user", "content": "y"}])
    body = prompt.split("<|tool_call>", 1)[1].split("<tool_call|>", 1)[0]
    # keys in dictsort's order, case-insensitive (as the grammar holds them)
    assert body.startswith('call:edit{count:3,dry_run:false,edits:[{new:<|"|>y, z<|"|>,old:') and body.endswith(",Zed:-1}")
    assert parse_call(body) == {"name": "edit", "arguments": ARGUMENTS}


def test_gemma4_parser_reads_what_llama_cpp_reads() -> None:
    """Keys are anything up to ':' and spaces may sit between items (llama.cpp's Gemma 4 grammar):
    mlx-lm's parser fails on both; a key the model quoted is read as text."""
    body = 'call:edit{ file-path:<|"|>a.py<|"|>, n: 2 ,<|"|>$ref<|"|>:null,e:[ 1, true ],o:{ }}'
    assert parse_call(body) == {"name": "edit", "arguments": {"file-path": "a.py", "n": 2, "$ref": None,
                                                              "e": [1, True], "o": {}}}
    for bad in ('call:edit{a:<|"|>x}', "call:edit{a:1", "call:edit{a:1}x", "edit{a:1}", "call:edit{a:tru}",
                "call:edit{:1}", "call:edit{a:1,}", "call:edit{a:[1,]}"):
        with pytest.raises(ValueError):
            parse_call(bad)


def test_gemma4_grammar_takes_the_call_its_template_writes(gemma4: Model) -> None:
    arguments = {"city": "Zürich", "unit": "celsius", "days": 3, "exact": True, "where": {"lat": 47}}
    call = template_call(gemma4, arguments, "<|tool_call>", "<tool_call|>")
    assert call == ('<|tool_call>call:get_weather{city:<|"|>Zürich<|"|>,days:3,exact:true,unit:<|"|>celsius<|"|>,'
                    'where:{lat:47}}<tool_call|>')
    check_template_call(gemma4, call, arguments)


def test_gemma4_auto_guard_holds_names_after_reasoning(gemma4: Model) -> None:
    allowed = check_auto_guard(gemma4, "<|tool_call>call:", before="<|channel>thought\nhm<channel|>")
    assert allowed and all(any(t.name.startswith(p) for t in TOOLS) for p in allowed), allowed


@pytest.mark.parametrize("choice", CHOICES)
def test_gemma4_forced_call(gemma4: Model, choice: ToolChoice) -> None:
    """Thinking off under a grammar: the prompt closes the empty thought channel, the grammar starts
    at the call; a tool that is not strict takes any arguments in the notation."""
    prompt = gemma4.prompt(reasoning=True, tool_choice=choice)
    assert prompt.endswith("<|turn>model\n<|channel>thought\n<channel|>") and "<|think|>" not in prompt
    check_forced(gemma4, choice, prompt)
    loose = Tool("get_time", None, {"type": "object", "properties": {"zone": {"type": "string"}}})
    check_forced(gemma4, choice, prompt, tools=[loose])


def test_gemma4_thinking_budget_closes_the_thought_channel(gemma4: Model) -> None:
    tok = gemma4.tokenizer
    prompt = gemma4.prompt(reasoning=True)
    assert prompt.startswith("<bos><|turn>system\n<|think|>\n") and prompt.endswith("<|turn>model\n")
    decoder = ReplyDecoder(gemma4.plan(prompt, reasoning=True, thinking_budget=3), tok.token_bytes, [], 100)
    forced = close_at_budget(decoder, tok, tok.encode("<|channel>thought\na b c d e", add_special=False))
    assert tok.decode(forced) == "\n<channel|>" and not decoder.router.thinking
    events = [e for t in tok.encode("Hi", add_special=False) for e in decoder.push(t)] + decoder.finish()
    assert segments(events) == [("text", "Hi")]


# -- the call grammar under auto ------------------------------------------------------------------------

OPENERS = {"llama3": "{", "qwen3moe": "<tool_call>\n<function=", "gemma3": '<tool_call>\n{"name": "',
           "phi3": '<tool_call>\n{"name": "', "mistral": "[TOOL_CALLS]", "qwen2": '<tool_call>\n{"name": "',
           "gpt-oss": "<|channel|>commentary to=functions.", "qwen35": "<tool_call>\n<function=",
           "qwen35moe": "<tool_call>\n<function=", "gemma4": "<|tool_call>call:", "gemma4-dense": "<|tool_call>call:"}


def check_auto_guard(m: Model, opener: str, prompt: str = "", before: str = "") -> set[str]:
    """Under auto, nothing is constrained until `opener` is written (after `before`, free text or
    reasoning); then the call grammar holds, and the pieces it allows next are returned."""
    tok = m.tokenizer
    plan = m.plan(prompt)
    assert plan.grammar is None and plan.call_grammar is not None
    decoder = ReplyDecoder(plan, tok.token_bytes, [], max_tokens=500)
    for token in tok.encode(before, add_special=False, parse_special=True):
        decoder.push(token)
        assert not decoder.needs_logits  # reasoning is free
    assert not decoder.needs_logits  # nothing is constrained until a call opens
    for token in tok.encode(opener, add_special=False, parse_special=True):
        decoder.push(token)
    assert isinstance(decoder.constraint, GrammarConstraint)
    return {tok.piece(i) for i in np.flatnonzero(np.isfinite(decoder.mask(np.zeros(tok.vocab_size, np.float32))))}


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_guard_starts_at_the_opener_and_holds_names(family: str) -> None:
    harmony_ = family == "gpt-oss"
    allowed = check_auto_guard(model(family), OPENERS[family], "<|start|>assistant" if harmony_ else "",
                               "<|channel|>analysis<|message|>hm<|end|><|start|>assistant" if harmony_ else "")
    if family == "llama3":
        assert allowed and all('"name": "get_'.startswith(p) for p in allowed), allowed
    else:  # a name must begin (get_weather, get_time); Mistral's older list form may open too
        assert allowed and all(any(t.name.startswith(p) for t in TOOLS) or p.strip() in ("", "[") for p in allowed), \
            allowed


# -- forced calls: exactly one, arguments valid, in every family --------------------------------------


def sample_reply(m: Model, plan: ReplyPlan, seed: int, steps: int = 4000) -> list[tuple]:
    """Random logits through the decoder's mask, as the scheduler drives it: an end-of-turn token
    ends the reply without being pushed."""
    tok = m.tokenizer
    decoder = ReplyDecoder(plan, tok.token_bytes, [], max_tokens=steps)
    rng = np.random.default_rng(seed)
    events: list[Event] = []
    for _ in range(steps):
        token = int(np.argmax(decoder.mask(rng.standard_normal(tok.vocab_size).astype(np.float32))))
        if token in tok.eog_ids:
            break
        events += decoder.push(token)
        if decoder.done:
            break
    else:
        pytest.fail("the forced call never ended")
    return segments(events + decoder.finish())


def check_forced(m: Model, choice: ToolChoice, prompt: str = "", tools: list[Tool] = TOOLS,
                 reasoning: bool = False) -> None:
    """Random logits under a forced tool_choice: exactly one call, to a candidate, whose arguments
    validate, and no text (nor reasoning, unless the family's grammar allows some first)."""
    plan = m.planner.plan(ChatRequest([Message("user", "x")], tools=tools, tool_choice=choice), prompt)
    assert plan.grammar is not None
    schemas = {t.name: t.parameters for t in tools}
    for seed in range(3):
        routed = sample_reply(m, plan, seed)
        calls = [s for s in routed if s[0] == "call"]
        assert len(calls) == 1, routed
        _, name, arguments = calls[0]
        assert choice.mode == "required" or name == choice.name
        jsonschema.validate(arguments, schemas[name])
        assert not [s for s in routed if s[0] == "text"], routed
        assert reasoning or not [s for s in routed if s[0] == "reasoning"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("choice", CHOICES)
def test_forced_call_is_exactly_one_valid_call(family: str, choice: ToolChoice) -> None:
    check_forced(model(family), choice, "<|start|>assistant" if family == "gpt-oss" else "",
                 reasoning=family == "gpt-oss")


@pytest.mark.parametrize("family", FAMILIES)
def test_forced_call_through_the_scheduler(family: str) -> None:
    """The real runtime on the NumPy engine: the family's prompt, sampled tokens, end-of-turn tokens
    as the scheduler sees them (gpt-oss's <|end|> closes the analysis and the turn goes on to the
    call; <|call|> ends it), so each reply is one call and finishes with "tool_calls"."""
    model_ = load_model(ARCH / family / f"tiny-{family}-F16.gguf")
    runtime = Runtime(model_, load_engine("cpu", model_.gguf, model_.config),
                      Settings(ctx=8192, kv_slots=3, batch=3))  # Devstral's system prompt is long
    requests = [ChatRequest([Message("user", "hi")], SamplingParams(temperature=1.0, seed=seed), 1500, tools=TOOLS,
                            tool_choice=ToolChoice("required")) for seed in range(3)]

    async def generate(request: ChatRequest) -> list[Event]:
        return [event async for event in runtime.start_chat(request).events()]

    async def batch() -> list[list[Event]]:
        return await asyncio.gather(*(generate(r) for r in requests))

    runtime.start()
    try:
        replies = asyncio.run(batch())
    finally:
        runtime.stop()
    schemas = {t.name: t.parameters for t in TOOLS}
    for events in replies:
        (call,) = [e for e in events if isinstance(e, ToolCallEvent)]
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        assert isinstance(events[-1], Finished) and events[-1].reason == "tool_calls"
        assert not "".join(e.text for e in events if isinstance(e, TextDelta))
    if family == "gpt-oss":  # at least one reply reasoned first, and still called
        assert any(isinstance(e, ReasoningDelta) for events in replies for e in events)
