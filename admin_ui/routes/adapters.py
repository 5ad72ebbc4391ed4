"""Adapters: every owner's list, an upload with progress (the admin API's streamed
upload and the registry's validation), an adapter's versions and reports, deletion."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from admin_ui.charts import BarChart, bar_chart
from admin_ui.deps import AuthedDep, CheckedForm, CsrfHeaderAuthed
from admin_ui.web import PREFIX, render
from admin_ui.writes import by
from app import tenants as crud
from app.api.deps import SessionDep
from app.api.routes.adapters import upload_for_admin
from app.api.schemas.adapters import AdapterUploadOut
from app.api.state import AppStateDep
from app.evals.service import EvalView
from app.tables import EvalStatus

router = APIRouter()

UPLOAD_PATH = PREFIX + "/adapters/upload"


@router.get(PREFIX + "/adapters", response_class=HTMLResponse)
def adapters_page(request: Request, authed: AuthedDep, session: SessionDep,
                  state: AppStateDep, deleted: str | None = None) -> HTMLResponse:
    tenants = crud.list_tenants(session, include_deleted=True)
    return render(request, "adapters.html", {
        "authed": authed, "active": "adapters", "title": "Adapters",
        "adapters": state.registry.list_adapters(),
        "tenant_names": {t.id: t.name for t in tenants},
        "owners": [("", "Shared (every tenant)")]
                  + [(t.id, t.name) for t in tenants if t.deleted_at is None],
        "upload_path": UPLOAD_PATH,
        "max_upload_bytes": state.registry.upload_limit(),
        "notice": f"Adapter {deleted} deleted." if deleted else None,
    })


@router.post(UPLOAD_PATH, status_code=201, response_model=AdapterUploadOut)
async def upload(request: Request, authed: CsrfHeaderAuthed, state: AppStateDep
                 ) -> AdapterUploadOut:
    """The admin API's upload (POST /admin/adapters), behind the session and its CSRF
    header instead of a bearer key: the same streamed form, limits and validation."""
    return await upload_for_admin(request, state, by=by(request, authed))


@router.get(PREFIX + "/adapters/{adapter_id}", response_class=HTMLResponse)
def adapter_page(adapter_id: str, request: Request, authed: AuthedDep, session: SessionDep,
                 state: AppStateDep) -> HTMLResponse:
    view = state.registry.get_adapter(adapter_id)
    owner = None if view.tenant_id is None else crud.get_tenant(session, tenant_id=view.tenant_id)
    evals = state.evals.list_evals(adapter_id)
    return render(request, "adapter.html", {
        "authed": authed, "active": "adapters", "title": f"Adapter {view.name}",
        "adapter": view, "owner": owner, "evals": list(reversed(evals)),
        "eval_chart": eval_chart(evals),
    })


def eval_chart(evals: list[EvalView]) -> BarChart | None:
    """Each version's score in its latest finished eval, and the base model's in the
    latest of all, in percent; None before any eval finished."""
    done = [e for e in evals if e.status == EvalStatus.DONE]
    if not done:
        return None
    latest = {e.version: e for e in done}  # oldest first: the last one wins
    points = [(f"v{v}", round(100 * (latest[v].scores["version"] or 0))) for v in sorted(latest)]
    points.append(("base", round(100 * (done[-1].scores["base"] or 0))))
    return bar_chart("Eval score by version (the latest eval of each)", "%", points)


@router.post(PREFIX + "/adapters/{adapter_id}/delete")
async def delete_adapter(adapter_id: str, request: Request, authed: AuthedDep,
                         form: CheckedForm, state: AppStateDep) -> Response:
    await state.registry.delete(adapter_id, owner=None, by=by(request, authed))
    await asyncio.to_thread(state.directory.refresh_after_write)
    return RedirectResponse(f"{PREFIX}/adapters?deleted={adapter_id}", status_code=303)
