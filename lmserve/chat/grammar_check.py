"""Grammars whose language is empty: llguidance compiles `start: "a" start` (or GBNF's
`root ::= root "a"`, or a JSON schema whose required property refers back to itself) and then lets
the model write forever, for no string of the grammar ever ends. Such a grammar is refused (400)
before anything runs.

The check is a productivity analysis (a rule is productive when one of its alternatives is made
of terminals and productive rules only), on Lark source (GBNF arrives as Lark through
`llguidance.gbnf_to_lark`) and on JSON schemas. It errs one way only: whatever it cannot read is
taken as productive, so it never refuses a grammar llguidance would finish.
"""

from __future__ import annotations

import re
from typing import Any

from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

_RULE = re.compile(r"^\s*\??([A-Za-z_][\w]*)(?:\.-?\d+)?\s*:(.*)$")
_TOKEN = re.compile(r'''
    (?P<string>"(?:\\.|[^"\\])*"i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<name>[A-Za-z_][\w]*)
  | (?P<range>~\s*\d+(?:\s*\.\.\s*\d+)?)
  | (?P<op>[()\[\]|?*+])
  | (?P<special><[^>]*>)
  | (?P<alias>->\s*[A-Za-z_]\w*)
  | (?P<comment>//[^\n]*)
  | (?P<space>\s+)
''', re.VERBOSE)
Item = tuple[str, Any]  # ("t", None) a terminal, ("r", name) a rule, ("alt", alternatives) a group, ("any", None) anything else


def empty_lark(source: str) -> str | None:
    """The start rule's name when no string of a Lark grammar can ever end, else None."""
    rules = _rules(source)
    if rules is None or "start" not in rules:
        return None
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alternatives in rules.items():
            if name not in productive and any(_finishes(seq, productive, rules) for seq in alternatives):
                productive.add(name)
                changed = True
    return None if "start" in productive else "start"


def empty_gbnf(source: str) -> str | None:
    """The same for a `grammar` field's text: GBNF (its `root` rule, named as such) or Lark."""
    if is_lark_syntax(source):
        return empty_lark(source)
    try:
        return "root" if empty_lark(gbnf_to_lark(source)) else None
    except Exception:  # noqa: BLE001  (its own errors are llguidance's to report)
        return None


def _finishes(seq: list[Item], productive: set[str], rules: dict[str, Any]) -> bool:
    """Whether a sequence can end, given the rules known to; a rule defined elsewhere (imported)
    is taken as able to."""
    for kind, value in seq:
        if kind == "r" and value in rules and value not in productive:
            return False
        if kind == "alt" and not any(_finishes(s, productive, rules) for s in value):
            return False
    return True


def _rules(source: str) -> dict[str, list[list[Item]]] | None:
    """Each rule's alternatives as item sequences, or None when the source is not plain Lark rules."""
    rules: dict[str, list[list[Item]]] = {}
    name, body = None, ""
    for line in source.splitlines():
        if not line.strip() or line.lstrip().startswith(("%", "//")):
            if line.lstrip().startswith("%") and "{" in line and "}" not in line:
                return None  # a multi-line directive block: not read here
            continue
        match = _RULE.match(line)
        if match and not line.lstrip().startswith("|"):
            if name is not None:
                rules.setdefault(name, []).extend(_alternatives(body) or [[("any", None)]])
            name, body = match.group(1), match.group(2)
        elif name is not None:
            body += "\n" + line
        else:
            return None
    if name is not None:
        rules.setdefault(name, []).extend(_alternatives(body) or [[("any", None)]])
    return rules


def _alternatives(body: str) -> list[list[Item]] | None:
    tokens = []
    pos = 0
    while pos < len(body):
        match = _TOKEN.match(body, pos)
        if match is None:
            return None  # something this reader does not know (%json {...}, ...): taken as productive
        pos = match.end()
        kind = match.lastgroup
        if kind not in ("space", "alias", "comment"):
            tokens.append((kind, match.group()))
    items, rest = _sequence_alternatives(tokens, 0)
    return items if rest == len(tokens) else None


def _sequence_alternatives(tokens: list[tuple[str, str]], i: int) -> tuple[list[list[Item]], int]:
    """Alternatives from `i` to a closing bracket or the end; returns them and where they stop."""
    alternatives: list[list[Item]] = [[]]
    while i < len(tokens):
        kind, text = tokens[i]
        if kind == "op" and text in ")]":
            return alternatives, i
        if kind == "op" and text == "|":
            alternatives.append([])
            i += 1
            continue
        if kind == "op" and text in "([":
            inner, end = _sequence_alternatives(tokens, i + 1)
            if end >= len(tokens):
                return alternatives, len(tokens) + 1  # unbalanced: the caller gives up
            item: Item = ("t", None) if text == "[" else ("alt", inner)
            i = end + 1
        elif kind == "name":
            item = ("r", text)
            i += 1
        elif kind in ("string", "regex", "special"):
            item = ("t", None)
            i += 1
        else:
            return alternatives, len(tokens) + 1
        if i < len(tokens) and tokens[i][0] == "op" and tokens[i][1] in "?*":
            item, i = ("t", None), i + 1  # may be left out
        elif i < len(tokens) and tokens[i][0] == "op" and tokens[i][1] == "+":
            i += 1
        elif i < len(tokens) and tokens[i][0] == "range":
            if re.match(r"~\s*0\b", tokens[i][1]):
                item = ("t", None)
            i += 1
        alternatives[-1].append(item)
    return alternatives, i


def empty_schema(schema: Any) -> bool:
    """Whether no JSON value can satisfy `schema`'s required structure: a required property, item
    or every branch of a choice leads back to where it started (a `$ref` cycle), or `false`."""
    return not _satisfiable(schema, schema, frozenset())


def _satisfiable(node: Any, root: Any, path: frozenset[str]) -> bool:
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        if ref in path:
            return False  # recursion without a way out along this path
        target = _resolve(root, ref)
        if target is not None and not _satisfiable(target, root, path | {ref}):
            return False
    if isinstance(node.get("enum"), list) and not node["enum"]:
        return False
    if not all(_satisfiable(s, root, path) for s in node.get("allOf", []) if isinstance(node.get("allOf"), list)):
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not any(_satisfiable(s, root, path) for s in branches):
            return False
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    if any(name in properties and not _satisfiable(properties[name], root, path) for name in required
           if isinstance(name, str)):
        return False
    items = node.get("items")
    min_items = node.get("minItems")
    return not (isinstance(min_items, int) and min_items > 0 and not _satisfiable(items, root, path))


def _resolve(root: Any, ref: str) -> Any:
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
