"""The OpenAPI document (`app.openapi()`, /openapi.json): FastAPI's, completed with what
it cannot see from the routes.

- Every status an operation can answer, with OpenAI's error body: 400 where a parameter
  or body can be refused (the app answers validation failures with 400, never 422), 401
  and 403 where the route authenticates (every such route also checks a scope or an
  admin key), 413 where the body limit applies; routes declare the rest themselves
  (`responses=error_responses(...)`).
- The bearer key as a security scheme, on exactly the operations that read it.
- Request bodies that routes parse themselves (`request_body`) and the events of
  streamed responses (`event_stream`), with their models under #/components/schemas
  like every other model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, Protocol, cast

from fastapi import FastAPI, routing
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel

from app.api.deps import ACT_FOR_TENANT_HEADER, get_principal
from app.api.errors import ErrorResponse

REF_PREFIX = "#/components/schemas/"
BEARER_SCHEME = "bearerAuth"
ERROR_SCHEMA = "ErrorResponse"

ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Invalid request (`invalid_request_error`, with the offending `param`)",
    401: "Missing, malformed, unknown, expired or revoked API key (`invalid_api_key`)",
    403: "The key may not use this route (an admin key or a scope is needed)",
    404: "Not found, or not visible to this key (`model_not_found`, `not_found`)",
    409: "Conflicts with the current state (`conflict`)",
    413: "The request body is over the limit (`request_too_large`)",
    422: "The uploaded adapter is not a valid PEFT adapter for the base model "
    "(`invalid_adapter`)",
    429: "A rate limit or quota of the tenant (`rate_limit_exceeded`, `insufficient_quota`)",
    502: "The engine worker running the request failed (`worker_lost`)",
    503: "Overloaded, starting or draining (`overloaded`); retry after `Retry-After`",
    504: "The request timed out before generation finished (`timeout`)",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait", "schema": {"type": "integer"}}}
_HEADERS: dict[int, dict[str, Any]] = {429: _RETRY_AFTER, 503: _RETRY_AFTER}
# RequestContextMiddleware applies the body limit to these.
_METHODS_WITH_BODY = frozenset({"post", "put", "patch"})
JsonSchemaMode = Literal["validation", "serialization"]
# Models that operations refer to without FastAPI knowing (request_body, event_stream),
# by name; build_document adds them to the components.
_REFERRED: dict[str, tuple[type[BaseModel], JsonSchemaMode]] = {}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: each status with OpenAI's error body."""
    return {status: _error_response(status) for status in statuses}


def _error_response(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": ERROR_DESCRIPTIONS[status],
        "content": {"application/json": {"schema": {"$ref": REF_PREFIX + ERROR_SCHEMA}}},
    }
    if status in _HEADERS:
        response["headers"] = _HEADERS[status]
    return response


def request_body(model: type[BaseModel], media_type: str = "application/json") -> dict[str, Any]:
    """A route's `openapi_extra=` for a body the route reads itself (see read_body)."""
    schema = _refer(model, "validation")
    return {"requestBody": {"required": True, "content": {media_type: {"schema": schema}}}}


def event_stream(chunk: type[BaseModel], description: str) -> dict[str, Any]:
    """The `text/event-stream` content of a streamed response: the schema of one event,
    whose `data` is a JSON `chunk`, `[DONE]` for the last one, or an error body when the
    request failed after the stream began (a timeout, a lost worker, a refusal by the
    engine)."""
    data = {"anyOf": [
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": _refer(chunk, "serialization")},
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": {"$ref": REF_PREFIX + ERROR_SCHEMA}},
        {"const": "[DONE]"},
    ]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data},
             "description": description}
    return {"text/event-stream": {"schema": event}}


def _refer(model: type[BaseModel], mode: JsonSchemaMode) -> dict[str, str]:
    name = model.__name__
    assert _REFERRED.setdefault(name, (model, mode)) == (model, mode), f"two {name} schemas"
    return {"$ref": REF_PREFIX + name}


def act_for_tenant_parameter() -> dict[str, Any]:
    """A route's `openapi_extra=` for the header get_serving_caller reads itself."""
    return {"parameters": [{
        "name": ACT_FOR_TENANT_HEADER,
        "in": "header",
        "required": False,
        "description": "Admin keys only: act for this tenant (its id), with its adapters",
        "schema": {"type": "string"},
    }]}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_document(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(
        title=app.title,
        version=app.version,
        openapi_version=app.openapi_version,
        description=app.description,
        routes=app.routes,
    )
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    _add_schema(schemas, ErrorResponse, "serialization")
    for model, mode in _REFERRED.values():
        _add_schema(schemas, model, mode)
    components["securitySchemes"] = {
        BEARER_SCHEME: {
            "type": "http",
            "scheme": "bearer",
            "description": "A tenant key (`lpx_t_...`) or an admin key",
        }
    }
    for route in _api_routes(app):
        if not route.include_in_schema:
            continue
        for method in route.methods:
            operation = doc["paths"][route.path_format][method.lower()]
            _complete(operation, method.lower(), authenticated=_authenticates(route.dependant))
    for name in ("HTTPValidationError", "ValidationError"):
        if not _refers_to(doc["paths"], REF_PREFIX + name):
            schemas.pop(name, None)
    return doc


def _complete(operation: dict[str, Any], method: str, *, authenticated: bool) -> None:
    responses = operation["responses"]
    statuses: set[int] = set()
    validation = responses.get("422", {}).get("content", {}).get("application/json", {})
    if validation.get("schema", {}).get("$ref") == REF_PREFIX + "HTTPValidationError":
        # FastAPI's own; the app answers validation failures with OpenAI's 400 instead.
        del responses["422"]
    if _can_be_refused(operation):
        statuses.add(400)
    if authenticated:
        statuses |= {401, 403}
        operation["security"] = [{BEARER_SCHEME: []}]
    if method in _METHODS_WITH_BODY:
        statuses.add(413)
    for status in sorted(statuses):
        responses.setdefault(str(status), _error_response(status))
    operation["responses"] = dict(sorted(responses.items()))


def _can_be_refused(operation: dict[str, Any]) -> bool:
    """Whether a parameter or the body can fail validation. An optional string parameter
    cannot: every value is a string; a path parameter is never missing."""
    if "requestBody" in operation:
        return True
    return any(
        parameter["in"] != "path"
        and (parameter.get("required", False) or not _any_string(parameter.get("schema", {})))
        for parameter in operation.get("parameters", [])
    )


def _any_string(schema: dict[str, Any]) -> bool:
    if set(schema) - {"type", "anyOf", "title", "description", "default"}:
        return False  # a pattern, an enum, a length
    kinds = schema.get("anyOf", [schema])
    return all(kind == {"type": "string"} or kind == {"type": "null"} for kind in kinds)


class _Route(Protocol):
    path_format: str
    methods: set[str]
    dependant: Dependant
    include_in_schema: bool


def _api_routes(app: FastAPI) -> Iterator[_Route]:
    """The app's API routes with their full paths, as FastAPI documents them."""
    iter_route_contexts = getattr(routing, "iter_route_contexts", None)
    if iter_route_contexts is None:
        # FastAPI before route contexts copies included routes onto the app, prefixed.
        routes = [r for r in app.routes if isinstance(r, APIRoute)]
    else:
        # NOTE: since route contexts an included router stays one entry of app.routes;
        # a context is its route seen with the include's prefix and dependencies.
        routes = [c for c in iter_route_contexts(app.routes)
                  if isinstance(c.original_route, APIRoute)]
    for route in routes:
        yield cast(_Route, route)


def _authenticates(dependant: Dependant) -> bool:
    return any(d.call is get_principal for d in _dependencies(dependant))


def _dependencies(dependant: Dependant) -> Iterator[Dependant]:
    for sub in dependant.dependencies:
        yield sub
        yield from _dependencies(sub)


def _add_schema(schemas: dict[str, Any], model: type[BaseModel], mode: JsonSchemaMode) -> None:
    schema = model.model_json_schema(ref_template=REF_PREFIX + "{model}", mode=mode)
    for name, definition in schema.pop("$defs", {}).items():
        _put(schemas, name, definition)
    _put(schemas, model.__name__, schema)


def _put(schemas: dict[str, Any], name: str, schema: dict[str, Any]) -> None:
    """Add a component; one FastAPI already wrote stays (it words defaults differently)."""
    known = schemas.setdefault(name, schema)
    assert _shape(known) == _shape(schema), f"two different schemas named {name!r}"


def _shape(schema: dict[str, Any]) -> tuple[object, ...]:
    return (schema.get("type"), sorted(schema.get("properties", {})), schema.get("enum"))


def _refers_to(node: object, ref: str) -> bool:
    if isinstance(node, dict):
        return node.get("$ref") == ref or any(_refers_to(v, ref) for v in node.values())
    if isinstance(node, list):
        return any(_refers_to(v, ref) for v in node)
    return False
