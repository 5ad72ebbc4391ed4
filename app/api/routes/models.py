"""GET /v1/models: the base model and every adapter the caller may use."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import ServingPrincipal
from app.api.protocol import ModelCard, ModelList
from app.api.serving import preloaded_adapters
from app.api.state import AppStateDep

router = APIRouter(tags=["models"])


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: AppStateDep, principal: ServingPrincipal) -> ModelList:
    engine = state.engine
    base = engine.model_id
    cards = [ModelCard(id=base, created=state.started_at, root=base)]
    names = set()
    for ref in state.directory.visible_adapters(principal.adapter_owner_id):
        names.add(ref.name)
        cards.append(ModelCard(id=ref.name, created=ref.created, parent=base, root=base))
    for name in preloaded_adapters(engine):
        info = engine.get_adapter(name)
        if info is None or name in names:  # removed meanwhile, or shadowed by the caller's own
            continue
        cards.append(ModelCard(id=name, created=info.created, parent=base, root=base))
    return ModelList(data=cards)
