"""What every change made through the UI does, as the admin API does it: audited under
the admin's actor, committed, then visible to this replica's directory at once."""

from __future__ import annotations

import logging

from fastapi import Request
from sqlalchemy.orm import Session

from admin_ui.deps import Authed
from app.api.state import AppState
from app.audit import AuditContext

logger = logging.getLogger(__name__)


def by(request: Request, authed: Authed) -> AuditContext:
    """The audit context: the admin key's id (or "bootstrap"), and the request id."""
    return AuditContext(actor=authed.actor, request_id=getattr(request.state, "request_id", None))


def refresh_directory(state: AppState) -> None:
    """Blocking: call from a thread (sync routes run in one)."""
    try:
        state.directory.refresh()
    except Exception:
        # Committed already; the background refresh picks the change up shortly.
        logger.warning("directory refresh after an admin UI change failed", exc_info=True)


def commit(session: Session, state: AppState) -> None:
    session.commit()
    refresh_directory(state)
