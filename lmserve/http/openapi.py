"""The OpenAPI document at /openapi.json: Litestar generates paths and operations; each POST
route's request body is the JSON schema of the Struct its handler decodes (`http/structs.py`).

Handlers read their bodies themselves (so that every error is a 400 in the dialect's envelope
naming the field), which leaves Litestar nothing to infer a body from: each route names its Struct
through its `operation_class`, and the schemas msgspec derives from it go into the document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import msgspec
from litestar import Request
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.openapi.spec import OpenAPIMediaType, Operation, RequestBody, Schema

from lmserve import __version__

Json = dict[str, Any]
REF = "#/components/schemas/{name}"
_components: dict[str, Json] = {}  # the Structs request bodies nest, by name: every route's


def json_body(model: type[msgspec.Struct]) -> type[Operation]:
    """An Operation class declaring `model`'s schema as the route's JSON request body."""
    _, components = msgspec.json.schema_components([model], ref_template=REF)
    schema = components.pop(model.__name__)
    _components.update(components)

    @dataclass
    class BodyOperation(Operation):
        def __post_init__(self) -> None:
            # A plain dict renders as written; Litestar's Schema dataclass would need a conversion.
            media = OpenAPIMediaType(schema=cast(Schema, schema))
            self.request_body = RequestBody(content={"application/json": media}, required=True)

    return BodyOperation


class _Document(JsonRenderPlugin):
    """The document with the bodies' nested schemas added to `components.schemas`, which
    Litestar fills from the types it inferred itself (none of ours)."""

    def render(self, request: Request, openapi_schema: Json) -> bytes:
        components = openapi_schema.get("components", {})
        schemas = {**components.get("schemas", {}), **_components}
        return self.render_json(request, {**openapi_schema, "components": {**components, "schemas": schemas}})


def openapi_config() -> OpenAPIConfig:
    """The JSON document only, at /openapi.json (no HTML viewer: those load scripts from a CDN)."""
    return OpenAPIConfig(title="lmserve", version=__version__, path="/openapi.json",
                         render_plugins=[_Document(path="/")])
