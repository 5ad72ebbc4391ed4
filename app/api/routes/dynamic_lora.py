"""vLLM's dynamic LoRA endpoints, with its request and response shapes, for the Gateway API
Inference Extension's adapter syncer and for scripts written against vLLM; admin keys only.

`POST /v1/load_lora_adapter` `{"lora_name", "lora_path", "load_inplace"}` imports the adapter
at `lora_path` into the registry as a shared adapter named `lora_name`, with every check an
upload gets, so that each replica on the same database serves it. `lora_path` is an s3://
prefix (read with this server's AWS credentials) or a directory on this machine under one
of `LORAPLEX_ADAPTER_IMPORT_DIRS` (unset: loads from a local path are refused). A name that
exists answers 200 again when its latest version holds the same content (each pod's syncer
may ask), and 400 for other content unless `load_inplace` (then it becomes the name's next
version).

`POST /v1/unload_lora_adapter` `{"lora_name"}` deletes the shared adapter of that name.

Both answer 200 with vLLM's plain-text line, and errors as OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import AdminPrincipal, audit_context
from app.api.openapi import error_responses
from app.api.state import AppState, AppStateDep
from app.core.errors import Forbidden, InvalidInput, NotFound
from app.core.principal import Principal
from app.registry.archive import directory_digest
from app.registry.views import SHARED_OWNER, AdapterView, check_adapter_name
from app.tables import AdapterStatus

router = APIRouter(tags=["adapters"])

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
_MAX_PATH_CHARS = 4096


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=64)
    lora_path: str = Field(min_length=1, max_length=_MAX_PATH_CHARS)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=64)
    lora_int_id: int | None = None  # vLLM's; names are what identify adapters here


@router.post(LOAD_PATH, response_class=PlainTextResponse,
             responses=error_responses(400, 403, 404, 409, 413, 422, 503))
async def load_lora_adapter(
    body: LoadLoRAAdapterRequest, request: Request, principal: AdminPrincipal,
    state: AppStateDep,
) -> PlainTextResponse:
    try:
        check_adapter_name(body.lora_name, base_model_id=state.engine.model_id)
    except InvalidInput as e:
        raise InvalidInput(e.message, param="lora_name", code=e.code) from None
    if body.lora_path.startswith("s3://"):
        async with state.registry.imported(body.lora_path, param="lora_path") as source:
            return await _load(body, source, request, principal, state)
    return await _load(body, import_source(body.lora_path, state.settings.import_roots),
                       request, principal, state)


async def _load(body: LoadLoRAAdapterRequest, source: Path, request: Request,
                principal: Principal, state: AppState) -> PlainTextResponse:
    registry = state.registry
    existing = await asyncio.to_thread(_shared_adapter, state, body.lora_name)
    if existing is not None:
        ready = [v for v in existing.versions if v.status == AdapterStatus.READY]
        digest = await asyncio.to_thread(directory_digest, source, registry.unpacked_limit())
        if ready and digest is not None and ready[-1].sha256 == digest:
            return PlainTextResponse(
                f"Success: LoRA adapter '{body.lora_name}' is already loaded."
            )
        if not body.load_inplace:
            raise InvalidInput(
                f"The lora adapter '{body.lora_name}' has already been loaded with other "
                "content; set load_inplace to make this its next version.",
                param="lora_name", code="adapter_exists",
            )
    await registry.upload(
        source, name=body.lora_name, tenant_id=None, by=audit_context(request, principal),
        param="lora_path",
    )
    await asyncio.to_thread(state.directory.refresh_after_write)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post(UNLOAD_PATH, response_class=PlainTextResponse, responses=error_responses(400, 404))
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, request: Request, principal: AdminPrincipal,
    state: AppStateDep,
) -> PlainTextResponse:
    existing = await asyncio.to_thread(_shared_adapter, state, body.lora_name)
    if existing is None:
        raise NotFound(
            f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name"
        )
    await state.registry.delete(existing.id, owner=None, by=audit_context(request, principal))
    await asyncio.to_thread(state.directory.refresh_after_write)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def import_source(raw: str, roots: tuple[Path, ...]) -> Path:
    """The directory `raw` names, its links resolved, if it lies under one of `roots`."""
    if "\x00" in raw or not os.path.isabs(raw):
        raise InvalidInput("lora_path must be an absolute path.", param="lora_path")
    if not roots:
        raise Forbidden(
            "Loading adapters from a path is off on this server: an operator sets "
            "LORAPLEX_ADAPTER_IMPORT_DIRS to the directories they may come from.",
            param="lora_path", code="imports_disabled",
        )
    real = Path(os.path.realpath(raw))
    if not any(real.is_relative_to(os.path.realpath(root)) for root in roots):
        raise Forbidden(
            "lora_path must lie under one of the import directories: "
            + ", ".join(str(root) for root in roots) + ".",
            param="lora_path", code="path_not_allowed",
        )
    if not real.is_dir():
        raise InvalidInput(
            f"lora_path {raw!r} is not a directory (a PEFT adapter directory is expected).",
            param="lora_path",
        )
    return real


def _shared_adapter(state: AppState, name: str) -> AdapterView | None:
    for view in state.registry.list_adapters(owner=SHARED_OWNER):
        if view.name == name:
            return view
    return None
