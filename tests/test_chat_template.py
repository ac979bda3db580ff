"""Chat templates: SmolLM2 goldens, and Qwen3 renders byte for byte against transformers' apply_chat_template."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer

from lmserve.chat.prompt import PromptBuilder
from lmserve.core.types import ChatRequest
from lmserve.http.anthropic import parse_messages
from lmserve.http.openai_chat import parse_chat
from lmserve.http.openai_responses import parse_responses
from lmserve.http.response_store import ResponseStore
from lmserve.model.chat_template import CHATML_TEMPLATE, ChatTemplate, TemplateError
from lmserve.model.gguf_file import GGUFFile, ModelLoadError
from lmserve.model.tokenizer import Tokenizer
from tests.conftest import CLIENTS, TEMPLATES, TINY_LLAMA

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
TINY_LLAMA_F32 = TINY_LLAMA / "tiny-llama-F32.gguf"
SPECIAL = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> tuple[ChatTemplate, Tokenizer]:
    file = GGUFFile(smollm2_path)
    tokenizer = Tokenizer.from_gguf(file)
    return ChatTemplate.from_gguf(file, tokenizer), tokenizer


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(TINY_LLAMA_F32))


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_tokenizer: Tokenizer) -> Any:
    """transformers' tokenizer class around a copy of the fixture's vocabulary (no torch needed)."""
    transformers = pytest.importorskip("transformers")
    backend = HFTokenizer.from_str(tiny_tokenizer.backend.to_str())
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL)


def hf_render(hf_tokenizer: Any, template: str, messages: list[dict], **kwargs: Any) -> str:
    """transformers' own apply_chat_template over the same template."""
    return hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


def test_smollm2_goldens(smollm2: tuple[ChatTemplate, Tokenizer], chat_goldens: list[dict]) -> None:
    template, tokenizer = smollm2
    assert chat_goldens
    for case in chat_goldens:
        extra = {k: case[k] for k in ("tools", "add_generation_prompt") if k in case}
        rendered = template.render(case["messages"], **extra, **case.get("kwargs", {}))
        assert rendered == case["rendered"]
        assert tokenizer.encode(rendered) == case["prompt_ids"]


def test_smollm2_properties(smollm2: tuple[ChatTemplate, Tokenizer]) -> None:
    template, _ = smollm2
    assert not template.supports_tools and not template.supports_thinking
    assert template.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                       "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}


# -- Qwen3 against transformers ------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Wetter für eine Stadt — current conditions",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {"type": "object"}}},
]
TOOL_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich and the time?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
    {"role": "assistant", "content": "21 °C at noon.", "reasoning_content": "Both tools answered."},
    {"role": "user", "content": "Thanks!"},
]
CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hello!"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    "tool_calls": TOOL_TURNS,
    "reasoning_after_last_user": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "\nsimple sum\n"},
    ],
    "inline_think": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nb", "reasoning_content": None},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "<think>x</think>d"},
    ],
    "thinking_alias": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "thinking": "from the thinking field"},
    ],
}


RENDER_KWARGS = [  # how the template-equality tests render each conversation
    {"add_generation_prompt": True},
    {"add_generation_prompt": True, "enable_thinking": False},
    {"add_generation_prompt": True, "enable_thinking": True, "tools": TOOLS},
    {"add_generation_prompt": False, "tools": TOOLS},
]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("kwargs", RENDER_KWARGS, ids=["gen", "no-think", "think-tools", "tools-no-gen"])
def test_qwen3_matches_transformers(hf_tokenizer: Any, name: str, kwargs: dict) -> None:
    messages = CONVERSATIONS[name]
    ours = ChatTemplate(QWEN3, SPECIAL).render(messages, **kwargs)
    assert ours == hf_render(hf_tokenizer, QWEN3, messages, **kwargs)


def test_qwen3_properties() -> None:
    template = ChatTemplate(QWEN3)
    assert template.supports_tools and template.supports_thinking
    assert template.render([{"role": "user", "content": "x"}], enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


FEATURES = """{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}
{% generation %}{{ m.role }}={{ m | tojson(indent=2) }}{% endgeneration %}
{% set ns.n = ns.n + 1 %}{% endfor %}n={{ ns.n }} {{ dict(a=1) | tojson(separators=(',', ':'), sort_keys=true) }}
{{ bos_token }}|{{ eos_token }}|{{ extra }}|{{ strftime_now('%Y') | length }}"""


def test_environment_features_match_transformers(hf_tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "héllo \"q\" <b>", "skip": None}, {"role": "assistant", "content": "x"},
                {"role": "user", "content": "never shown"}]
    ours = ChatTemplate(FEATURES, SPECIAL).render(messages, extra=[1, "ü"])
    assert ours == hf_render(hf_tokenizer, FEATURES, messages, add_generation_prompt=True, extra=[1, "ü"])
    assert json.dumps(messages[0]["content"], ensure_ascii=False) in ours and "skip" not in ours


# -- errors and selection --------------------------------------------------------------------------------


def test_raise_exception_becomes_template_error() -> None:
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}")
    with pytest.raises(TemplateError, match="Conversation must start with user"):
        template.render([{"role": "assistant", "content": "x"}])


def test_bad_input_becomes_template_error() -> None:
    template = ChatTemplate(QWEN3)
    with pytest.raises(TemplateError):
        template.render([{"role": "user", "content": ["not", "a", "string"]}])  # list has no .startswith
    with pytest.raises(TemplateError, match="must be objects"):
        template.render(["hello"])  # type: ignore[list-item]


def test_sandbox_blocks_escapes() -> None:
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__ }}").render([])
    with pytest.raises(TemplateError):
        ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}").render([])


def test_syntax_error(tiny_tokenizer: Tokenizer) -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    file = SimpleNamespace(metadata={"tokenizer.chat_template": "{% if %}"}, path=Path("broken.gguf"))
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        ChatTemplate.from_gguf(file, tiny_tokenizer)  # type: ignore[arg-type]


def test_chatml_fallback_and_tool_use_template(tiny_tokenizer: Tokenizer) -> None:
    file = SimpleNamespace(metadata={}, path=Path("no-template.gguf"))
    template = ChatTemplate.from_gguf(file, tiny_tokenizer)  # type: ignore[arg-type]
    assert template.source == CHATML_TEMPLATE
    assert template.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    file.metadata = {"tokenizer.chat_template": "plain", "tokenizer.chat_template.tool_use": "{{ tools | length }} tools"}
    template = ChatTemplate.from_gguf(file, tiny_tokenizer)  # type: ignore[arg-type]
    assert template.supports_tools
    assert template.render([], tools=TOOLS) == "2 tools" and template.render([]) == "plain"


def test_documents_reach_the_template() -> None:
    template = ChatTemplate("{{ documents | length if documents is not none else 'none' }}")
    assert template.render([]) == "none"
    assert template.render([], documents=[{"title": "a", "text": "b"}]) == "1"


# -- dialect requests -> prompt (PromptBuilder), against transformers on the equivalent OpenAI messages -------------

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt",
                                                  "parameters": WEATHER_SCHEMA}}
ZURICH = json.dumps({"city": "Zürich"}, ensure_ascii=False)
HISTORY = [  # what each dialect below sends, in OpenAI's shape
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ZURICH}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
    {"role": "user", "content": "And tomorrow?"},
]


def _anthropic_body() -> dict:
    return {"system": "Be brief.", "max_tokens": 100, "thinking": {"type": "enabled", "budget_tokens": 2048},
            "tools": [{"name": "get_weather", "description": "Wetter für eine Stadt", "input_schema": WEATHER_SCHEMA}],
            "messages": [
                {"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                                                  {"type": "tool_use", "id": "c1", "name": "get_weather",
                                                   "input": {"city": "Zürich"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "{\"temp\": 21}"},
                                             {"type": "text", "text": "And tomorrow?"}]},  # Claude Code's shape
            ]}


def _responses_body() -> dict:
    return {"instructions": "Be brief.", "reasoning": {"effort": "medium"},
            "tools": [{"type": "function", "name": "get_weather", "description": "Wetter für eine Stadt",
                       "parameters": WEATHER_SCHEMA}, {"type": "web_search"}],
            "input": [{"role": "user", "content": "Weather in Zürich?"},
                      {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Look it up."}]},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": ZURICH},
                      {"type": "function_call_output", "call_id": "c1", "output": "{\"temp\": 21}"},
                      {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]}]}


def _parse(dialect: str, body: dict) -> ChatRequest:
    if dialect == "chat":
        return parse_chat(body, 1000)[0]
    if dialect == "anthropic":
        return parse_messages(body, 1000)
    return parse_responses(body, 1000, ResponseStore()).chat


@pytest.mark.parametrize("dialect", ["chat", "anthropic", "responses"])
def test_dialect_tool_history_and_thinking_match_transformers(hf_tokenizer: Any, tiny_tokenizer: Tokenizer,
                                                              dialect: str) -> None:
    body = {"chat": {"messages": HISTORY, "tools": [WEATHER_TOOL], "reasoning_effort": "high"},
            "anthropic": _anthropic_body(), "responses": _responses_body()}[dialect]
    ours = PromptBuilder(tiny_tokenizer, ChatTemplate(QWEN3, SPECIAL)).render(_parse(dialect, body))
    assert ours == hf_render(hf_tokenizer, QWEN3, HISTORY, tools=[WEATHER_TOOL], add_generation_prompt=True,
                             enable_thinking=True)


def test_thinking_follows_the_client_else_the_template_and_is_off_under_constraints(
        tiny_tokenizer: Tokenizer) -> None:
    """Qwen3's template thinks unless told not to: a request that says nothing gets that default
    (as llama-server renders it), `none` turns it off; Anthropic's API thinks only when asked."""
    builder = PromptBuilder(tiny_tokenizer, ChatTemplate(QWEN3, SPECIAL))
    user = [{"role": "user", "content": "hi"}]
    assert builder.render(_parse("chat", {"messages": user})).endswith("assistant\n")
    assert builder.render(_parse("chat", {"messages": user, "reasoning_effort": "low"})).endswith("assistant\n")
    assert builder.render(_parse("chat", {"messages": user, "reasoning_effort": "none"})).endswith(
        "<think>\n\n</think>\n\n")
    assert builder.render(_parse("anthropic", {"messages": user, "max_tokens": 9})).endswith(
        "<think>\n\n</think>\n\n")
    for constraint in ({"response_format": {"type": "json_object"}}, {"regex": "a+"},
                       {"tools": [WEATHER_TOOL], "tool_choice": "required"}):
        body = {"messages": user, "reasoning_effort": "high", **constraint}
        assert builder.render(_parse("chat", body)).endswith("<think>\n\n</think>\n\n"), constraint


def test_tool_choice_none_offers_no_tools(tiny_tokenizer: Tokenizer) -> None:
    builder = PromptBuilder(tiny_tokenizer, ChatTemplate(QWEN3, SPECIAL))
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER_TOOL]}
    assert "<tools>" in builder.render(_parse("chat", body))
    assert "<tools>" not in builder.render(_parse("chat", {**body, "tool_choice": "none"}))


def test_template_without_tools_renders_hermes_like_qwen3(hf_tokenizer: Any,
                                                          smollm2: tuple[ChatTemplate, Tokenizer]) -> None:
    """SmolLM2's ChatML template knows no tools: the folded turns read exactly as Qwen3's template
    renders tools, calls and results (both are ChatML underneath)."""
    template, tokenizer = smollm2
    history = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in HISTORY]
    ours = PromptBuilder(tokenizer, template).render(_parse("chat", {"messages": history, "tools": [WEATHER_TOOL]}))
    assert ours == hf_render(hf_tokenizer, QWEN3, history, tools=[WEATHER_TOOL], add_generation_prompt=True)


# -- Qwen3.5 / 3.6 and Gemma 4 against transformers ------------------------------------------------------

NEW_FAMILIES = {"qwen3.5": ("<|endoftext|>", "<|im_end|>"), "gemma-4": ("<bos>", "<eos>"),
                "gemma-4-interleaved": ("<bos>", "<eos>")}


def family_template(family: str) -> tuple[str, dict[str, str]]:
    bos, eos = NEW_FAMILIES[family]
    return (TEMPLATES / f"{family}.jinja").read_text(), {"bos_token": bos, "eos_token": eos}


def hf_render_family(tiny_tokenizer: Tokenizer, family: str, messages: list[dict], **kwargs: Any) -> str:
    transformers = pytest.importorskip("transformers")
    source, special = family_template(family)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tiny_tokenizer.backend.to_str()),
                                              **special)
    return hf_render(hf, source, messages, **kwargs)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("kwargs", RENDER_KWARGS, ids=["gen", "no-think", "think-tools", "tools-no-gen"])
@pytest.mark.parametrize("family", sorted(NEW_FAMILIES))
def test_qwen35_and_gemma4_match_transformers(tiny_tokenizer: Tokenizer, family: str, name: str, kwargs: dict) -> None:
    """Where the template itself fails (Qwen3.5 iterates arguments, so a call's arguments given as
    JSON text break it), transformers fails too."""
    source, special = family_template(family)
    messages = CONVERSATIONS[name]
    try:
        ours = ChatTemplate(source, special).render(messages, **kwargs)
    except TemplateError:
        with pytest.raises(Exception, match="mapping"):
            hf_render_family(tiny_tokenizer, family, messages, **kwargs)
        return
    assert ours == hf_render_family(tiny_tokenizer, family, messages, **kwargs)


USER = [{"role": "user", "content": "hi"}]
THINKING = {  # family -> how its prompt ends with thinking off, and on
    "qwen3.5": ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "<|im_start|>assistant\n<think>\n"),
    "gemma-4": ("<turn|>\n<|turn>model\n<|channel>thought\n<channel|>", "<turn|>\n<|turn>model\n"),
}


@pytest.mark.parametrize("family", sorted(THINKING))
def test_qwen35_and_gemma4_think_as_their_templates_do_unless_told(tiny_tokenizer: Tokenizer, family: str) -> None:
    """A request that says nothing gets the template's own default (Qwen3.5 thinks, Gemma 4 does
    not); every dialect's reasoning field turns it on, `none` off; under a grammar only where the
    template opens the think block itself."""
    builder = PromptBuilder(tiny_tokenizer, ChatTemplate(*family_template(family)))
    off, on = THINKING[family]
    default = hf_render_family(tiny_tokenizer, family, USER, add_generation_prompt=True)
    assert builder.render(_parse("chat", {"messages": USER})) == default
    assert default.endswith(on if family == "qwen3.5" else off)
    assert builder.render(_parse("chat", {"messages": USER, "reasoning_effort": "none"})).endswith(off)
    asked = [_parse("chat", {"messages": USER, "reasoning_effort": "medium"}),
             _parse("responses", {"input": "hi", "reasoning": {"effort": "low"}}),
             _parse("anthropic", {"max_tokens": 100, "messages": USER, "thinking": {"type": "enabled",
                                                                                    "budget_tokens": 1024}}),
             _parse("chat", {"messages": USER, "chat_template_kwargs": {"enable_thinking": True}})]
    for request in asked:
        prompt = builder.render(request)
        assert prompt.endswith(on) and prompt == hf_render_family(tiny_tokenizer, family, USER,
                                                                  add_generation_prompt=True, enable_thinking=True)
    # Under a grammar Qwen3.5 still thinks (its prompt opens the block, the grammar follows its
    # close); Gemma 4's model would have to open its channel itself, so it renders thinking off.
    for constraint in ({"response_format": {"type": "json_object"}}, {"tools": [WEATHER_TOOL], "tool_choice": "required"}):
        prompt = builder.render(_parse("chat", {"messages": USER, "reasoning_effort": "high", **constraint}))
        assert prompt.endswith(on if family == "qwen3.5" else off)


@pytest.mark.parametrize("thinking", [False, True])
def test_gemma4_opens_the_model_turn_its_template_leaves_closed(tiny_tokenizer: Tokenizer, thinking: bool) -> None:
    """A call turn with text (Claude Code's text + tool_use) renders its text after the results and
    closes the turn, and the template then writes no generation prompt: the template's own opening
    of a model turn is appended (llama.cpp appends `<|turn>model\\n`)."""
    body = {"max_tokens": 100, "tools": _anthropic_body()["tools"], "messages": [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}, {
            "type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Zürich"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "{\"temp\": 21}"}]}],
        **({"thinking": {"type": "adaptive"}} if thinking else {})}
    ours = PromptBuilder(tiny_tokenizer, ChatTemplate(*family_template("gemma-4"))).render(_parse("anthropic", body))
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
    history = [HISTORY[1], {"role": "assistant", "content": "Let me check.", "tool_calls": [call]}, HISTORY[3]]
    theirs = hf_render_family(tiny_tokenizer, "gemma-4", history, tools=[WEATHER_TOOL], add_generation_prompt=True,
                              enable_thinking=thinking)
    assert theirs.endswith('<tool_response|>Let me check.<turn|>\n')
    assert ours == theirs + ("<|turn>model\n" if thinking else "<|turn>model\n<|channel>thought\n<channel|>")


def test_gemma4_interleaved_gets_results_on_the_call_turn(tiny_tokenizer: Tokenizer) -> None:
    """Gemma 4's older template reads results only from the call turn (Google's shape, which
    llama.cpp folds them into): a result that is JSON is shown as Gemma's object notation."""
    builder = PromptBuilder(tiny_tokenizer, ChatTemplate(*family_template("gemma-4-interleaved")))
    ours = builder.render(_parse("chat", {"messages": HISTORY, "tools": [WEATHER_TOOL]}))
    assert ('<|tool_call>call:get_weather{city:<|"|>Zürich<|"|>}<tool_call|>'
            '<|tool_response>response:get_weather{temp:21}<tool_response|><|turn>user\nAnd tomorrow?') in ours
    assert "<|turn>tool" not in ours


def test_a_later_system_turn_becomes_a_user_turn_where_the_template_takes_one_only_first(
        tiny_tokenizer: Tokenizer) -> None:
    """Claude Code 2.1 sends a system message after the first user turn; Qwen3.5's template raises
    on it ("System message must be at the beginning"). It is rendered as a user turn there, and
    the leading system turn, which every later prompt of the session starts with, is unchanged."""
    body = json.loads((CLIENTS / "claude-code-2.1.197-messages-with-tools.json").read_text())["body"]
    request = parse_messages(body, 1000)
    assert [m.role for m in request.messages] == ["system", "user", "system"]
    template = ChatTemplate(*family_template("qwen3.5"))
    assert template.supports_system and not template.system_anywhere
    prompt = PromptBuilder(tiny_tokenizer, template).render(request)
    late = request.messages[2].content
    assert f"<|im_start|>user\n{late}<|im_end|>" in prompt and prompt.startswith("<|im_start|>system\n")
    assert ChatTemplate(QWEN3, SPECIAL).system_anywhere  # Qwen3's renders it where it is
