"""Logging in with an admin key (checked as the admin API checks a bearer key), and out.

NOTE: the login form has no session yet, so its CSRF token is a double-submit one: a
random cookie that the form must echo. A page on another site can neither read that
cookie nor set it, so it cannot post a login (and log a victim into its own account).
"""

from __future__ import annotations

import math
import secrets
import time

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from admin_ui.deps import AuthedDep, CheckedForm, UIDep, admin_principal, read_session
from admin_ui.sessions import (
    BOOTSTRAP,
    CSRF_FIELD,
    LOCAL,
    LOGIN_CSRF_COOKIE,
    SESSION_COOKIE,
    same_token,
)
from admin_ui.web import PREFIX, AdminUI, UIError, render, safe_next
from app.api.state import AppState, AppStateDep
from app.core.errors import ServiceError

router = APIRouter()

LOGIN_PATH = PREFIX + "/login"
_LOGIN_CSRF_TTL_S = 3600
_MAX_KEY_CHARS = 1024


def _secure(request: Request, state: AppState) -> bool:
    """Secure cookies over https, and always in production (behind a TLS proxy)."""
    return request.url.scheme == "https" or state.settings.environment == "production"


def _client(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown"


def _login_page(
    request: Request, state: AppState, *, next_path: str, error: str | None = None,
    status_code: int = 200, headers: dict[str, str] | None = None,
) -> HTMLResponse:
    token = request.cookies.get(LOGIN_CSRF_COOKIE) or secrets.token_urlsafe(24)
    response = render(
        request, "login.html",
        {"login_csrf": token, "next_path": next_path, "error": error,
         "no_auth": state.settings.no_auth, "title": "Log in"},
        status_code=status_code, headers=headers,
    )
    response.set_cookie(
        LOGIN_CSRF_COOKIE, token, max_age=_LOGIN_CSRF_TTL_S, path=LOGIN_PATH, httponly=True,
        samesite="strict", secure=_secure(request, state),
    )
    return response


@router.get(LOGIN_PATH, response_class=HTMLResponse)
def login_form(request: Request, ui: UIDep, state: AppStateDep, next: str | None = None
               ) -> Response:
    session = read_session(request, ui)
    if session is not None and admin_principal(state, ui, session) is not None:
        return RedirectResponse(safe_next(next), status_code=303)
    return _login_page(request, state, next_path=safe_next(next))


def _refuse(request: Request, ui: AdminUI, state: AppState, next_path: str, message: str
            ) -> HTMLResponse:
    ui.throttle.failed(_client(request))
    return _login_page(request, state, next_path=next_path, error=message, status_code=401)


@router.post(LOGIN_PATH, response_class=HTMLResponse)
async def login(request: Request, ui: UIDep, state: AppStateDep) -> Response:
    form = await request.form()
    next_path = safe_next(str(form.get("next") or ""))
    sent_token = form.get(CSRF_FIELD)
    cookie_token = request.cookies.get(LOGIN_CSRF_COOKIE)
    if not (isinstance(sent_token, str) and cookie_token
            and same_token(sent_token, cookie_token)):
        raise UIError(
            403, "The login form's security token is missing or does not match (cookies "
            "may be blocked, or the form came from another site). Reload the login page and "
            "try again.", title="Refused: missing security token",
        )
    wait = ui.throttle.retry_after(_client(request))
    if wait is not None:
        retry = max(1, math.ceil(wait))
        return _login_page(
            request, state, next_path=next_path, status_code=429,
            headers={"Retry-After": str(retry)},
            error=f"Too many failed logins from this address; try again in {retry} seconds.",
        )
    raw = form.get("key")
    key = raw.strip() if isinstance(raw, str) else ""
    if not key and state.settings.no_auth:
        actor, fingerprint = LOCAL, None
    elif not key:
        return _refuse(request, ui, state, next_path, "Enter an admin key.")
    else:
        if len(key) > _MAX_KEY_CHARS:
            return _refuse(request, ui, state, next_path, "That is not an admin key.")
        try:
            principal = state.directory.authenticate(f"Bearer {key}")
        except ServiceError as exc:
            return _refuse(request, ui, state, next_path, f"Login failed: {exc.message}")
        if not principal.is_admin:
            return _refuse(
                request, ui, state, next_path,
                "Login failed: this key belongs to a tenant. The admin UI needs an admin key "
                "(LORAPLEX_ADMIN_KEY, or one created with POST /admin/keys).",
            )
        actor = principal.actor
        fingerprint = ui.signer.bootstrap_fingerprint(key) if actor == BOOTSTRAP else None
    ui.throttle.succeeded(_client(request))
    now = int(time.time())
    session, token = ui.signer.issue(
        actor, now=now, ttl_s=ui.session_ttl_s, key_fingerprint=fingerprint
    )
    response = RedirectResponse(next_path, status_code=303)
    response.set_cookie(
        SESSION_COOKIE, token, max_age=ui.session_ttl_s, expires=session.expires_at - now,
        path=PREFIX, httponly=True, samesite="strict", secure=_secure(request, state),
    )
    response.delete_cookie(LOGIN_CSRF_COOKIE, path=LOGIN_PATH)
    return response


@router.post(PREFIX + "/logout")
def logout(request: Request, authed: AuthedDep, form: CheckedForm, ui: UIDep,
           state: AppStateDep) -> Response:
    ui.end(authed.session)
    response = RedirectResponse(LOGIN_PATH, status_code=303)
    response.delete_cookie(SESSION_COOKIE, path=PREFIX, httponly=True, samesite="strict",
                           secure=_secure(request, state))
    return response
