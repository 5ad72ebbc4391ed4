"""What every admin-UI page shares: the UI's state on the app, templates, security
headers, and the two ways a request is turned away (login needed, or an error page)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Any
from urllib.parse import quote

import jinja2
from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from admin_ui.sessions import DEFAULT_TTL_S, SessionSigner, UISession
from admin_ui.throttle import LoginThrottle
from app.api.errors import APIError
from app.billing.render import quantity_text, unit_price_text

PREFIX = "/admin/ui"
STATIC_PREFIX = PREFIX + "/static"

# NOTE: nothing inline and nothing from elsewhere: scripts and styles come from
# /admin/ui/static only, so an injected tag could neither run nor load anything.
PAGE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": PAGE_CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

NAV = (
    ("overview", "Overview", PREFIX + "/"),
    ("tenants", "Tenants", PREFIX + "/tenants"),
    ("adapters", "Adapters", PREFIX + "/adapters"),
    ("playground", "Playground", PREFIX + "/playground"),
    ("usage", "Usage", PREFIX + "/usage"),
    ("invoices", "Invoices", PREFIX + "/invoices"),
)


class LoginRequired(Exception):
    """No valid session: pages redirect to the login form, scripts get a 401."""


class UIError(Exception):
    """A refusal shown as an error page (or a JSON error to scripts)."""

    def __init__(self, status_code: int, message: str, *, title: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.title = title or "Request refused"
        self.headers = headers or {}


def _when(value: int | float | datetime | date | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")
    if isinstance(value, date):
        return value.isoformat()
    return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M UTC")


def _num(value: int | float | None) -> str:
    return "-" if value is None else f"{value:,}"


def _size(value: int | None) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def make_templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("admin_ui", "templates"),
        autoescape=jinja2.select_autoescape(["html"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = _when
    env.filters["num"] = _num
    env.filters["size"] = _size
    env.filters["quantity"] = quantity_text
    env.filters["unit_price"] = unit_price_text
    env.globals.update(prefix=PREFIX, static=STATIC_PREFIX, nav=NAV)
    return env


@dataclass(slots=True)
class AdminUI:
    """The UI's per-app state (app.state.admin_ui)."""

    signer: SessionSigner
    templates: jinja2.Environment = field(default_factory=make_templates)
    throttle: LoginThrottle = field(default_factory=LoginThrottle)
    session_ttl_s: int = DEFAULT_TTL_S
    # Sessions ended by logging out, until they would have expired (nonce -> expires_at).
    # NOTE: per process; the cookie is deleted too, so a replica that missed the logout
    # only matters for a copied cookie, which expires with its session anyway.
    _ended: dict[str, int] = field(default_factory=dict)

    def end(self, session: UISession) -> None:
        now = int(time.time())
        self._ended = {n: e for n, e in self._ended.items() if e > now}
        self._ended[session.nonce] = session.expires_at

    def ended(self, session: UISession) -> bool:
        return session.nonce in self._ended


def get_ui(request: Request) -> AdminUI:
    ui = request.app.state.admin_ui
    assert isinstance(ui, AdminUI), "admin_ui.install() sets app.state.admin_ui"
    return ui


def wants_json(request: Request) -> bool:
    """Scripts ask for JSON; browsers navigating ask for HTML."""
    accept = request.headers.get("accept", "")
    return "application/json" in accept and "text/html" not in accept


def render(
    request: Request,
    template: str,
    context: dict[str, Any],
    *,
    status_code: int = 200,
    headers: dict[str, str] | None = None,
) -> HTMLResponse:
    ui = get_ui(request)
    values = {"request": request, "authed": None, "active": None, "error": None,
              "notice": None, **context}
    html = ui.templates.get_template(template).render(values)
    return HTMLResponse(html, status_code=status_code, headers={**PAGE_HEADERS, **(headers or {})})


def error_page(request: Request, exc: UIError, authed: Any = None) -> Response:
    if wants_json(request):
        body = APIError(exc.status_code, exc.message).to_body().model_dump()
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
    return render(
        request, "error.html", {"title": exc.title, "message": exc.message, "authed": authed},
        status_code=exc.status_code, headers=exc.headers,
    )


def login_redirect(request: Request) -> Response:
    """Scripts get a 401; a browser goes to the login form (and, from a page, back)."""
    if wants_json(request):
        body = APIError(401, "Log in to the admin UI first (the session is missing, expired "
                             "or no longer valid).", code="login_required").to_body()
        return JSONResponse(body.model_dump(), status_code=401)
    if request.method != "GET":
        # A form posted after the session ended: nothing was done; log in again.
        return RedirectResponse(f"{PREFIX}/login", status_code=303)
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"{PREFIX}/login?next={quote(target, safe='')}", status_code=303)


def safe_next(target: str | None) -> str:
    """Where to go after logging in: a page of the UI, never another site."""
    if target and target.startswith(PREFIX + "/") and not target.startswith("//") \
            and "\\" not in target and not target.startswith(PREFIX + "/login"):
        return target
    return PREFIX + "/"
