"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app.api.generation import CLIENT_CLOSED_REQUEST, EventStreamResponse, unless_disconnected
from app.api.protocol import CompletionRequest, CompletionResponse
from app.api.responses import completion_response, completion_stream
from app.api.serving import check_admission, plan_completion, read_body
from app.api.state import AppStateDep

router = APIRouter(tags=["completions"])


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": CompletionRequest.model_json_schema()}}}},
)
async def create_completion(request: Request, state: AppStateDep) -> Response:
    body = await read_body(request, CompletionRequest)
    plan = plan_completion(state, body)
    check_admission(state, plan.num_choices)
    if plan.stream:
        return EventStreamResponse(completion_stream(state, plan))
    result = await unless_disconnected(request, completion_response(state, plan))
    if result is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return Response(result.model_dump_json(), media_type="application/json")
