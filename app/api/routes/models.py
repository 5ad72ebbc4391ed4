"""GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.protocol import ModelCard, ModelList
from app.api.state import AppStateDep

router = APIRouter(tags=["models"])


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: AppStateDep) -> ModelList:
    return ModelList(data=[ModelCard(id=state.engine.model_id, created=state.started_at)])
