"""The audit log: who changed what through the admin API, written in the same
transaction as the change itself (both commit, or neither)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.tables import AuditLog


@dataclass(frozen=True, slots=True)
class AuditContext:
    """Who acts, for which request: passed to every change that is audited."""

    actor: str  # Principal.actor: an admin key's id, "bootstrap" or "local"
    request_id: str | None = None


def record_audit(
    session: Session,
    *,
    actor: str,
    action: str,
    target_type: str,
    target_id: str | None,
    details: dict[str, Any],
    request_id: str | None = None,
) -> AuditLog:
    """Add an audit row to the caller's transaction; `action` reads like `tenant.create`."""
    row = AuditLog(
        actor=actor,
        action=action,
        target_type=target_type,
        target_id=target_id,
        details=details,
        request_id=request_id,
    )
    session.add(row)
    return row


def audit(
    session: Session,
    by: AuditContext,
    action: str,
    *,
    target_type: str,
    target_id: str | None,
    details: dict[str, Any],
) -> AuditLog:
    """record_audit() for an AuditContext."""
    return record_audit(
        session,
        actor=by.actor,
        action=action,
        target_type=target_type,
        target_id=target_id,
        details=details,
        request_id=by.request_id,
    )


def list_audit(
    session: Session,
    *,
    limit: int = 100,
    target_id: str | None = None,
    actor: str | None = None,
    action: str | None = None,
) -> Sequence[AuditLog]:
    """The newest rows first (by id: `at` may tie, or run backwards between replicas)."""
    query = select(AuditLog)
    if target_id is not None:
        query = query.where(AuditLog.target_id == target_id)
    if actor is not None:
        query = query.where(AuditLog.actor == actor)
    if action is not None:
        query = query.where(AuditLog.action == action)
    return session.scalars(query.order_by(AuditLog.id.desc()).limit(limit)).all()
