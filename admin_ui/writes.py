"""What every change made through the UI does, as the admin API does it: audited under
the admin's actor, committed, then visible to this replica's directory at once."""

from __future__ import annotations

from fastapi import Request
from sqlalchemy.orm import Session

from admin_ui.deps import Authed
from app.api.state import AppState
from app.audit import AuditContext


def by(request: Request, authed: Authed) -> AuditContext:
    """The audit context: the admin key's id (or "bootstrap"), and the request id."""
    return AuditContext(actor=authed.actor, request_id=getattr(request.state, "request_id", None))


def commit(session: Session, state: AppState) -> None:
    session.commit()
    state.directory.refresh_after_write()
