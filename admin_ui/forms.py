"""Reading the UI's HTML forms: text fields, optional whole numbers, quotas. Problems
become messages for the form's page, never a 500."""

from __future__ import annotations

from starlette.datastructures import FormData

from app.tenants import QUOTA_FIELDS


class FormProblem(ValueError):
    """A field the user filled in wrongly; the message names it."""


def text(form: FormData, name: str) -> str:
    value = form.get(name)
    return value.strip() if isinstance(value, str) else ""


def optional_int(form: FormData, name: str, label: str | None = None) -> int | None:
    raw = text(form, name)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise FormProblem(f"{label or name} must be a whole number, got '{raw}'.") from None


def quotas(form: FormData) -> dict[str, int | None]:
    """Every quota of the form (empty: unlimited)."""
    return {name: optional_int(form, name, f"The quota '{name}'") for name in QUOTA_FIELDS}


def checked(form: FormData, name: str) -> bool:
    return text(form, name) in ("on", "true", "1")
