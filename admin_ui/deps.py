"""Route dependencies of the admin UI: the logged-in admin (re-checked on every request)
and the CSRF check of every state-changing request."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from starlette.datastructures import FormData

from admin_ui.sessions import BOOTSTRAP, CSRF_FIELD, CSRF_HEADER, LOCAL, SESSION_COOKIE, UISession
from admin_ui.web import AdminUI, LoginRequired, UIError, get_ui
from app.api.state import AppState, AppStateDep
from app.core.principal import LOCAL_PRINCIPAL, Principal
from app.directory import ALL_SCOPES
from app.tables import ApiKey, utcnow

UIDep = Annotated[AdminUI, Depends(get_ui)]

CSRF_REFUSED = (
    "This request did not carry this session's security (CSRF) token, so nothing was "
    "changed. Reload the page and try again."
)


@dataclass(frozen=True, slots=True)
class Authed:
    """A request of a logged-in admin."""

    principal: Principal  # as the admin API would see the same key
    session: UISession
    csrf_token: str

    @property
    def actor(self) -> str:
        return self.principal.actor


def admin_principal(state: AppState, ui: AdminUI, session: UISession) -> Principal | None:
    """The admin a session stands for, if that key may still act now (blocking: it reads
    the key's row, so that a revocation ends the session at once on every replica)."""
    if session.actor == LOCAL:
        return LOCAL_PRINCIPAL if state.settings.no_auth else None
    if session.actor == BOOTSTRAP:
        admin_key = state.settings.admin_key
        if not admin_key or session.key_fingerprint is None:
            return None
        if ui.signer.bootstrap_fingerprint(admin_key) != session.key_fingerprint:
            return None
        return Principal(actor=BOOTSTRAP, key_id=None, tenant=None, is_admin=True,
                         scopes=ALL_SCOPES)
    with state.db() as db:
        row = db.get(ApiKey, session.actor)
        if row is None or not row.is_admin or row.revoked_at is not None:
            return None
        if row.expires_at is not None and row.expires_at <= utcnow():
            return None
        return Principal(actor=row.id, key_id=row.id, tenant=None, is_admin=True,
                         scopes=ALL_SCOPES)


def read_session(request: Request, ui: AdminUI) -> UISession | None:
    session = ui.signer.read(request.cookies.get(SESSION_COOKIE), now=int(time.time()))
    if session is None or ui.ended(session):
        return None
    return session


def current_admin(request: Request, ui: UIDep, state: AppStateDep) -> Authed:
    """The logged-in admin; LoginRequired otherwise. A plain `def`: FastAPI runs it in
    its thread pool, off the event loop, because of the database read."""
    session = read_session(request, ui)
    principal = None if session is None else admin_principal(state, ui, session)
    if session is None or principal is None:
        raise LoginRequired
    request.state.principal = principal
    return Authed(principal=principal, session=session,
                  csrf_token=ui.signer.csrf_token(session))


AuthedDep = Annotated[Authed, Depends(current_admin)]


async def checked_form(request: Request, authed: AuthedDep, ui: UIDep) -> FormData:
    """A state-changing request's form, once its CSRF token (the X-CSRF-Token header or
    the form's csrf_token field) proved it came from one of this session's pages."""
    content_type = request.headers.get("content-type", "")
    # NOTE: only small url-encoded forms are parsed here; multipart uploads are streamed
    # by their own route and must send the header.
    if content_type.startswith("application/x-www-form-urlencoded"):
        form = await request.form()
    else:
        form = FormData()
    token = request.headers.get(CSRF_HEADER)
    if token is None:
        field = form.get(CSRF_FIELD)
        token = field if isinstance(field, str) else None
    if not ui.signer.check_csrf(authed.session, token):
        raise UIError(403, CSRF_REFUSED, title="Refused: missing security token")
    return form


CheckedForm = Annotated[FormData, Depends(checked_form)]


async def check_csrf_header(request: Request, authed: AuthedDep, ui: UIDep) -> Authed:
    """For streamed bodies: the token must come in the header, before the body is read."""
    if not ui.signer.check_csrf(authed.session, request.headers.get(CSRF_HEADER)):
        raise UIError(403, CSRF_REFUSED, title="Refused: missing security token")
    return authed


CsrfHeaderAuthed = Annotated[Authed, Depends(check_csrf_header)]
