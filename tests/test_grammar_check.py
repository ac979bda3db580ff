"""The emptiness check on grammars (chat/grammar_check.py): a Lark or GBNF grammar, or a JSON
schema, of which no string can ever end is found out; one with a way out, or one the reader does
not understand, is never refused."""

from __future__ import annotations

import pytest

from lmserve.chat.grammar_check import empty_gbnf, empty_lark, empty_schema

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`


@pytest.mark.parametrize(("source", "empty"), [
    ('start: "a" start', True),
    ('start: x\nx: "a" x', True),
    ('start: ["a"] start', True),
    ('start: item+\nitem: item "x"', True),
    ('start: A\nA: "a" A', True),
    ('start: "http://x" start', True),
    ('start: "a"+', False),
    ('start: "a" start | "b"', False),
    ('start: x // a comment\nx: "a" x // another\n   | y\ny: /[0-9]+/', False),
    ('start: ("a" | start) "b"', False),
    ('start: item*\nitem: item "x"', False),
    ('start: imported', False),  # defined elsewhere: taken as able to end
    ('%llguidance {}\nstart: %json { "type": "object" }', False),  # not read here: never refused
    ('start: /a\\/b/ | start', False),
])
def test_lark(source: str, empty: bool) -> None:
    assert (empty_lark(source) is not None) == empty


def test_gbnf() -> None:
    assert empty_gbnf('root ::= root "a"') == "root"
    assert empty_gbnf('root ::= "a" root | "b"') is None
    assert empty_gbnf('start: "a" start') == "start"  # the `grammar` field takes Lark too


def test_json_schema() -> None:
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}
    assert empty_schema({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})
    assert empty_schema({"$defs": {"node": node}, "$ref": "#/$defs/node"})
    assert empty_schema({"type": "array", "items": {"$ref": "#"}, "minItems": 1})
    assert not empty_schema({"type": "object", "properties": {"a": {"$ref": "#"}}})  # optional: a way out
    linked = {**node, "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}
    assert not empty_schema({"$defs": {"node": linked}, "$ref": "#/$defs/node"})
    assert not empty_schema({"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]})
