"""Billing periods: calendar months in UTC, written "YYYY-MM"."""

from __future__ import annotations

import re
from datetime import UTC, datetime

_PERIOD = re.compile(r"^(\d{4})-(0[1-9]|1[0-2])$")


def check_period(period: str) -> str:
    """Return ``period`` if it is a valid "YYYY-MM" month, else raise ValueError."""
    if not isinstance(period, str) or not _PERIOD.match(period):
        raise ValueError(f"period must be 'YYYY-MM', got {period!r}")
    return period


def period_of(at: datetime) -> str:
    """The billing period a moment falls in (naive datetimes are taken as UTC)."""
    if at.tzinfo is not None:
        at = at.astimezone(UTC)
    return f"{at.year:04d}-{at.month:02d}"


def next_period(period: str) -> str:
    year, month = (int(part) for part in check_period(period).split("-"))
    return f"{year + 1:04d}-01" if month == 12 else f"{year:04d}-{month + 1:02d}"


def previous_period(period: str) -> str:
    year, month = (int(part) for part in check_period(period).split("-"))
    return f"{year - 1:04d}-12" if month == 1 else f"{year:04d}-{month - 1:02d}"


def month_start(period: str) -> datetime:
    """The first moment (UTC) of a period."""
    year, month = (int(part) for part in check_period(period).split("-"))
    return datetime(year, month, 1, tzinfo=UTC)


def billed_period(created_at: datetime, *, last_finalized: str | None) -> str:
    """The period a usage row is billed in.

    NOTE: a row is billed in the month it happened unless that month's invoice is already
    final; then it goes to the first open month (as an adjustment line there), so a
    finalised invoice never changes.
    """
    period = period_of(created_at)
    if last_finalized is not None and period <= check_period(last_finalized):
        return next_period(last_finalized)
    return period
