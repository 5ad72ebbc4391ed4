"""The OpenAPI document (`app.openapi()`): valid, self-contained, with the bearer scheme on
the keyed routes, the statuses each operation really answers, and the sampling ranges
that the server enforces, checked against the server itself."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openapi_spec_validator import validate

from app.main import openapi_document
from tests.utils.fake_engine import FakeEngine, make_app
from tests.utils.live_server import serve_in_thread

MODEL = "fake-model"
REF = "#/components/schemas/"
GENERATION = ("/v1/completions", "/v1/chat/completions")
UPLOADS = (("/admin/adapters", "post"), ("/v1/adapters", "post"))
IMPORTS = (("/v1/load_lora_adapter", "post"), ("/admin/adapters/import", "post"))
UNKEYED = ("/health", "/ready", "/metrics")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    app, _ = make_app(FakeEngine(model_id=MODEL, max_model_len=4096))
    return app.openapi()


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    app, _ = make_app(FakeEngine(model_id=MODEL, max_model_len=4096))
    with serve_in_thread(app) as url:
        yield url


def operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            yield path, method, operation


def refs(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"{ref} points outside the document"
    node: Any = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"{ref} does not resolve"
        node = node[part]
    return node


def field_schema(doc: dict[str, Any], model: str, field: str) -> dict[str, Any]:
    """The non-null branch of an optional field's schema."""
    schema = doc["components"]["schemas"][model]["properties"][field]
    branches = [s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"]
    assert len(branches) == 1, schema
    return dict(branches[0])


def test_the_document_is_valid_openapi(doc: dict[str, Any]) -> None:
    validate(doc)
    assert doc["openapi"].startswith("3.1")


def test_the_document_needs_no_running_service(doc: dict[str, Any]) -> None:
    assert openapi_document() == doc


def test_every_ref_resolves_inside_the_document(doc: dict[str, Any]) -> None:
    found = list(refs(doc))
    assert len(found) > 50
    for ref in found:
        resolve(doc, ref)
    # The generation bodies' nested models are components like every other model.
    schemas = doc["components"]["schemas"]
    for name in ("ContentPart", "ChatMessage", "StreamOptions", "ErrorResponse", "ErrorInfo"):
        assert name in schemas, name


def test_generation_routes_declare_their_json_bodies(doc: dict[str, Any]) -> None:
    for path, model in zip(GENERATION, ("CompletionRequest", "ChatCompletionRequest"),
                           strict=True):
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": REF + model}
    required = set(doc["components"]["schemas"]["ChatCompletionRequest"]["required"])
    assert required == {"model", "messages"}
    for path, _ in UPLOADS:
        body = doc["paths"][path]["post"]["requestBody"]
        form = resolve(doc, body["content"]["multipart/form-data"]["schema"]["$ref"])
        assert form["properties"]["file"] == {"type": "string", "format": "binary",
                                              "title": "File"}


def test_bearer_security_on_keyed_routes_only(doc: dict[str, Any]) -> None:
    schemes = doc["components"]["securitySchemes"]
    assert schemes == {"bearerAuth": {
        "type": "http", "scheme": "bearer", "description": schemes["bearerAuth"]["description"]
    }}
    keyed = 0
    for path, method, operation in operations(doc):
        if path == "/metrics":  # a bearer token only where LORAPLEX_METRICS_TOKEN is set
            assert operation["security"] == [{}, {"bearerAuth": []}]
            assert set(operation["responses"]) == {"200", "401"}
        elif path in UNKEYED:
            assert "security" not in operation, (method, path)
            assert "401" not in operation["responses"], (method, path)
        else:
            assert path.startswith(("/v1/", "/admin/")), path
            assert operation.get("security") == [{"bearerAuth": []}], (method, path)
            assert {"401", "403"} <= set(operation["responses"]), (method, path)
            keyed += 1
    assert keyed >= 30
    assert set(UNKEYED) <= set(doc["paths"])


def test_no_422_documented_where_none_is_sent(doc: dict[str, Any]) -> None:
    for path, method, operation in operations(doc):
        # a valid archive or adapter directory that is not a usable adapter
        if (path, method) in UPLOADS + IMPORTS:
            assert "422" in operation["responses"], (method, path)
        else:
            assert "422" not in operation["responses"], (method, path)
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def test_error_statuses_carry_the_openai_error_body(doc: dict[str, Any]) -> None:
    error = doc["components"]["schemas"]["ErrorResponse"]
    assert error["required"] == ["error"]
    info = resolve(doc, error["properties"]["error"]["$ref"])
    assert set(info["properties"]) == {"message", "type", "param", "code"}
    for path, method, operation in operations(doc):
        for status, response in operation["responses"].items():
            if int(status) < 400 or path in UNKEYED:
                continue
            schema = response["content"]["application/json"]["schema"]
            assert schema == {"$ref": REF + "ErrorResponse"}, (method, path, status)


@pytest.mark.parametrize(("method", "path", "statuses"), [
    ("post", "/v1/completions", {200, 400, 401, 403, 404, 413, 429, 503}),
    ("post", "/v1/chat/completions", {200, 400, 401, 403, 404, 413, 429, 503}),
    ("get", "/v1/models", {200, 401, 403, 404}),
    ("get", "/v1/usage", {200, 400, 401, 403}),
    ("post", "/admin/tenants", {201, 400, 401, 403, 409, 413}),
    ("patch", "/admin/tenants/{tenant_id}", {200, 400, 401, 403, 404, 409, 413}),
    ("delete", "/admin/tenants/{tenant_id}", {204, 401, 403, 404}),
    ("delete", "/admin/keys/{key_id}", {204, 401, 403, 404}),
    ("post", "/admin/adapters", {201, 400, 401, 403, 404, 409, 413, 422}),
    ("get", "/admin/engine", {200, 401, 403}),
    ("get", "/ready", {200, 503}),
])
def test_statuses_per_operation(
    doc: dict[str, Any], method: str, path: str, statuses: set[int]
) -> None:
    documented = {int(s) for s in doc["paths"][path][method]["responses"]}
    assert statuses <= documented


def test_400_only_where_a_parameter_or_body_can_be_refused(doc: dict[str, Any]) -> None:
    for path, method in [("/admin/engine", "get"), ("/admin/keys", "get"),
                         ("/admin/tenants/{tenant_id}", "get"), ("/v1/models", "get")]:
        assert "400" not in doc["paths"][path][method]["responses"], (method, path)
    assert "400" in doc["paths"]["/admin/audit"]["get"]["responses"]  # limit: an integer


def test_streams_and_metrics_have_their_content_types(doc: dict[str, Any]) -> None:
    for path in GENERATION:
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert set(metrics) == {"text/plain"}


# (model, field, documented bounds); chat and completions share GenerationFields.
BOUNDS: list[tuple[str, str, dict[str, float]]] = [
    ("CompletionRequest", "temperature", {"minimum": 0, "maximum": 2}),
    ("CompletionRequest", "top_p", {"exclusiveMinimum": 0, "maximum": 1}),
    ("CompletionRequest", "top_k", {"minimum": -1}),
    ("CompletionRequest", "n", {"minimum": 1, "maximum": 16}),
    ("CompletionRequest", "presence_penalty", {"minimum": -2, "maximum": 2}),
    ("CompletionRequest", "frequency_penalty", {"minimum": -2, "maximum": 2}),
    ("CompletionRequest", "repetition_penalty", {"minimum": 0.01, "maximum": 100}),
    ("CompletionRequest", "priority", {"minimum": 0}),
    ("CompletionRequest", "seed", {"minimum": INT64_MIN, "maximum": INT64_MAX - 16}),
    # 0 with echo (the base body below echoes): the prompt and its logprobs alone.
    ("CompletionRequest", "max_tokens", {"minimum": 0}),
    ("CompletionRequest", "logprobs", {"minimum": 0, "maximum": 5}),
    ("CompletionRequest", "prompt_logprobs", {"minimum": 0, "maximum": 20}),
    ("ChatCompletionRequest", "temperature", {"minimum": 0, "maximum": 2}),
    ("ChatCompletionRequest", "top_p", {"exclusiveMinimum": 0, "maximum": 1}),
    ("ChatCompletionRequest", "max_tokens", {"minimum": 1}),
    ("ChatCompletionRequest", "max_completion_tokens", {"minimum": 1}),
    ("ChatCompletionRequest", "top_logprobs", {"minimum": 0, "maximum": 20}),
    ("ChatCompletionRequest", "prompt_logprobs", {"minimum": 0, "maximum": 20}),
]

BOUND_IDS = [f"{model}.{field}" for model, field, _ in BOUNDS]


@pytest.mark.parametrize(("model", "field", "bounds"), BOUNDS, ids=BOUND_IDS)
def test_sampling_bounds_are_documented(
    doc: dict[str, Any], model: str, field: str, bounds: dict[str, float]
) -> None:
    schema = field_schema(doc, model, field)
    assert {k: schema[k] for k in ("minimum", "maximum", "exclusiveMinimum") if k in schema} \
        == bounds
    assert schema["type"] in ("number", "integer")


RANGE_CODES = {f"{kind}_{side}_value" for kind in ("integer", "decimal")
               for side in ("below_min", "above_max")}


def _base_body(model: str) -> dict[str, Any]:
    if model == "CompletionRequest":
        return {"model": MODEL, "prompt": "hello", "max_tokens": 2, "echo": True}
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "logprobs": True}


def _outside(schema: dict[str, Any]) -> list[float]:
    """Values just past each documented bound."""
    integer = schema["type"] == "integer"
    values: list[float] = []
    if "minimum" in schema:
        low = schema["minimum"]
        values.append(low - 1 if integer else math.nextafter(low, -math.inf))
    if "exclusiveMinimum" in schema:
        values.append(schema["exclusiveMinimum"])
    if "maximum" in schema:
        high = schema["maximum"]
        values.append(high + 1 if integer else math.nextafter(high, math.inf))
    return values


def _inside(schema: dict[str, Any]) -> list[float]:
    """The documented bounds themselves (the smallest value above an exclusive one)."""
    values = [schema[k] for k in ("minimum", "maximum") if k in schema]
    if "exclusiveMinimum" in schema:
        values.append(math.nextafter(schema["exclusiveMinimum"], math.inf))
    return values


@pytest.mark.parametrize(("model", "field", "bounds"), BOUNDS, ids=BOUND_IDS)
def test_documented_bounds_are_what_the_server_enforces(
    doc: dict[str, Any], base_url: str, model: str, field: str, bounds: dict[str, float]
) -> None:
    schema = field_schema(doc, model, field)
    path = GENERATION[0] if model == "CompletionRequest" else GENERATION[1]
    with httpx.Client(base_url=base_url, timeout=30) as client:
        for value in _outside(schema):
            response = client.post(path, json={**_base_body(model), field: value})
            assert response.status_code == 400, (field, value, response.text)
            error = response.json()["error"]
            assert error["param"] == field, (value, response.text)
            # planning.py's range check, not a pydantic constraint's generic message.
            assert error["code"] in RANGE_CODES, (value, response.text)
        for value in _inside(schema):
            response = client.post(path, json={**_base_body(model), field: value})
            assert response.status_code == 200, (field, value, response.text)
