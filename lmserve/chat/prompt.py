"""Normalized chat request -> prompt token ids, through the model's own chat template."""

from __future__ import annotations

import dataclasses

from lmserve.chat import hermes
from lmserve.core.errors import RequestError
from lmserve.core.types import ChatRequest, Message
from lmserve.model.chat_template import ChatTemplate, TemplateError
from lmserve.model.tokenizer import Tokenizer


class PromptBuilder:
    """Renders messages with the chat template and tokenizes them as Hugging Face does."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self.tokenizer = tokenizer
        self.template = template

    def render(self, request: ChatRequest) -> str:
        """The prompt text. A template without tool support gets tools and tool history folded into
        plain turns (hermes), one that refuses a system turn gets it folded into the first user turn;
        thinking is on only when asked for and no grammar governs the reply."""
        messages, tools = request.messages, request.offered_tools
        if not self.template.supports_tools:
            messages, tools = hermes.fold(messages, tools), []
        if not self.template.supports_system:
            messages = fold_system(messages)
        kwargs = dict(request.template_kwargs)
        if self.template.supports_thinking:
            kwargs.setdefault("enable_thinking", request.reasoning and not request.constrained)
        try:
            return self.template.render([m.to_template() for m in messages], add_generation_prompt=True,
                                        tools=[t.to_template() for t in tools] or None, **kwargs)
        except TemplateError as exc:
            raise RequestError(f"messages: the chat template rejected the conversation: {exc}",
                               400, "messages") from None

    def encode(self, prompt: str) -> list[int]:
        # The rendered text already carries any BOS the template wants, so no special tokens
        # are added here (apply_chat_template(tokenize=True) does the same).
        return self.tokenizer.encode(prompt, add_special=False, parse_special=True)

    def build(self, request: ChatRequest) -> list[int]:
        return self.encode(self.render(request))


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
