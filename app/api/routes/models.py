"""GET /v1/models and GET /v1/models/{id}: the base model and every adapter the caller
may use."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import ServingPrincipal
from app.api.errors import model_not_found
from app.api.openai.planning import preloaded_adapters, resolve_target
from app.api.openai.protocol import ModelCard, ModelList
from app.api.openapi import act_for_tenant_parameter, error_responses
from app.api.state import AppState, AppStateDep

router = APIRouter(tags=["models"])


def _base_card(state: AppState) -> ModelCard:
    base = state.engine.model_id
    return ModelCard(id=base, created=state.started_at, root=base)


def _adapter_card(state: AppState, model: str, created: int) -> ModelCard:
    base = state.engine.model_id
    return ModelCard(id=model, created=created, parent=base, root=base)


@router.get(
    "/v1/models",
    response_model=ModelList,
    responses=error_responses(404),
    openapi_extra=act_for_tenant_parameter(),
)
async def list_models(state: AppStateDep, principal: ServingPrincipal) -> ModelList:
    engine = state.engine
    cards = [_base_card(state)]
    names = set()
    for ref in state.directory.visible_adapters(principal.adapter_owner_id):
        names.add(ref.name)
        cards.append(_adapter_card(state, ref.name, ref.created))
    for name in preloaded_adapters(engine):
        info = engine.get_adapter(name)
        if info is None or name in names:  # removed meanwhile, or shadowed by the caller's own
            continue
        cards.append(_adapter_card(state, name, info.created))
    return ModelList(data=cards)


# NOTE: a path converter: adapter names may hold '/' (ADAPTER_NAME in engine_core.py).
@router.get(
    "/v1/models/{model_id:path}",
    response_model=ModelCard,
    responses=error_responses(404),
    openapi_extra=act_for_tenant_parameter(),
)
async def retrieve_model(
    model_id: str, state: AppStateDep, principal: ServingPrincipal
) -> ModelCard:
    """Any model id that `model` of a generation request accepts, as `/v1/models` lists
    it (an adapter's `name@version` too); 404 `model_not_found` for any other."""
    target = resolve_target(state, principal, model_id)
    if target.engine_adapter is None:
        return _base_card(state)
    if target.ref is not None:
        return _adapter_card(state, model_id, target.ref.created)
    info = state.engine.get_adapter(model_id)
    if info is None:  # removed since resolving
        raise model_not_found(model_id)
    return _adapter_card(state, model_id, info.created)
