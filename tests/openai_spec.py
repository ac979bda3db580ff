"""Validate bodies and stream frames against OpenAI's own OpenAPI spec (tests/data/specs).

The spec under-declares nullability in places where OpenAI's servers (and the spec's own
examples) send null; each such place is patched here, once, with the reason next to it.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.conftest import SPECS

SPEC_URI = "https://spec.openai.local/openapi.json"


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


@cache
def _registry() -> Registry:
    spec = json.loads((SPECS / "openai-openapi.json").read_text())
    schemas = spec["components"]["schemas"]
    # Response.usage is a plain $ref to ResponseUsage, yet response.created / in_progress / failed
    # carry "usage": null (the spec's own examples for those events show it).
    response = next(part for part in schemas["Response"]["allOf"] if "usage" in part.get("properties", {}))
    response["properties"]["usage"] = _nullable(response["properties"]["usage"])
    return Registry().with_resource(SPEC_URI, Resource(spec, DRAFT202012))


@cache
def _validator(schema_name: str) -> jsonschema.Draft202012Validator:
    ref = {"$ref": f"{SPEC_URI}#/components/schemas/{schema_name}"}
    return jsonschema.Draft202012Validator(ref, registry=_registry())


def validate(schema_name: str, instance: Any) -> None:
    """Raise, listing each violation at its deepest cause, when `instance` breaks the schema."""
    errors = list(_validator(schema_name).iter_errors(instance))
    if errors:
        best = [jsonschema.exceptions.best_match([e]) for e in errors]
        details = "\n".join(f"{list(e.absolute_path)}: {e.message[:300]}" for e in best)
        raise AssertionError(f"{schema_name} violated:\n{details}")
