"""The authorization matrix: every route the app registers, tried by every kind of caller
(tests/utils/authz.py) on every object it can name, two tenants' and the shared ones,
against the explicit table RULES below.

Asserted exactly: 401 for credentials that must not authenticate, 403 for a valid key
without the scope or role, 404 for another tenant's object with the same body as for
an id that never existed, the admin UI's redirect to its login form without a valid
session, and that no response to a tenant (or to nobody) carries another tenant's ids
or names. A route missing from RULES fails test_every_route_has_an_entry.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

from admin_ui.sessions import SESSION_COOKIE
from tests.admin_ui.pages import UI, form_csrf
from tests.utils.authz import (
    TENANT_HEADER,
    Caller,
    World,
    built_world,
    csrf_header,
    route_keys,
    unlisted_routes,
    upload_files,
)


class Access(Enum):
    """Who may call a route; everyone else is refused before any object is looked at."""

    PUBLIC = "anyone"
    LOGIN_PAGE = "anyone; a valid session is sent on into the UI (303)"
    LOGIN = "anyone posts it; only a valid admin key logs in (303), any other gets 401"
    ADMIN = "admin keys; 401 without a valid key, 403 for tenant keys"
    INFERENCE = "keys with the inference scope; 401 without a valid key, 403 without it"
    SERVING = "as INFERENCE, and X-Loraplex-Tenant from admin keys only (403 otherwise)"
    ADAPTERS_WRITE = "keys with adapters:write; 401 without a valid key, 403 without it"
    UI_PAGE = "a valid admin UI session; else 303 to the login form (401 for JSON)"
    UI_FORM = "as UI_PAGE, and the session's CSRF token (403 without it)"


class Sees(Enum):
    """Which objects a caller that may call the route can name; the others are 404."""

    ALL = "every existing object (admins)"
    OWN = "its own tenant's (an admin's own: the shared ones)"
    USABLE = "the base model, the shared adapters, and its tenant's (or the one it acts for)"


# The objects each kind of slot is filled with: tenant a's, tenant b's, the shared or
# an admin's, and one that never existed.
SLOTS: dict[str, tuple[str, ...]] = {
    "none": ("-",),
    "tenant": ("a", "b", "missing"),
    "key": ("a", "b", "admin", "missing"),
    "adapter": ("a", "b", "shared", "missing"),
    "owner": ("a", "b", "shared", "missing"),  # an upload's tenant_id field
    "invoice": ("a", "b", "missing"),
    "plan": ("a", "b", "missing"),
    "model": ("base", "a", "a@1", "a-engine", "b", "b@1", "b-engine", "shared", "missing"),
    "static": ("admin.css", "traversal"),
}
# Whose each object is, for Sees; "nobody" is 404 for everyone.
OWNER = {"a@1": "a", "b@1": "b", "a-engine": "nobody", "b-engine": "nobody",
         "missing": "nobody"}


@dataclass(frozen=True, slots=True)
class Ctx:
    world: World
    caller: Caller
    obj: str  # the id, name or model that fills the route's slot


Body = Callable[[Ctx], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Rule:
    access: Access
    ok: int  # the status of an allowed call on a visible object
    path: str  # the request's path; "{}" is the object
    slot: str = "none"
    sees: Sees = Sees.ALL
    json: Body | None = None
    form: Body | None = None  # url-encoded; the caller's CSRF token is added
    upload: Body | None = None  # multipart text fields next to a small adapter
    fresh: bool = False  # an allowed call changes its object: give it a new one
    by_label: dict[str, int] = field(default_factory=dict)  # allowed, but not `ok`
    admin_ok: int | None = None  # allowed admin keys get this instead of `ok`
    # NOTE: false only for /metrics, public (API.md, and every scrape config in
    # deploy/) and labelled by tenant id and adapter name.
    leak_checked: bool = True


def _period() -> str:
    return datetime.now(UTC).strftime("%Y-%m")


def _name(ctx: Ctx) -> str:
    return f"m-{ctx.world.serial()}"


def _tenant_body(ctx: Ctx) -> dict[str, Any]:
    return {"name": _name(ctx), "tier": "standard", "isolation": "shared", "quotas": {}}


def _plan_body(ctx: Ctx) -> dict[str, Any]:
    return {"name": _name(ctx), "currency": "USD", "prompt_per_mtok": "1",
            "completion_per_mtok": "1", "cached_prompt_per_mtok": "1",
            "adapter_month": "1", "monthly_minimum": "0"}


def _completion(ctx: Ctx) -> dict[str, Any]:
    return {"model": ctx.obj, "prompt": "hi", "max_tokens": 2}


def _chat(ctx: Ctx) -> dict[str, Any]:
    return {"model": ctx.obj, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _response(ctx: Ctx) -> dict[str, Any]:
    return {"model": ctx.obj, "input": "hi", "max_output_tokens": 2}


def _upload_as_admin(ctx: Ctx) -> dict[str, Any]:
    return {"name": _name(ctx), **({"tenant_id": ctx.obj} if ctx.obj else {})}


def _tenant_form(ctx: Ctx) -> dict[str, Any]:
    owned = next((o for o in ctx.world.owned.values() if o.tenant_id == ctx.obj), None)
    return {"tier": "standard", "isolation": "shared", "plan": owned.plan if owned else ""}


def _playground(ctx: Ctx) -> dict[str, Any]:
    owned = next((o for o in ctx.world.owned.values() if o.tenant_id == ctx.obj), None)
    return {"tenant_id": ctx.obj, "adapter": owned.adapter_name if owned else "shared-bot",
            "prompt": "hi", "max_tokens": "2"}


def _nothing(ctx: Ctx) -> dict[str, Any]:
    return {}


P, LP, LG, AD, INF, SRV, AW, UP, UF = (
    Access.PUBLIC, Access.LOGIN_PAGE, Access.LOGIN, Access.ADMIN, Access.INFERENCE,
    Access.SERVING, Access.ADAPTERS_WRITE, Access.UI_PAGE, Access.UI_FORM,
)
ADMIN_UI_STATIC = UI + "/static/"

RULES: dict[str, Rule] = {
    # -- operations and documentation: public ------------------------------------------
    "GET /health": Rule(P, 200, "/health"),
    "GET /ready": Rule(P, 200, "/ready"),
    "GET /metrics": Rule(P, 200, "/metrics", leak_checked=False),
    "GET /openapi.json": Rule(P, 200, "/openapi.json"),
    "GET /docs": Rule(P, 200, "/docs"),
    "GET /docs/oauth2-redirect": Rule(P, 200, "/docs/oauth2-redirect"),
    "GET /redoc": Rule(P, 200, "/redoc"),
    # -- the tenant API -----------------------------------------------------------------
    "POST /v1/completions": Rule(SRV, 200, "/v1/completions", "model", Sees.USABLE,
                                 json=_completion),
    "POST /v1/chat/completions": Rule(SRV, 200, "/v1/chat/completions", "model", Sees.USABLE,
                                      json=_chat),
    "POST /v1/responses": Rule(SRV, 200, "/v1/responses", "model", Sees.USABLE,
                               json=_response),
    "GET /v1/models": Rule(SRV, 200, "/v1/models"),
    # `:path`: model ids may hold a slash.
    "GET /v1/models/{model_id:path}": Rule(SRV, 200, "/v1/models/{}", "model", Sees.USABLE),
    # A tenant_id in the query or the form names no other tenant: the caller's own it is.
    "GET /v1/usage": Rule(INF, 200, "/v1/usage?group_by=key&tenant_id={}", "tenant",
                          by_label={"missing": 200}, admin_ok=400),
    "POST /v1/adapters": Rule(AW, 201, "/v1/adapters", "owner", upload=_upload_as_admin,
                              by_label={"a": 400, "b": 400, "missing": 400}),
    "GET /v1/adapters": Rule(AW, 200, "/v1/adapters"),
    "GET /v1/adapters/{adapter_id}": Rule(AW, 200, "/v1/adapters/{}", "adapter", Sees.OWN),
    "DELETE /v1/adapters/{adapter_id}": Rule(AW, 200, "/v1/adapters/{}", "adapter", Sees.OWN,
                                             fresh=True),
    # -- the admin API ------------------------------------------------------------------
    "POST /admin/tenants": Rule(AD, 201, "/admin/tenants", json=_tenant_body),
    "GET /admin/tenants": Rule(AD, 200, "/admin/tenants"),
    "GET /admin/tenants/{tenant_id}": Rule(AD, 200, "/admin/tenants/{}", "tenant"),
    "PATCH /admin/tenants/{tenant_id}": Rule(AD, 200, "/admin/tenants/{}", "tenant",
                                             json=lambda ctx: {"tier": "standard"}),
    "DELETE /admin/tenants/{tenant_id}": Rule(AD, 204, "/admin/tenants/{}", "tenant",
                                              fresh=True),
    "POST /admin/tenants/{tenant_id}/keys": Rule(AD, 201, "/admin/tenants/{}/keys", "tenant",
                                                 json=lambda ctx: {"name": "made"}),
    "GET /admin/tenants/{tenant_id}/keys": Rule(AD, 200, "/admin/tenants/{}/keys", "tenant"),
    "POST /admin/keys": Rule(AD, 201, "/admin/keys", json=lambda ctx: {"name": "made"}),
    "GET /admin/keys": Rule(AD, 200, "/admin/keys"),
    "DELETE /admin/keys/{key_id}": Rule(AD, 204, "/admin/keys/{}", "key", fresh=True),
    "GET /admin/audit": Rule(AD, 200, "/admin/audit"),
    "POST /admin/adapters": Rule(AD, 201, "/admin/adapters", "owner", upload=_upload_as_admin),
    "GET /admin/adapters": Rule(AD, 200, "/admin/adapters"),
    # (tests/app/test_adapter_object_store.py imports for real: here, a source that is not
    # an s3:// URL.)
    "POST /admin/adapters/import": Rule(AD, 400, "/admin/adapters/import", json=lambda ctx: {
        "name": _name(ctx), "source": "not-an-s3-url"}),
    "POST /admin/adapters/gc": Rule(AD, 200, "/admin/adapters/gc"),
    "GET /admin/adapters/{adapter_id}": Rule(AD, 200, "/admin/adapters/{}", "adapter"),
    "DELETE /admin/adapters/{adapter_id}": Rule(AD, 200, "/admin/adapters/{}", "adapter",
                                                fresh=True),
    # (tests/evals/test_adapter_evals.py runs evals for real: here, an empty eval set is
    # 400, an unknown eval 404.)
    "POST /admin/adapters/{adapter_id}/evals": Rule(AD, 400, "/admin/adapters/{}/evals",
                                                    "adapter"),
    "GET /admin/adapters/{adapter_id}/evals": Rule(AD, 200, "/admin/adapters/{}/evals",
                                                   "adapter"),
    "GET /admin/adapters/{adapter_id}/evals/{eval_id}": Rule(
        AD, 404, "/admin/adapters/{}/evals/evl_0000", "adapter"),
    # The promotion gate (tests/evals/test_promotion_gate.py runs it for real): here an
    # empty gate set is 400, promoting a version that does not exist and rolling back an
    # adapter with one version are 409.
    "PUT /admin/adapters/{adapter_id}/gate": Rule(AD, 400, "/admin/adapters/{}/gate",
                                                  "adapter"),
    "DELETE /admin/adapters/{adapter_id}/gate": Rule(AD, 200, "/admin/adapters/{}/gate",
                                                     "adapter"),
    "POST /admin/adapters/{adapter_id}/promote": Rule(
        AD, 409, "/admin/adapters/{}/promote?version=99", "adapter"),
    "POST /admin/adapters/{adapter_id}/rollback": Rule(AD, 409, "/admin/adapters/{}/rollback",
                                                       "adapter"),
    # vLLM's dynamic LoRA calls (tests/app/test_dynamic_lora.py loads for real): an admin's
    # relative path is 400, an unknown name 404.
    "POST /v1/load_lora_adapter": Rule(AD, 400, "/v1/load_lora_adapter",
                                       json=lambda ctx: {"lora_name": "x", "lora_path": "x"}),
    "POST /v1/unload_lora_adapter": Rule(AD, 404, "/v1/unload_lora_adapter",
                                         json=lambda ctx: {"lora_name": _name(ctx)}),
    "GET /admin/usage": Rule(AD, 200, "/admin/usage?group_by=key&tenant_id={}", "tenant"),
    "GET /admin/engine": Rule(AD, 200, "/admin/engine"),
    "POST /admin/plans": Rule(AD, 201, "/admin/plans", json=_plan_body),
    "GET /admin/plans": Rule(AD, 200, "/admin/plans"),
    "GET /admin/plans/{name}": Rule(AD, 200, "/admin/plans/{}", "plan"),
    "POST /admin/invoices": Rule(AD, 200, "/admin/invoices", "tenant",
                                 json=lambda ctx: {"tenant_id": ctx.obj, "period": _period()}),
    "GET /admin/invoices": Rule(AD, 200, "/admin/invoices?tenant_id={}", "tenant"),
    "GET /admin/invoices/{invoice_id}": Rule(AD, 200, "/admin/invoices/{}", "invoice"),
    "POST /admin/invoices/{invoice_id}/finalize": Rule(
        AD, 200, "/admin/invoices/{}/finalize", "invoice", fresh=True
    ),
    # -- the admin UI -------------------------------------------------------------------
    "MOUNT /admin/ui/static": Rule(P, 200, ADMIN_UI_STATIC + "{}", "static",
                                   by_label={"traversal": 404}),
    "GET /admin/ui": Rule(P, 307, UI),
    "GET /admin/ui/login": Rule(LP, 200, UI + "/login"),
    "POST /admin/ui/login": Rule(LG, 303, UI + "/login"),
    "POST /admin/ui/logout": Rule(UF, 303, UI + "/logout", form=_nothing, fresh=True),
    "GET /admin/ui/": Rule(UP, 200, UI + "/"),
    "GET /admin/ui/tenants": Rule(UP, 200, UI + "/tenants"),
    "POST /admin/ui/tenants": Rule(UF, 303, UI + "/tenants", form=_tenant_body),
    "GET /admin/ui/tenants/{tenant_id}": Rule(UP, 200, UI + "/tenants/{}", "tenant"),
    "POST /admin/ui/tenants/{tenant_id}": Rule(UF, 303, UI + "/tenants/{}", "tenant",
                                               form=_tenant_form),
    "GET /admin/ui/tenants/{tenant_id}/keys": Rule(UP, 200, UI + "/tenants/{}/keys", "tenant"),
    "POST /admin/ui/tenants/{tenant_id}/keys": Rule(UF, 200, UI + "/tenants/{}/keys", "tenant",
                                                    form=lambda ctx: {"name": "made"}),
    "POST /admin/ui/keys/{key_id}/revoke": Rule(UF, 303, UI + "/keys/{}/revoke", "key",
                                                form=_nothing, fresh=True,
                                                by_label={"admin": 400}),
    "GET /admin/ui/adapters": Rule(UP, 200, UI + "/adapters"),
    "POST /admin/ui/adapters/upload": Rule(UF, 201, UI + "/adapters/upload", "owner",
                                           upload=_upload_as_admin),
    "GET /admin/ui/adapters/{adapter_id}": Rule(UP, 200, UI + "/adapters/{}", "adapter"),
    "POST /admin/ui/adapters/{adapter_id}/delete": Rule(
        UF, 303, UI + "/adapters/{}/delete", "adapter", form=_nothing, fresh=True
    ),
    "GET /admin/ui/playground": Rule(UP, 200, UI + "/playground"),
    "POST /admin/ui/playground": Rule(UF, 200, UI + "/playground", "tenant", form=_playground,
                                      by_label={"missing": 400}),
    "GET /admin/ui/usage": Rule(UP, 200, UI + "/usage?group_by=key&tenant_id={}", "tenant"),
    "GET /admin/ui/usage.csv": Rule(UP, 200, UI + "/usage.csv?group_by=key&tenant_id={}",
                                    "tenant"),
    "GET /admin/ui/invoices": Rule(UP, 200, UI + "/invoices"),
    "POST /admin/ui/invoices": Rule(UF, 303, UI + "/invoices", "tenant",
                                    form=lambda ctx: {"tenant_id": ctx.obj, "period": _period()}),
    "GET /admin/ui/invoices/{invoice_id}": Rule(UP, 200, UI + "/invoices/{}", "invoice"),
    "GET /admin/ui/invoices/{invoice_id}/print": Rule(UP, 200, UI + "/invoices/{}/print",
                                                      "invoice"),
    "GET /admin/ui/invoices/{invoice_id}/download": Rule(UP, 200, UI + "/invoices/{}/download",
                                                         "invoice"),
    "POST /admin/ui/invoices/{invoice_id}/finalize": Rule(
        UF, 303, UI + "/invoices/{}/finalize", "invoice", form=_nothing, fresh=True
    ),
}


# ------------------------------------------------------------------------ expectations


def refusal(access: Access, caller: Caller) -> int | None:
    """The status `caller` gets whatever object it names; None: it may call."""
    if access in (Access.PUBLIC, Access.LOGIN_PAGE, Access.LOGIN):
        return None
    if access in (Access.UI_PAGE, Access.UI_FORM):
        if not caller.ui:
            return 401 if caller.accept_json else 303
        forged = caller.csrf is None or not caller.csrf_of_session
        return 403 if access is Access.UI_FORM and forged else None
    if caller.kind == "nobody":
        return 401
    if access is Access.ADMIN:
        return None if caller.kind == "admin" else 403
    if access is Access.ADAPTERS_WRITE:
        return None if caller.has("adapters:write") else 403
    if not caller.has("inference"):
        return 403
    if access is Access.SERVING and caller.act_for is not None:
        if caller.kind != "admin":
            return 403
        if caller.act_for == "deleted":
            return 404  # tenant_not_found
    return None


def visible(sees: Sees, caller: Caller, owner: str) -> bool:
    if owner == "nobody":
        return False
    if sees is Sees.ALL:
        return True
    if sees is Sees.OWN:
        return owner == (caller.tenant or "shared")
    acting = caller.act_for if caller.kind == "admin" else None
    return owner in ("base", "shared") or owner == (acting or caller.tenant)


def expected(rule: Rule, caller: Caller, label: str) -> int:
    refused = refusal(rule.access, caller)
    if refused is not None:
        return refused
    if rule.access is Access.LOGIN_PAGE:
        return 303 if caller.ui else rule.ok
    if rule.access is Access.LOGIN:
        return rule.ok if caller.kind == "admin" else 401
    if caller.kind == "admin" and rule.admin_ok is not None:
        return rule.admin_ok
    if label in rule.by_label:
        return rule.by_label[label]
    if not visible(rule.sees, caller, OWNER.get(label, label)):
        return 404
    return rule.ok


# ---------------------------------------------------------------------------- requests


def obj_of(world: World, slot: str, label: str) -> str:
    """The id (or name) that names `label`'s object in the route's slot."""
    if slot == "none":
        return ""
    if slot == "static":
        return "admin.css" if label == "admin.css" else "..%2f..%2fadmin_ui%2fsessions.py"
    if label == "missing":
        return {"model": "no-such-model", "plan": "no-such-plan"}.get(slot, "missing_0000")
    if slot == "model":
        if label == "base":
            return world.engine.model_id
        owned = world.owned[label.split("@")[0].removesuffix("-engine")]
        if label.endswith("-engine"):
            return "av/" + owned.version_id
        return owned.adapter_name + ("@1" if label.endswith("@1") else "")
    if slot == "key" and label == "admin":
        return world.admin_key_id
    owned = world.owned[label]
    if slot == "key":
        return owned.key_ids[0]
    return {"tenant": owned.tenant_id, "owner": owned.tenant_id, "adapter": owned.adapter_id,
            "invoice": owned.invoice_id, "plan": owned.plan}[slot]


def fresh_of(world: World, slot: str, label: str) -> str:
    """A new object like `label`'s, for a call that changes (deletes) it."""
    if label == "missing":
        return obj_of(world, slot, label)
    if slot == "tenant":
        return world.new_tenant(f"fresh-{world.serial()}")
    if slot == "key":
        tenant_id = None if label == "admin" else world.owned[label].tenant_id
        return world.new_key(tenant_id)[0]
    if slot == "adapter":
        return world.new_adapter(world.owned[label].tenant_id or None)[0]
    if slot == "invoice":
        return world.new_invoice(world.owned[label].tenant_id)
    return obj_of(world, slot, label)


def headers_of(world: World, caller: Caller, cookie: str | None = None) -> dict[str, str]:
    headers: dict[str, str] = {}
    if caller.key is not None:
        headers["Authorization"] = f"{caller.scheme} {caller.key}"
    if caller.act_for == "deleted":
        headers[TENANT_HEADER] = world.deleted_tenant_id
    elif caller.act_for is not None:
        headers[TENANT_HEADER] = world.owned[caller.act_for].tenant_id
    if cookie or caller.cookie:
        headers["Cookie"] = f"{SESSION_COOKIE}={cookie or caller.cookie}"
    if caller.accept_json:
        headers["Accept"] = "application/json"
    return headers


def login_call(ctx: Ctx, rule: Rule) -> tuple[httpx.Response, str]:
    """Load the login form as an anonymous browser, then post the caller's key with it."""
    page = ctx.world.send("GET", rule.path)
    assert page.status_code == 200, page.text
    token = page.cookies["lpx_admin_login_csrf"]
    headers = headers_of(ctx.world, ctx.caller)
    headers["Cookie"] = "; ".join(filter(None, [f"lpx_admin_login_csrf={token}",
                                                headers.get("Cookie")]))
    data = {"key": ctx.caller.key or "", "csrf_token": form_csrf(page.text), "next": ""}
    return ctx.world.send("POST", rule.path, data=data, headers=headers), json.dumps(data)


def call(rule: Rule, route: str, ctx: Ctx, fresh: bool) -> tuple[httpx.Response, str]:
    """The response, and everything the request carried (echoes of it are no leak)."""
    if rule.access is Access.LOGIN:
        return login_call(ctx, rule)
    caller, cookie, csrf = ctx.caller, None, ctx.caller.csrf
    if route == "POST /admin/ui/logout" and fresh:
        assert caller.login_key is not None
        cookie, csrf = ctx.world.login(caller.login_key)  # a session of its own to end
    method = route.split()[0] if not route.startswith("MOUNT") else "GET"
    headers = headers_of(ctx.world, caller, cookie)
    kwargs: dict[str, Any] = {}
    if rule.json is not None:
        kwargs["json"] = rule.json(ctx)
    if rule.form is not None:
        kwargs["data"] = {**rule.form(ctx), **({"csrf_token": csrf} if csrf else {})}
    if rule.upload is not None:
        kwargs["data"] = rule.upload(ctx)
        kwargs["files"] = upload_files(ctx.world.serial())
        headers.update(csrf_header(caller))
    path = rule.path.replace("{}", ctx.obj)
    sent = " ".join([path, *headers.values(), json.dumps(kwargs.get("json")),
                     json.dumps(kwargs.get("data"))])
    return ctx.world.send(method, path, headers=headers, **kwargs), sent


# ------------------------------------------------------------------------------- checks


def leaks(world: World, caller: Caller, response: httpx.Response, sent: str) -> list[str]:
    """Another tenant's ids and names in a response to a tenant (any tenant's, to a
    caller that is nobody), other than what the request itself carried."""
    if caller.kind == "admin" or caller.ui:
        return []
    others = ["a", "b"] if caller.tenant is None else ["b" if caller.tenant == "a" else "a"]
    text = response.text + " " + response.headers.get("location", "")
    return sorted(marker for who in others for marker in world.owned[who].markers()
                  if marker in text and marker not in sent)


def refusal_problem(rule: Rule, caller: Caller, response: httpx.Response) -> str | None:
    """What is wrong with a refusal's details, beyond its status."""
    want = refusal(rule.access, caller)
    is_ui = rule.path.startswith(UI)
    if want == 401:
        code = response.json().get("error", {}).get("code")
        expected_code = "login_required" if is_ui else "invalid_api_key"
        if code != expected_code:
            return f"401 with code {code!r}, expected {expected_code!r}"
    if want == 403 and not is_ui:
        code = response.json().get("error", {}).get("code")
        if code != "permission_denied":
            return f"403 with code {code!r}, expected 'permission_denied'"
    if want == 303 and rule.access in (Access.UI_PAGE, Access.UI_FORM):
        location = response.headers.get("location", "")
        if not location.startswith(UI + "/login"):
            return f"303 to {location!r}, expected the login form"
    return None


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with built_world(tmp_path_factory.mktemp("authz")) as built:
        yield built


def test_every_route_has_an_entry(world: World) -> None:
    registered = route_keys(world.app.routes)
    unlisted = unlisted_routes(world.app.routes, set(RULES))
    assert not unlisted, (
        "routes with no entry in RULES (tests/app/test_authz_matrix.py), so nobody has "
        f"said who may call them: {', '.join(unlisted)}"
    )
    stale = sorted(set(RULES) - set(registered))
    assert not stale, f"RULES has entries for routes the app does not register: {stale}"


def test_a_new_route_is_named_by_the_guard(world: World) -> None:
    def endpoint() -> dict[str, str]:
        return {}

    extra = APIRoute("/admin/brand-new/{thing_id}", endpoint, methods=["GET", "PUT"])
    assert unlisted_routes([*world.app.routes, extra], set(RULES)) == [
        "GET /admin/brand-new/{thing_id}", "PUT /admin/brand-new/{thing_id}",
    ]


@pytest.mark.parametrize("route", sorted(RULES))
def test_route(world: World, route: str) -> None:
    rule = RULES[route]
    problems: list[str] = []
    for caller in world.callers.values():
        not_found: dict[str, tuple[str, httpx.Response]] = {}
        for label in SLOTS[rule.slot]:
            want = expected(rule, caller, label)
            fresh = rule.fresh and want < 400 and refusal(rule.access, caller) is None
            obj = (fresh_of if fresh else obj_of)(world, rule.slot, label)
            response, sent = call(rule, route, Ctx(world, caller, obj), fresh)
            where = f"{caller.name} on {label}: {response.request.method} {response.request.url}"
            if rule.leak_checked and (found := leaks(world, caller, response, sent)):
                problems.append(f"{where} -> {response.status_code} carries {found}")
            if response.status_code != want:
                problems.append(f"{where} -> {response.status_code}, expected {want}: "
                                f"{response.text[:300]}")
                continue
            if (problem := refusal_problem(rule, caller, response)) is not None:
                problems.append(f"{where} -> {problem}")
            if want == 404:
                not_found[label] = (obj, response)
        # Another tenant's object is refused exactly as one that never existed.
        if "missing" in not_found:
            missing_obj, missing = not_found.pop("missing")
            same = missing.text.replace(missing_obj, "<id>")
            for label, (obj, response) in not_found.items():
                if response.text.replace(obj, "<id>") != same:
                    problems.append(f"{caller.name} on {label}: its 404 differs from that of "
                                    f"an unknown id: {response.text[:200]} vs {missing.text[:200]}")
    assert not problems, f"{route}: {len(problems)} wrong\n" + "\n".join(problems)
