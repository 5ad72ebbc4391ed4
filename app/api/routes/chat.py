"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response

from app.api.deps import ServingPrincipal
from app.api.openai.generation import serve_generation
from app.api.openai.planning import plan_chat, read_body
from app.api.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from app.api.openai.rendering import ChatRenderer
from app.api.openapi import (
    act_for_tenant_parameter,
    error_responses,
    event_stream,
    request_body,
)
from app.api.state import AppStateDep

router = APIRouter(tags=["chat"])


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={
        200: {"description": "The chat completion", "content": event_stream(
            ChatCompletionChunk, 'With `"stream": true`: one event per chunk, then `[DONE]`'
        )},
        **error_responses(404, 429, 502, 503, 504),
    },
    openapi_extra=request_body(ChatCompletionRequest) | act_for_tenant_parameter(),
)
async def create_chat_completion(
    request: Request, state: AppStateDep, principal: ServingPrincipal
) -> Response:
    body = await read_body(request, ChatCompletionRequest)
    # NOTE: in a thread: tokenizing a prompt of a few MB takes seconds, which would stall
    # every other tenant's streams on the event loop.
    plan = await asyncio.to_thread(plan_chat, state, body, principal)
    return await serve_generation(request, state, plan, ChatRenderer(plan, state.engine.token_text))
