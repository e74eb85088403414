"""The request bodies in the API's OpenAPI schema. The routes read their bodies themselves (to
bound and shape every error), so FastAPI cannot describe them; this adds what they accept, for
clients' code generators and for the schema-driven fuzzer in CI (tests/test_server_admin.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from celerytp.server.responses import ResponsesRequest
from celerytp.server.schemas import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

REFS = "#/components/schemas/{model}"


def admin_load_schema(ints: dict[str, int], strings: tuple[str, ...]) -> dict[str, Any]:
    """An admin load's body as `load_fields` (server/http.py) checks it."""
    properties: dict[str, Any] = {
        "model": {"type": "string", "minLength": 1, "maxLength": 256},
        "path": {"type": "string", "minLength": 1, "maxLength": 4096, "description": "absolute, under the model roots"},
    }
    properties |= {name: {"type": "integer", "minimum": 1, "maximum": limit} for name, limit in ints.items()}
    properties |= {name: {"type": "string", "minLength": 1, "maxLength": 32} for name in strings}
    return {"type": "object", "properties": properties, "required": ["model"], "additionalProperties": False}


def with_request_bodies(schema: dict[str, Any], admin_load: dict[str, Any]) -> dict[str, Any]:
    """`schema` (FastAPI's, modified in place) with the JSON body of each POST route."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})

    def body(path: str, described: dict[str, Any]) -> None:
        if path in schema["paths"]:
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": described}}}

    def model_ref(model: type[BaseModel]) -> dict[str, Any]:
        described = model.model_json_schema(ref_template=REFS)
        components.update(described.pop("$defs", {}))
        components[model.__name__] = described
        return {"$ref": REFS.format(model=model.__name__)}

    body("/v1/completions", model_ref(CompletionRequest))
    body("/v1/chat/completions", model_ref(ChatRequest))
    body("/tokenize", model_ref(TokenizeRequest))
    body("/detokenize", model_ref(DetokenizeRequest))
    body("/v1/responses", model_ref(ResponsesRequest))
    body("/admin/models", admin_load)
    return schema
