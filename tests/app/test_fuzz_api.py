"""Schemathesis against the app's own OpenAPI document (/openapi.json), over real HTTP,
with the real engine on a tiny random model, a tenant key and an admin key: no request
the document allows, or the fuzzer bends out of it, gets a 5xx, an undocumented status,
a body off its schema or an undocumented content type.

Generated requests are steered at objects the test made (the tenant's adapter as
`model`, real ids in paths) most of the time and left random otherwise, so that both
the found and the not-found paths run; destructive admin operations only ever get
objects made for them, never the tenant and adapter the rest of the run uses.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import settings
from jsonschema import Draft202012Validator
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    response_schema_conformance,
    status_code_conformance,
)

from app.api.deps import ACT_FOR_TENANT_HEADER
from app.main import openapi_document
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.real_service import real_service
from tests.utils.saas import (
    ADMIN_KEY,
    bearer,
    create_key,
    create_tenant,
    upload_adapter,
)

pytestmark = pytest.mark.slow

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    ignored_auth,
]
# NOTE: generation on the real engine is the slow part; the tenant's max_tokens quota
# bounds its requests (an omitted max_tokens defaults to it, a larger one is a 400),
# `steer` folds explicit values into it so that most generated requests still run, and
# gives the admin's requests (no quota) an explicit one.
MAX_NEW_TOKENS = 4
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
GENERATION_EXAMPLES = 100
OTHER_EXAMPLES = 30
ADAPTER = "fuzz-lora"
GENERATION_PATHS = r"^/v1/((chat/)?completions|responses)$"
KEEP_GENERATED = 5
PLAN = {"name": "fuzz-plan", "currency": "USD", "prompt_per_mtok": "1", "completion_per_mtok":
        "2", "cached_prompt_per_mtok": "0.5", "adapter_month": "0", "monthly_minimum": "0"}


@dataclass
class Service:
    """The running app and what the test made in it."""

    base_url: str
    admin: httpx.Client
    model_id: str
    tenant_id: str  # the tenant whose key calls /v1/*; never an admin operation's target
    tenant_key: str
    # Path parameter -> a real value for reading operations, and a maker of a fresh target
    # for destructive ones (each call may make a new object).
    readable: dict[str, str] = field(default_factory=dict)
    victims: dict[str, Callable[[], str]] = field(default_factory=dict)
    _victim_tenant: str | None = None
    _turn: int = 0

    def pick(self, choices: list[str]) -> str | None:
        """Each of `choices` in turn, and every KEEP_GENERATED-th time None (keep what was
        generated); the same sequence in every run, as the cases are derandomized too."""
        self._turn += 1
        if self._turn % KEEP_GENERATED == 0:
            return None
        return choices[self._turn % len(choices)]

    def victim_tenant(self) -> str:
        """A live tenant made to be patched, given keys and deleted (a new one once the
        fuzzer deleted the last)."""
        if self._victim_tenant is None:
            name = f"victim-{datetime.now(UTC):%H%M%S%f}"
            self._victim_tenant = str(create_tenant(self.admin, name)["id"])
        return self._victim_tenant

    def tenant_deleted(self, tenant_id: str) -> None:
        if tenant_id == self._victim_tenant:
            self._victim_tenant = None


@pytest.fixture(scope="module")
def service(
    tiny_model_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    base = tiny_model_factory("llama_gqa")
    root = tmp_path_factory.mktemp("fuzz_api")
    adapter_dir = make_peft_adapter(base, root / "lora", r=4, alpha=8, seed=5)
    # NOTE: a context of 96 tokens, not the tiny model's 256: a generation without a
    # max_tokens (the admin key has no per-request cap) runs to the end of the context,
    # and the fuzzer sends hundreds of them; long prompts are refused the same way.
    with real_service(base, root, engine_options={"max_loras": 2, "max_model_len": 96}
                      ) as live, \
            httpx.Client(base_url=live.base_url, timeout=60) as admin:
        assert admin.post("/admin/plans", json=PLAN, headers=bearer(ADMIN_KEY)
                          ).status_code == 201
        tenant = admin.post("/admin/tenants", headers=bearer(ADMIN_KEY), json={
            "name": "fuzz", "plan": PLAN["name"], "quotas": {"max_tokens": MAX_NEW_TOKENS},
        }).json()
        key = create_key(admin, tenant["id"], scopes=["inference", "adapters:write"])
        service = Service(live.base_url, admin, live.engine.model_id, tenant["id"], key["key"])
        used = _upload(admin, key["key"], ADAPTER, adapter_dir, "/v1/adapters")
        own_victim = _upload(admin, key["key"], "fuzz-victim", adapter_dir, "/v1/adapters")
        shared_victim = _upload(admin, ADMIN_KEY, "shared-victim", adapter_dir,
                                "/admin/adapters")
        period = datetime.now(UTC).strftime("%Y-%m")
        invoice = admin.post("/admin/invoices", headers=bearer(ADMIN_KEY),
                             json={"tenant_id": tenant["id"], "period": period})
        assert invoice.status_code == 200, invoice.text
        invoice_id = str(invoice.json()["id"])
        service.readable = {
            "adapter_id": used,
            "tenant_id": tenant["id"],
            "key_id": key["id"],
            "name": PLAN["name"],
            "invoice_id": invoice_id,
            "model_id": ADAPTER,
        }
        victim_key = create_key(admin, service.victim_tenant())["id"]
        service.victims = {
            "tenant_id": service.victim_tenant,
            "key_id": lambda: victim_key,
            "adapter_id": lambda: shared_victim,
            "own_adapter_id": lambda: own_victim,
            "invoice_id": lambda: invoice_id,  # finalizing it twice changes nothing
        }
        yield service


def _upload(admin: httpx.Client, key: str, name: str, adapter_dir: Path, path: str) -> str:
    response = upload_adapter(admin, key, name, adapter_dir, path=path)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


# NOTE: loaded at collection, not from a fixture: schemathesis.pytest.from_fixture does
# not run under this pytest. The served /openapi.json is the same document
# (tests/app/test_openapi_document.py).
@schemathesis.serializer("application/jsonl", "application/x-ndjson")
def _jsonl(ctx: Any, value: Any) -> bytes:
    """An eval set's body (POST /admin/adapters/{id}/evals): its text as it is; a value
    the fuzzer bent out of the schema (not a string), as JSON."""
    return value.encode() if isinstance(value, str) else json.dumps(value).encode()


schema = schemathesis.openapi.from_dict(openapi_document())


def steer(service: Service, case: Any) -> dict[str, str]:
    """Point the generated case at real objects; returns the headers to send."""
    path, method = case.operation.path, case.method.upper()
    # Writes through a path go to victims; new keys too, so that the tenant in use does
    # not pile them up.
    writes = method in ("DELETE", "PATCH", "POST")
    for name in list(case.path_parameters or {}):
        if service.pick(["real"]) is None:
            continue
        if writes:
            victim = "own_adapter_id" if path.startswith("/v1/") and name == "adapter_id" \
                else name
            if victim in service.victims:
                case.path_parameters[name] = service.victims[victim]()
        elif name in service.readable:
            case.path_parameters[name] = service.readable[name]
    body = case.body
    if re.fullmatch(GENERATION_PATHS, path) and isinstance(body, dict):
        # Half on the base model: LoRA runs much slower on the CPU.
        model = service.pick([service.model_id, ADAPTER, service.model_id, f"{ADAPTER}@1"])
        if model is not None:
            body["model"] = model
        for name in MAX_TOKENS_FIELDS:
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                body[name] = 1 + (value - 1) % MAX_NEW_TOKENS
    if isinstance(body, dict) and isinstance(body.get("tenant_id"), str) and path.startswith(
            "/admin/invoices"):
        body["tenant_id"] = service.pick([service.tenant_id]) or body["tenant_id"]
    query = case.query or {}
    if isinstance(query.get("tenant_id"), str):
        query["tenant_id"] = service.pick([service.tenant_id]) or query["tenant_id"]
    if path.startswith("/admin/"):
        return bearer(ADMIN_KEY)
    if not path.startswith("/v1/"):
        return {}
    if (case.headers or {}).get(ACT_FOR_TENANT_HEADER) is None:
        return bearer(service.tenant_key)
    # Only admin keys may act for a tenant: mostly send it with one, naming ours.
    acting = service.pick(["drop", service.tenant_id])
    if acting == "drop":
        del case.headers[ACT_FOR_TENANT_HEADER]
        return bearer(service.tenant_key)
    if acting is not None:
        case.headers[ACT_FOR_TENANT_HEADER] = acting
    if isinstance(body, dict) and all(body.get(n) is None for n in MAX_TOKENS_FIELDS):
        # An admin has no max_tokens quota: an omitted one would fill the whole context.
        body["max_tokens"] = MAX_NEW_TOKENS
    return bearer(ADMIN_KEY)


def call_and_check(service: Service, case: Any) -> Any:
    headers = steer(service, case)
    response = case.call(base_url=service.base_url, headers=headers, timeout=60)
    case.validate_response(response, checks=CHECKS, headers=headers)
    if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        check_stream_events(case.operation.path, response)
    if (case.method.upper(), case.operation.path, response.status_code) == (
            "DELETE", "/admin/tenants/{tenant_id}", 204):
        service.tenant_deleted(case.path_parameters["tenant_id"])
    return response


# The chunk each streamed event carries as JSON `data` (`contentSchema`, which JSON
# Schema treats as an annotation: schemathesis checks the events' framing, not this).
CHUNKS = {"/v1/completions": "CompletionResponse", "/v1/chat/completions": "ChatCompletionChunk",
          "/v1/responses": "ResponseStreamEvent"}
# How a Responses stream ends: the whole response, or the error that ended it.
RESPONSES_LAST = {"response.completed", "response.incomplete", "response.failed"}


@functools.cache
def chunk_validator(name: str) -> Draft202012Validator:
    document = openapi_document()
    return Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    )


def check_stream_events(path: str, response: Any) -> None:
    blocks = [b for b in response.text.split("\n\n") if b.strip()]
    if path == "/v1/responses":
        # Typed events: `event: <type>` then the data, whose `type` says the same.
        assert blocks and all(b.startswith("event: ") for b in blocks), response.text[:200]
        events = [b.split("\n", 1) for b in blocks]
        payloads = []
        for name, data in events:
            payload = json.loads(data.removeprefix("data: "))
            assert payload["type"] == name.removeprefix("event: "), (name, payload)
            payloads.append(payload)
        assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
        if not response.stream_cut_short:
            assert payloads[-1]["type"] in RESPONSES_LAST, payloads[-1]
        for payload in payloads:
            chunk_validator(CHUNKS[path]).validate(payload)
        return
    assert blocks and all(b.startswith("data: ") for b in blocks), response.text[:200]
    payloads = [b.removeprefix("data: ") for b in blocks]
    # NOTE: strict: what a fuzzer sends is refused before a stream starts, or served; an
    # error event mid-stream would be a refusal that came too late.
    if not response.stream_cut_short:  # schemathesis reads at most a few events
        assert payloads[-1] == "[DONE]", payloads[-1]
    validator = chunk_validator(CHUNKS[path])
    for payload in payloads:
        if payload != "[DONE]":
            validator.validate(json.loads(payload))


def fuzz_settings(max_examples: int) -> settings:
    # Derandomized, so that CI runs the same cases every time (no example database).
    return settings(max_examples=max_examples, derandomize=True, deadline=None, database=None)


@schema.include(path_regex=GENERATION_PATHS).parametrize()
@fuzz_settings(GENERATION_EXAMPLES)
def test_generation_routes(case: Any, service: Service) -> None:
    call_and_check(service, case)


@schema.exclude(path_regex=GENERATION_PATHS).parametrize()
@fuzz_settings(OTHER_EXAMPLES)
def test_other_routes(case: Any, service: Service) -> None:
    call_and_check(service, case)


# Documented values at the edges, on both generation routes; each once, every run.
EXTREMES: list[dict[str, Any]] = [
    {"top_p": 1e-50},
    {"top_p": 5e-324, "temperature": 2},
    {"temperature": 1e-50},
    {"temperature": 5e-324, "top_k": 1},
    {"repetition_penalty": 0.01},
    {"repetition_penalty": 100, "presence_penalty": 2, "frequency_penalty": -2},
    {"presence_penalty": -2, "frequency_penalty": 2, "top_k": 2**62},
    {"seed": -(2**63), "n": 16},
    {"seed": 2**63 - 17, "n": 16, "top_p": 1e-300, "temperature": 1e-300},
    {"n": 16, "stream": True, "stream_options": {"include_usage": True}},
]


@pytest.mark.parametrize("extreme", EXTREMES, ids=[repr(e)[:60] for e in EXTREMES])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_sampling_at_the_documented_edges(
    service: Service, path: str, extreme: dict[str, Any]
) -> None:
    body: dict[str, Any] = {"model": service.model_id, "max_tokens": MAX_NEW_TOKENS, **extreme}
    if path == "/v1/completions":
        body |= {"prompt": "The capital of France is", "logprobs": 5}
    else:
        body |= {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                 "top_logprobs": 20}
    # A tenant's request as it is: the model named and max_tokens within the quota.
    response = call_and_check(service, schema[path]["POST"].Case(body=body))
    assert response.status_code == 200, response.text


def _nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# Constraints built to hurt a grammar compiler: each is refused with a 400 that says why,
# or served (bounded); never a 5xx, never a stall (the request timeout would show it).
HOSTILE: list[tuple[str, str, dict[str, Any]]] = [
    ("deep-schema", "/v1/chat/completions", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": _nested_schema(200)}}}),
    ("huge-enum", "/v1/chat/completions", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "enum": [f"v{i}" for i in range(100_000)]}}}}),
    ("ref-cycle", "/v1/completions", {"guided_json": {
        "$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}),
    ("catastrophic-regex", "/v1/completions", {"guided_regex": "(a*)*b"}),
    ("huge-repeat", "/v1/completions", {"guided_regex": "a{1000000}"}),
    ("long-alternation", "/v1/completions", {
        "guided_regex": "|".join(f"word{i}" for i in range(20_000))}),
    ("deep-grammar", "/v1/completions", {"guided_grammar": "start: " + "(" * 3000 + '"x"'
                                         + ")" * 3000}),
    ("many-choices", "/v1/completions", {"guided_choice": [f"c{i}" for i in range(50_000)]}),
    ("many-tools", "/v1/chat/completions", {"tools": [
        {"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}),
]
GRAMMAR_CODES = {"grammar_too_complex", "grammar_compile_timeout", "invalid_grammar",
                 "invalid_structured_output", "too_many_tools", "invalid_tools"}


@pytest.mark.parametrize(("path", "fields"), [h[1:] for h in HOSTILE],
                         ids=[h[0] for h in HOSTILE])
def test_hostile_constraints_are_refused_or_bounded(
    service: Service, path: str, fields: dict[str, Any]
) -> None:
    body: dict[str, Any] = {"model": service.model_id, "max_tokens": MAX_NEW_TOKENS, **fields}
    if path == "/v1/completions":
        body["prompt"] = "The capital of France is"
    else:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    response = call_and_check(service, schema[path]["POST"].Case(body=body))
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert response.json()["error"]["code"] in GRAMMAR_CODES, response.text
