"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app.api.generation import CLIENT_CLOSED_REQUEST, EventStreamResponse, unless_disconnected
from app.api.protocol import ChatCompletionRequest, ChatCompletionResponse
from app.api.responses import chat_response, chat_stream
from app.api.serving import check_admission, plan_chat, read_body
from app.api.state import AppStateDep

router = APIRouter(tags=["chat"])


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": ChatCompletionRequest.model_json_schema()}}}},
)
async def create_chat_completion(request: Request, state: AppStateDep) -> Response:
    body = await read_body(request, ChatCompletionRequest)
    plan = plan_chat(state, body)
    check_admission(state, plan.num_choices)
    if plan.stream:
        return EventStreamResponse(chat_stream(state, plan))
    result = await unless_disconnected(request, chat_response(state, plan))
    if result is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return Response(result.model_dump_json(), media_type="application/json")
