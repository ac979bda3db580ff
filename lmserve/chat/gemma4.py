"""Gemma 4's chat format: its markers, and its call notation read back into JSON.

A call is `<|tool_call>call:NAME{key:value,...}<tool_call|>` in the notation the template's
`format_argument` writes: strings between `<|"|>` quotes, numbers, booleans and null bare, objects
`{key:value}` with bare keys, arrays `[...]`. Reasoning is a `<|channel>thought\\n...<channel|>`
block, results come back as `<|tool_response>...<tool_response|>`, and `<|tool_response>` after a
call ends the turn. llama.cpp's converter writes all of these as USER_DEFINED tokens, so they reach
the router as text.

The parser follows llama.cpp's Gemma 4 grammar (common/parsers/gemma4.cpp): a key is anything up to
`:`, spaces may sit between items. mlx-lm's parser (`mlx_lm.tool_parsers.gemma4`) quotes only keys
of word characters right after `{` or `,`, so one key like `file-path` or `$ref`, or a space after a
comma, makes the whole call unreadable; it is not used.
"""

from __future__ import annotations

import json
import re
from typing import Any

CALL_OPEN, CALL_CLOSE, CALL_PREFIX = "<|tool_call>", "<tool_call|>", "call:"
QUOTE = '<|"|>'
THOUGHT_OPEN, CHANNEL_CLOSE = "<|channel>thought", "<channel|>"
TURN_END, MODEL_TURN = "<turn|>\n", "<|turn>model\n"

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")  # JSON's
_NAME = re.compile(r"\s*" + re.escape(CALL_PREFIX) + r"\s*([^{\s]+)\s*(?=\{)")
_BARE = {"true": True, "false": False, "null": None}


class _Reader:
    """A recursive-descent reader over one call body; ValueError where the notation breaks."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0

    def fail(self, what: str) -> ValueError:
        return ValueError(f"Gemma 4 call: expected {what} at {self.text[self.at:self.at + 20]!r}")

    def space(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def take(self, literal: str) -> bool:
        if self.text.startswith(literal, self.at):
            self.at += len(literal)
            return True
        return False

    def value(self) -> Any:
        if self.take(QUOTE):
            end = self.text.find(QUOTE, self.at)
            if end == -1:
                raise self.fail("a closing " + QUOTE)
            value, self.at = self.text[self.at:end], end + len(QUOTE)
            return value
        if self.take("{"):
            return self.members()
        if self.take("["):
            return self.items()
        for word, value in _BARE.items():
            if self.take(word):
                return value
        number = _NUMBER.match(self.text, self.at)
        if number is None:
            raise self.fail("a value")
        self.at = number.end()
        return json.loads(number.group())

    def members(self) -> dict[str, Any]:
        """The rest of an object, after its `{`."""
        out: dict[str, Any] = {}
        self.space()
        if self.take("}"):
            return out
        while True:
            if self.text.startswith(QUOTE, self.at):  # a key the model quoted: read as text
                key = self.value()
            else:
                end = self.text.find(":", self.at)
                if end == -1 or "}" in self.text[self.at:end]:
                    raise self.fail("a key")
                key, self.at = self.text[self.at:end].strip(), end
            if not key or not self.take(":"):
                raise self.fail("a key and ':'")
            self.space()
            out[key] = self.value()
            self.space()
            if self.take("}"):
                return out
            if not self.take(","):
                raise self.fail("',' or '}'")
            self.space()

    def items(self) -> list[Any]:
        """The rest of an array, after its `[`."""
        out: list[Any] = []
        self.space()
        if self.take("]"):
            return out
        while True:
            out.append(self.value())
            self.space()
            if self.take("]"):
                return out
            if not self.take(","):
                raise self.fail("',' or ']'")
            self.space()


def parse_call(body: str, tools: Any = None) -> dict[str, Any]:
    """`call:NAME{...}` (the text between the call markers) as {"name", "arguments"}."""
    head = _NAME.match(body)
    if head is None:
        raise ValueError("Gemma 4 call: expected 'call:NAME{'")
    reader = _Reader(body)
    reader.at = head.end() + 1
    arguments = reader.members()
    if body[reader.at:].strip():
        raise reader.fail("the end of the call")
    return {"name": head.group(1), "arguments": arguments}

