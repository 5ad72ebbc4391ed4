"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app.api.deps import ServingPrincipal
from app.api.generation import serve_generation
from app.api.protocol import CompletionRequest, CompletionResponse
from app.api.responses import completion_response, completion_stream
from app.api.serving import plan_completion, read_body
from app.api.state import AppStateDep

router = APIRouter(tags=["completions"])


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": CompletionRequest.model_json_schema()}}}},
)
async def create_completion(
    request: Request, state: AppStateDep, principal: ServingPrincipal
) -> Response:
    body = await read_body(request, CompletionRequest)
    plan = plan_completion(state, body, principal)
    return await serve_generation(request, state, plan, completion_response, completion_stream)
