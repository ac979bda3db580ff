"""Normalized chat request -> prompt token ids, through the model's own chat template."""

from __future__ import annotations

from lmserve.core.errors import RequestError
from lmserve.core.types import ChatRequest
from lmserve.model.chat_template import ChatTemplate, TemplateError
from lmserve.model.tokenizer import Tokenizer


class PromptBuilder:
    """Renders messages with the chat template and tokenizes them as Hugging Face does."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self.tokenizer = tokenizer
        self.template = template

    def render(self, request: ChatRequest) -> str:
        messages = [m.to_template() for m in request.messages]
        try:
            return self.template.render(messages, add_generation_prompt=True,
                                        tools=request.tools or None, **request.template_kwargs)
        except TemplateError as exc:
            raise RequestError(f"messages: the chat template rejected the conversation: {exc}",
                               400, "messages") from None

    def build(self, request: ChatRequest) -> list[int]:
        # The rendered text already carries any BOS the template wants, so no special tokens
        # are added here (apply_chat_template(tokenize=True) does the same).
        return self.tokenizer.encode(self.render(request), add_special=False, parse_special=True)
