"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app.api.deps import ServingPrincipal
from app.api.generation import serve_generation
from app.api.protocol import ChatCompletionRequest, ChatCompletionResponse
from app.api.responses import chat_response, chat_stream
from app.api.serving import plan_chat, read_body
from app.api.state import AppStateDep

router = APIRouter(tags=["chat"])


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": ChatCompletionRequest.model_json_schema()}}}},
)
async def create_chat_completion(
    request: Request, state: AppStateDep, principal: ServingPrincipal
) -> Response:
    body = await read_body(request, ChatCompletionRequest)
    plan = plan_chat(state, body, principal)
    return await serve_generation(request, state, plan, chat_response, chat_stream)
