"""Request bodies as typed msgspec Structs: the vocabulary the dialects' schemas share, and decoding
a body (already through `read_json`) into its Struct or one 400 naming the JSON path at fault.

The Structs are both the parser and, through /openapi.json (`http/openapi.py`), the published
schema. Unknown fields are accepted and ignored; `null` reads as absent (every optional field is
`X | None`); an integer field takes an integral float (`5.0`), as JSON does not tell them apart.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import msgspec
import msgspec.inspect as mi
from msgspec import Meta

from lmserve.core.errors import invalid

T = TypeVar("T")

Count = Annotated[int, Meta(ge=1)]
NonNegative = Annotated[int, Meta(ge=0)]
Unit = Annotated[float, Meta(ge=0, le=1)]
NonEmpty = Annotated[str, Meta(min_length=1)]
JsonSchema = dict[str, Any]
Rejected = Annotated[Any, Meta(description="not supported: a request that sets it is refused with a 400")]

_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]*)`")
_BAD_TAG = re.compile(r"Invalid (?:enum )?value '(?P<tag>[^']*)'")
# Non-text content parts and blocks (OpenAI's and Anthropic's names): in no schema, refused as such.
REFUSED = {"image_url": "images", "input_image": "images", "image": "images", "input_audio": "audio",
           "file": "files", "input_file": "files", "document": "documents", "search_result": "search results"}
_type_info = functools.cache(mi.type_info)


def decode(body: dict[str, Any], model: type[T]) -> T:
    """`body` as `model`, or the RequestError of the first field that does not fit."""
    try:
        return msgspec.convert(_whole_numbers(body, _type_info(model)), model, strict=True, str_keys=True)
    except msgspec.ValidationError as exc:
        raise _field_error(str(exc)) from None


def _field_error(text: str) -> Exception:
    """msgspec's "Expected `int`, got `str` - at `$.messages[0].role`" (or "- at `key` in `$.x`")
    as "messages[0].role: expected `int`, got `str`", naming the field."""
    what, _, where = text.partition(" - at `")
    path = where.removeprefix("key` in `").strip("`$").replace("[...]", "").lstrip(".")
    if missing := _MISSING.fullmatch(what):
        path, what = ".".join(p for p in (path, missing["field"]) if p), "is required"
    if (tag := _BAD_TAG.fullmatch(what)) and tag["tag"] in REFUSED and path.endswith("type"):
        return refused(tag["tag"], path)
    return invalid(path or "body", what[:1].lower() + what[1:])


def refused(tag: str, where: str) -> Exception:
    return invalid(where, f"{REFUSED[tag]} are not supported by this text-only model ('{tag}' content)")


def _whole_numbers(value: Any, info: mi.Type) -> Any:
    """Integral floats as ints where a Struct field wants an integer (array items are left alone:
    token ids stay strictly integers, as before)."""
    if isinstance(info, mi.UnionType):
        kinds = [t for t in info.types if not isinstance(t, mi.NoneType)]
        info = kinds[0] if len(kinds) == 1 else info
    if isinstance(info, mi.Metadata):
        info = info.type
    if isinstance(info, mi.IntType) and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(info, mi.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        return {key: _whole_numbers(item, fields[key]) if key in fields else item
                for key, item in value.items()}
    return value


def keep_known(items: Any, dropped: Callable[[str], bool],
               untyped: Callable[[dict[str, Any]], str | None] = lambda item: None) -> Any:
    """A list of `type`-tagged objects whose tag set is open (a tagged union has no catch-all):
    an object of a dropped type becomes null (the schema's "accepted and dropped"), one without a
    `type` gets `untyped(item)` when that names one. Anything else is left for the schema to judge."""
    if not isinstance(items, list):
        return items
    out = []
    for item in items:
        if isinstance(item, dict):
            kind = item.get("type", untyped(item))
            if "type" not in item and kind is not None:
                item = {**item, "type": kind}
            if isinstance(kind, str) and dropped(kind):
                item = None
        out.append(item)
    return out
