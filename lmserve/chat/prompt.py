"""Normalized chat request -> prompt token ids, through the model's own chat template."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from lmserve.chat import gemma4, hermes
from lmserve.chat.reply_router import THINK
from lmserve.chat.tool_format import GEMMA4, family_of
from lmserve.core.errors import RequestError
from lmserve.core.types import ChatRequest, Message, Tool
from lmserve.model.chat_template import ChatTemplate, TemplateError
from lmserve.model.tokenizer import Tokenizer


class PromptBuilder:
    """Renders messages with the chat template and tokenizes them as Hugging Face does."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self._gemma4 = family_of(template) == GEMMA4
        # With thinking on, the generation prompt opens the think block (Qwen3.5 / 3.6; Qwen3 leaves
        # opening it to the model): a grammar can then govern from the block's close on.
        self._opens_thinking = template.supports_thinking and \
            self._generation_prompt({"enable_thinking": True}).rstrip().endswith(THINK.open)

    def render(self, request: ChatRequest) -> str:
        """The prompt text. A template without tool support gets tools and tool history folded into
        plain turns (hermes), one with it gets past calls shaped the way it can render them
        (`fit_calls`); one that refuses a system turn gets it folded into the first user turn, one
        that takes it only first gets later ones as user turns, one that wants alternating roles
        gets consecutive user turns joined. Thinking follows the client where it says (else the
        template's default); while a grammar governs the reply it is off, unless the template's
        generation prompt opens the think block itself (Qwen3.5), where the reply thinks first and
        the grammar takes over at the close; gpt-oss's `reasoning_effort` follows the client's
        effort, "low" under a grammar when the client gives none. A template that
        reads tool results from the call turn (Gemma 4's older one) gets them folded there; where
        Gemma 4's template leaves the model's turn unopened, it is opened."""
        template = self.template
        messages, tools = request.messages, request.offered_tools
        if template.supports_tools:
            messages = fit_calls(messages, template)
        else:
            messages, tools = hermes.fold(messages, tools), []
        if not template.supports_system:
            messages = fold_system(messages)
        elif not template.system_anywhere:
            messages = later_system_as_user(messages)
        if template.alternates:
            messages = join_user_turns(messages)
        kwargs = self._template_kwargs(request)
        shaped = [m.to_template() for m in messages]
        if template.results_on_call_turn:
            shaped = results_onto_call_turns(shaped)
        try:
            prompt = template.render(shaped, add_generation_prompt=True, tools=[self._tool(t) for t in tools] or None,
                                     **kwargs)
            if self._gemma4 and prompt.endswith(gemma4.TURN_END):
                prompt += self._generation_prompt(kwargs)
            return prompt
        except TemplateError as exc:
            raise RequestError(f"messages: the chat template rejected the conversation: {exc}",
                               400, "messages") from None

    def _template_kwargs(self, request: ChatRequest) -> dict[str, Any]:
        """The template variables of a request: its own, then thinking and effort as asked."""
        kwargs = dict(request.template_kwargs)
        thinking = request.reasoning
        if request.constrained and not self._opens_thinking:  # the grammar governs from the first token
            thinking = False
        if self.template.supports_thinking and thinking is not None:
            kwargs.setdefault("enable_thinking", thinking)
        effort = request.reasoning_effort or ("low" if request.constrained else None)
        if self.template.supports_effort and effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
        return kwargs

    def history_end(self, request: ChatRequest, prompt_ids: list[int]) -> int:
        """How many of the prompt's tokens precede the generation prompt the template appended (0
        when they cannot be told apart): where the next turn's prompt, which renders this turn's
        reply as history, parts from this one at the latest (Qwen3.5 writes the reply without this
        turn's `<think>` opening), so a hybrid cache keeps a checkpoint there."""
        opening = self.encode(self._generation_prompt(self._template_kwargs(request)))
        if not opening or len(opening) >= len(prompt_ids) or prompt_ids[-len(opening):] != opening:
            return 0
        return len(prompt_ids) - len(opening)

    def _generation_prompt(self, kwargs: dict[str, Any]) -> str:
        """What the template writes to open the model's turn after a user turn. Gemma 4's template
        writes nothing after tool results, which is right when the results end the model's turn so
        far (it goes on in that turn), but leaves no turn open at all when the call turn also had
        text (then `<turn|>` follows the results). llama.cpp appends `<|turn>model\n` there; this
        appends the template's own opening, its empty thought channel included when thinking is off."""
        probe = [{"role": "user", "content": "x"}]
        opened = self.template.render(probe, add_generation_prompt=True, **kwargs)
        closed = self.template.render(probe, add_generation_prompt=False, **kwargs)
        return opened[len(closed):] if opened.startswith(closed) else gemma4.MODEL_TURN

    def _tool(self, tool: Tool) -> dict:
        """A tool as the template takes it; a missing description is given as empty text to a
        template that cannot render a tool without one (gpt-oss), rather than refusing the request."""
        shaped = tool.to_template()
        if self.template.tools_need_description:
            shaped["function"].setdefault("description", "")
        return shaped

    def encode(self, prompt: str) -> list[int]:
        # The rendered text already carries any BOS the template wants, so no special tokens
        # are added here (apply_chat_template(tokenize=True) does the same).
        return self.tokenizer.encode(prompt, add_special=False, parse_special=True)

    def build(self, request: ChatRequest) -> list[int]:
        return self.encode(self.render(request))

    def count(self, request: ChatRequest) -> int:
        """len(build(request)), without the ids themselves."""
        return self.tokenizer.count(self.render(request), add_special=False, parse_special=True)


def results_onto_call_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Template-shaped messages with each run of tool turns folded into the call turn before it as
    `tool_responses` ({"name", "response"}: text that is JSON as its value, other text as sent), and
    an answer right after them (text, no calls) joined to that turn: llama.cpp's shape for Gemma 4's
    older template (`convert_tool_responses_gemma4`), which reads results only from there and
    renders a tool turn as a turn of its own, a shape Gemma 4 was not taught. As in llama.cpp the call
    turn keeps its calls and reasoning and not its text, which that template would render after the
    results, as if it were the answer. A result is named after its call (by id), else by position."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        i += 1
        calls = message.get("tool_calls") if message["role"] == "assistant" else None
        if not calls:
            out.append(message)
            continue
        turn: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
        responses = []
        while i < len(messages) and messages[i]["role"] == "tool":
            result = messages[i]
            i += 1
            position = calls[len(responses)]["function"]["name"] if len(responses) < len(calls) else None
            responses.append({"name": result.get("name") or position or result.get("tool_call_id", ""),
                              "response": _json_or_text(result.get("content", ""))})
        if responses:
            turn["tool_responses"] = responses
        after = messages[i] if i < len(messages) else None
        if after is not None and after["role"] == "assistant" and not after.get("tool_calls") and after.get("content"):
            turn["content"] = after["content"]
            i += 1
        if message.get("reasoning_content"):
            turn["reasoning_content"] = message["reasoning_content"]
        out.append(turn)
    return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def fold_system(messages: list[Message]) -> list[Message]:
    """System turns joined into the first user turn, as Gemma 3's own template and llama.cpp's
    polyfill do for templates without a system role: agents always send one."""
    system = "\n\n".join(m.content for m in messages if m.role == "system")
    rest = [m for m in messages if m.role != "system"]
    if not system:
        return rest
    first_user = next((i for i, m in enumerate(rest) if m.role == "user"), None)
    if first_user is None:
        return [Message("user", system), *rest]
    folded = dataclasses.replace(rest[first_user], content=f"{system}\n\n{rest[first_user].content}")
    return [*rest[:first_user], folded, *rest[first_user + 1:]]


def later_system_as_user(messages: list[Message]) -> list[Message]:
    """System turns after the first message as user turns, for templates that take a system turn
    only at the start (Qwen3.5's raises): Claude Code sends one mid-conversation. Moving it into the
    leading system turn instead would change the start of every later prompt, and with it every
    cached prefix."""
    return [dataclasses.replace(m, role="user") if i and m.role == "system" else m for i, m in enumerate(messages)]


def join_user_turns(messages: list[Message], onto: str = "user") -> list[Message]:
    """Each user turn right after an `onto` turn appended to it, a blank line between: consecutive
    user turns as one for templates that insist on alternating roles (Claude Code sends tool
    results and text in one user message, which a folded conversation, Gemma's, turns into two
    user turns; Anthropic's API joins them too), or with "tool" a user turn joined to the tool
    result before it (Mistral's template refuses a user turn there)."""
    out: list[Message] = []
    for message in messages:
        if out and message.role == "user" and out[-1].role == onto:
            out[-1] = dataclasses.replace(out[-1], content=f"{out[-1].content}\n\n{message.content}")
        else:
            out.append(message)
    return out


def fit_calls(messages: list[Message], template: ChatTemplate) -> list[Message]:
    """Past calls shaped the way the template can render them: Mistral's 9-character ids and a
    user turn right after tool results joined to the last result (its template refuses one there;
    Claude Code sends results and text in one message), the text of a gpt-oss call turn moved into
    its reasoning (its template takes one or the other), one call per assistant turn for Llama 3.1
    and gpt-oss."""
    if template.short_call_ids:
        messages = [_short_ids(m) for m in messages]
    if not template.user_after_results:
        messages = join_user_turns(messages, onto="tool")
    if not template.calls_take_text_and_thinking:
        messages = [_text_into_reasoning(m) for m in messages]
    if not template.parallel_calls:
        messages = one_call_per_turn(messages)
    return messages


def short_call_id(call_id: str) -> str:
    """Mistral's call id shape, 9 alphanumerics: an id of that shape is kept, any other becomes
    the first 9 hex digits of its SHA-256, the same for a call and its result and the same every
    turn (so the prompt's prefix, and its KV cache, stays put)."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _short_ids(message: Message) -> Message:
    if not message.tool_calls and message.tool_call_id is None:
        return message
    calls = [dataclasses.replace(c, id=short_call_id(c.id)) for c in message.tool_calls]
    result_id = short_call_id(message.tool_call_id) if message.tool_call_id is not None else None
    return dataclasses.replace(message, tool_calls=calls, tool_call_id=result_id)


def _text_into_reasoning(message: Message) -> Message:
    if not (message.tool_calls and message.content and message.reasoning):
        return message
    return dataclasses.replace(message, content="", reasoning=f"{message.reasoning}\n\n{message.content}")


def one_call_per_turn(messages: list[Message]) -> list[Message]:
    """An assistant turn of several calls as one turn per call, each followed by its result
    (matched by id, else the next result no call claims): Llama 3.1 raises on two calls in a turn,
    gpt-oss renders the first and names every result after it. Text and reasoning stay with the
    first call."""
    out: list[Message] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        i += 1
        if message.role != "assistant" or len(message.tool_calls) < 2:
            out.append(message)
            continue
        pending = []  # indices of the tool turns that follow, not placed yet
        while i < len(messages) and messages[i].role == "tool":
            pending.append(i)
            i += 1
        ids = {c.id for c in message.tool_calls}
        for k, call in enumerate(message.tool_calls):
            turn = message if k == 0 else dataclasses.replace(message, content="", reasoning=None)
            out.append(dataclasses.replace(turn, tool_calls=[call]))
            answer = next((j for j in pending if messages[j].tool_call_id == call.id),
                          next((j for j in pending if messages[j].tool_call_id not in ids), None))
            if answer is not None:
                pending.remove(answer)
                out.append(messages[answer])
        out.extend(messages[j] for j in pending)
    return out
