"""GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.protocol import ModelCard, ModelList
from app.api.state import AppStateDep

router = APIRouter(tags=["models"])


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: AppStateDep) -> ModelList:
    engine = state.engine
    base = engine.model_id
    cards = [ModelCard(id=base, created=state.started_at, root=base)]
    cards.extend(
        ModelCard(id=a.name, created=a.created, parent=base, root=base)
        for a in engine.list_adapters()
    )
    return ModelList(data=cards)
