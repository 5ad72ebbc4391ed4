"""Adapter uploads, listing and deletion: the admin routes (any owner) and the tenant
routes (`adapters:write` keys, the caller's own tenant only).

Uploads are multipart forms (`file`: a .zip or .tar.gz of a PEFT directory, `name`,
and on the admin route `tenant_id`, omitted for a shared adapter). Their bodies skip the
general body limit (see UPLOAD_PATHS) and are streamed to disk under their own. They
answer 201 with the adapter (its id is the one GET and DELETE take, also in `Location`)
and, flat, the version they made.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from starlette.requests import ClientDisconnect

from app.api.deps import AdminPrincipal, audit_context, require_scope
from app.api.errors import APIError
from app.api.openapi import error_responses, request_body
from app.api.schemas.adapters import (
    AdapterImport,
    AdapterList,
    AdapterOut,
    AdapterUpload,
    AdapterUploadOut,
    AdminAdapterUpload,
    EvalList,
    EvalOut,
    OrphanCollection,
)
from app.api.state import AppState, AppStateDep
from app.audit import AuditContext
from app.core.errors import InvalidInput, Unavailable
from app.core.principal import Principal
from app.evals.dataset import EvalSetError, parse_eval_set
from app.registry.object_store import StoreUnavailable
from app.registry.service import AdapterRegistry
from app.registry.upload_form import (
    FORM_OVERHEAD_BYTES,
    FormError,
    UploadForm,
    file_too_large,
    read_upload_form,
)
from app.registry.views import SHARED_OWNER, VersionView
from app.tables import Scope

ADMIN_ADAPTERS = "/admin/adapters"
TENANT_ADAPTERS = "/v1/adapters"
# For RequestContextMiddleware(unlimited_paths=...): these enforce their own limit.
UPLOAD_PATHS = frozenset({ADMIN_ADAPTERS, TENANT_ADAPTERS})


router = APIRouter()

AdapterWriter = Annotated[Principal, require_scope(Scope.ADAPTERS_WRITE)]

_NO_TENANT_FIELD = (
    "tenant_id cannot be set here: uploads to /v1/adapters always go to the caller's own "
    "tenant."
)


async def _refresh(state: AppState) -> None:
    await asyncio.to_thread(state.directory.refresh_after_write)


def _own(principal: Principal) -> str:
    """The owner a tenant route acts for: the key's tenant (shared for admin keys)."""
    return principal.tenant_id or SHARED_OWNER


@asynccontextmanager
async def received_upload(
    request: Request,
    registry: AdapterRegistry,
    *,
    text_fields: frozenset[str],
    unknown_field_messages: dict[str, str] | None = None,
) -> AsyncIterator[UploadForm]:
    """The upload's form, its file streamed into <data_dir>/tmp/ (removed afterwards)."""
    limit = registry.upload_limit()
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit + FORM_OVERHEAD_BYTES:
        error = file_too_large(limit)
        raise APIError(error.status_code, error.message, code=error.code)
    dest = await asyncio.to_thread(registry.store.new_temp_file, "upload-")
    try:
        try:
            form = await read_upload_form(
                request.stream(),
                request.headers.get("content-type"),
                dest,
                max_file_bytes=limit,
                text_fields=text_fields,
                unknown_field_messages=unknown_field_messages,
            )
        except FormError as e:
            raise APIError(e.status_code, e.message, code=e.code, param=e.param) from None
        except ClientDisconnect:
            raise APIError(400, "The client went away during the upload.") from None
        if not form.fields.get("name"):
            raise APIError(400, "Missing required form field 'name'.", param="name")
        yield form
    finally:
        await asyncio.to_thread(dest.unlink, True)


# ------------------------------------------------------------------------------ admin


@router.post(
    ADMIN_ADAPTERS,
    status_code=201,
    response_model=AdapterUploadOut,
    responses=error_responses(400, 404, 409, 422, 503),
    openapi_extra=request_body(AdminAdapterUpload, "multipart/form-data"),
)
async def admin_upload(
    request: Request, response: Response, principal: AdminPrincipal, state: AppStateDep
) -> AdapterUploadOut:
    uploaded = await upload_for_admin(request, state, by=audit_context(request, principal))
    response.headers["Location"] = f"{ADMIN_ADAPTERS}/{uploaded.id}"
    return uploaded


async def upload_for_admin(request: Request, state: AppState, *, by: AuditContext
                           ) -> AdapterUploadOut:
    """The admin upload form (file, name, tenant_id: omitted = shared; stage: "true" keeps
    the version staged until promoted), streamed into the registry; the admin API and the
    admin UI both take uploads through here."""
    registry = state.registry
    async with received_upload(
        request, registry, text_fields=frozenset({"name", "tenant_id", "stage"})
    ) as form:
        stage = form.fields.get("stage", "").lower()
        if stage not in ("", "true", "false"):
            raise InvalidInput("'stage' must be true or false.", param="stage")
        version = await registry.upload(
            form.file,
            name=form.fields["name"],
            tenant_id=form.fields.get("tenant_id") or None,
            by=by,
            stage=stage == "true",
        )
    return await _uploaded(state, version, by)


async def _uploaded(state: AppState, version: VersionView, by: AuditContext
                    ) -> AdapterUploadOut:
    await _refresh(state)
    # A staged version of a gated adapter: its gate eval runs in the background.
    state.evals.start_gate(version, by)
    adapter = await asyncio.to_thread(state.registry.get_adapter, version.adapter_id)
    return AdapterUploadOut.of_upload(adapter, version)


@router.post(
    ADMIN_ADAPTERS + "/import",
    status_code=201,
    response_model=AdapterUploadOut,
    responses=error_responses(400, 404, 409, 413, 422, 503),
)
async def admin_import(
    body: AdapterImport, request: Request, response: Response, principal: AdminPrincipal,
    state: AppStateDep,
) -> AdapterUploadOut:
    """An adapter from an object store prefix (`s3://bucket/path/`, read with the server's
    AWS credentials), checked as an upload; 201 with the same body."""
    by = audit_context(request, principal)
    version = await state.registry.import_url(
        body.source, name=body.name, tenant_id=body.tenant_id, by=by,
    )
    uploaded = await _uploaded(state, version, by)
    response.headers["Location"] = f"{ADMIN_ADAPTERS}/{uploaded.id}"
    return uploaded


@router.post(ADMIN_ADAPTERS + "/gc", response_model=OrphanCollection,
             responses=error_responses(503))
async def admin_gc(principal: AdminPrincipal, state: AppStateDep) -> OrphanCollection:
    """Remove stored adapter files (here and in the object store) that no version uses
    and nothing touched within the delete grace period."""
    try:
        removed = await asyncio.to_thread(state.registry.collect_orphans)
    except StoreUnavailable as e:
        raise Unavailable(f"The adapter store cannot be reached: {e}.",
                          retry_after_s=state.settings.retry_after_s) from None
    return OrphanCollection(removed=removed)


@router.get(ADMIN_ADAPTERS, response_model=AdapterList)
def admin_list(
    principal: AdminPrincipal,
    state: AppStateDep,
    tenant_id: str | None = None,
    include_deleted: bool = False,
) -> AdapterList:
    """tenant_id: one tenant's adapters ("shared": the shared ones); omitted: all."""
    views = state.registry.list_adapters(owner=tenant_id, include_deleted=include_deleted)
    return AdapterList(data=[AdapterOut.of(v) for v in views])


@router.get(
    ADMIN_ADAPTERS + "/{adapter_id}", response_model=AdapterOut, responses=error_responses(404)
)
def admin_get(adapter_id: str, principal: AdminPrincipal, state: AppStateDep) -> AdapterOut:
    return AdapterOut.of(state.registry.get_adapter(adapter_id))


@router.delete(
    ADMIN_ADAPTERS + "/{adapter_id}", response_model=AdapterOut, responses=error_responses(404)
)
async def admin_delete(
    adapter_id: str, request: Request, principal: AdminPrincipal, state: AppStateDep
) -> AdapterOut:
    view = await state.registry.delete(
        adapter_id, owner=None, by=audit_context(request, principal)
    )
    await _refresh(state)
    return AdapterOut.of(view)


# ------------------------------------------------------------------------------ evals

# An eval set's body (JSONL, app/evals/dataset.py) is read whole: the general body limit
# (LORAPLEX_MAX_BODY_BYTES) and the set's own (4 MiB) bound it.
EVAL_SET_BODY = {"requestBody": {"required": True, "content": {
    "application/jsonl": {"schema": {"type": "string"}},
    "application/x-ndjson": {"schema": {"type": "string"}},
}}}


@router.post(
    ADMIN_ADAPTERS + "/{adapter_id}/evals", response_model=EvalOut, status_code=202,
    responses=error_responses(400, 404, 409), openapi_extra=EVAL_SET_BODY,
)
async def admin_start_eval(
    adapter_id: str, request: Request, principal: AdminPrincipal, state: AppStateDep,
    version: int | None = None,
) -> EvalOut:
    """Score an eval set (the body: JSONL, one item per line) on a version of the adapter
    (default: its latest ready one), the ready version before it and the base model, in
    the background at the batch tier's priority. 202 with the eval; GET it for progress."""
    data = await request.body()
    view = await state.evals.start(adapter_id, data, version=version,
                                   by=audit_context(request, principal))
    return EvalOut.of(view)


@router.get(ADMIN_ADAPTERS + "/{adapter_id}/evals", response_model=EvalList,
            responses=error_responses(404))
def admin_list_evals(adapter_id: str, principal: AdminPrincipal, state: AppStateDep
                     ) -> EvalList:
    """Every eval of the adapter, oldest first."""
    return EvalList(data=[EvalOut.of(v) for v in state.evals.list_evals(adapter_id)])


@router.get(ADMIN_ADAPTERS + "/{adapter_id}/evals/{eval_id}", response_model=EvalOut,
            responses=error_responses(404))
def admin_get_eval(adapter_id: str, eval_id: str, principal: AdminPrincipal,
                   state: AppStateDep) -> EvalOut:
    view = state.evals.get_eval(eval_id)
    if view.adapter_id != adapter_id:
        raise APIError(404, f"no eval {eval_id!r} of adapter {adapter_id!r}",
                       code="not_found")
    return EvalOut.of(view)


# ------------------------------------------------------------------- promotion gate


@router.put(
    ADMIN_ADAPTERS + "/{adapter_id}/gate", response_model=AdapterOut,
    responses=error_responses(400, 404), openapi_extra=EVAL_SET_BODY,
)
async def admin_set_gate(
    adapter_id: str, request: Request, principal: AdminPrincipal, state: AppStateDep,
    threshold: Annotated[float | None, Query(ge=0.0, le=1.0)] = None,
) -> AdapterOut:
    """Turn the adapter's promotion gate on, with its eval set (the body: JSONL, as for an
    eval) and an optional minimum score: from now on each new version is staged, run
    through the set, and promoted only if it scores at least what the current version
    does (and `threshold`)."""
    await asyncio.to_thread(state.registry.get_adapter, adapter_id)  # 404 before the set
    data = await request.body()
    try:
        await asyncio.to_thread(parse_eval_set, data)
    except EvalSetError as e:
        raise InvalidInput(str(e), code="invalid_eval_set") from None
    view = await asyncio.to_thread(state.registry.set_gate, adapter_id, data, threshold,
                                   by=audit_context(request, principal))
    return AdapterOut.of(view)


@router.delete(ADMIN_ADAPTERS + "/{adapter_id}/gate", response_model=AdapterOut,
               responses=error_responses(404))
async def admin_clear_gate(adapter_id: str, request: Request, principal: AdminPrincipal,
                           state: AppStateDep) -> AdapterOut:
    """Turn the gate off: new versions are current once ready (staged ones stay staged
    until promoted)."""
    view = await asyncio.to_thread(state.registry.set_gate, adapter_id, None, None,
                                   by=audit_context(request, principal))
    return AdapterOut.of(view)


@router.post(ADMIN_ADAPTERS + "/{adapter_id}/promote", response_model=AdapterOut,
             responses=error_responses(404, 409))
async def admin_promote(adapter_id: str, version: int, request: Request,
                        principal: AdminPrincipal, state: AppStateDep) -> AdapterOut:
    """A staged version becomes what plain `name` resolves to (409 for a version that is
    not ready, not staged, or older than the current one)."""
    view = await asyncio.to_thread(state.registry.promote, adapter_id, version,
                                   by=audit_context(request, principal))
    await _refresh(state)
    return AdapterOut.of(view)


@router.post(ADMIN_ADAPTERS + "/{adapter_id}/rollback", response_model=AdapterOut,
             responses=error_responses(404, 409))
async def admin_rollback(adapter_id: str, request: Request, principal: AdminPrincipal,
                         state: AppStateDep) -> AdapterOut:
    """The current version goes back to staged: plain `name` resolves to the promoted
    version before it again (409 when there is none)."""
    view = await asyncio.to_thread(state.registry.rollback, adapter_id,
                                   by=audit_context(request, principal))
    await _refresh(state)
    return AdapterOut.of(view)


# ----------------------------------------------------------------------------- tenant


@router.post(
    TENANT_ADAPTERS,
    status_code=201,
    response_model=AdapterUploadOut,
    responses=error_responses(400, 409, 422, 503),
    openapi_extra=request_body(AdapterUpload, "multipart/form-data"),
)
async def tenant_upload(
    request: Request, response: Response, principal: AdapterWriter, state: AppStateDep
) -> AdapterUploadOut:
    registry = state.registry
    async with received_upload(
        request,
        registry,
        text_fields=frozenset({"name"}),
        unknown_field_messages={"tenant_id": _NO_TENANT_FIELD},
    ) as form:
        by = audit_context(request, principal)
        version = await registry.upload(
            form.file,
            name=form.fields["name"],
            tenant_id=principal.tenant_id,
            by=by,
            enforce_quota=principal.tenant is not None,
        )
    uploaded = await _uploaded(state, version, by)
    response.headers["Location"] = f"{TENANT_ADAPTERS}/{uploaded.id}"
    return uploaded


@router.get(TENANT_ADAPTERS, response_model=AdapterList)
def tenant_list(principal: AdapterWriter, state: AppStateDep) -> AdapterList:
    """The caller's own adapters (shared ones are listed by /v1/models)."""
    views = state.registry.list_adapters(owner=_own(principal))
    return AdapterList(data=[AdapterOut.of(v) for v in views])


@router.get(
    TENANT_ADAPTERS + "/{adapter_id}", response_model=AdapterOut, responses=error_responses(404)
)
def tenant_get(adapter_id: str, principal: AdapterWriter, state: AppStateDep) -> AdapterOut:
    return AdapterOut.of(state.registry.get_adapter(adapter_id, owner=_own(principal)))


@router.delete(
    TENANT_ADAPTERS + "/{adapter_id}", response_model=AdapterOut, responses=error_responses(404)
)
async def tenant_delete(
    adapter_id: str, request: Request, principal: AdapterWriter, state: AppStateDep
) -> AdapterOut:
    view = await state.registry.delete(
        adapter_id, owner=_own(principal), by=audit_context(request, principal)
    )
    await _refresh(state)
    return AdapterOut.of(view)
