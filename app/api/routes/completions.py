"""POST /v1/completions."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response

from app.api.deps import ServingPrincipal
from app.api.openai.generation import serve_generation
from app.api.openai.planning import plan_completion, read_body
from app.api.openai.protocol import CompletionRequest, CompletionResponse
from app.api.openai.rendering import CompletionRenderer
from app.api.openapi import (
    act_for_tenant_parameter,
    error_responses,
    event_stream,
    request_body,
)
from app.api.state import AppStateDep

router = APIRouter(tags=["completions"])


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={
        200: {"description": "The completion", "content": event_stream(
            CompletionResponse, 'With `"stream": true`: one event per chunk, then `[DONE]`'
        )},
        **error_responses(404, 429, 502, 503, 504),
    },
    openapi_extra=request_body(CompletionRequest) | act_for_tenant_parameter(),
)
async def create_completion(
    request: Request, state: AppStateDep, principal: ServingPrincipal
) -> Response:
    body = await read_body(request, CompletionRequest)
    # NOTE: in a thread: tokenizing a prompt of a few MB takes seconds, which would stall
    # every other tenant's streams on the event loop.
    plan = await asyncio.to_thread(plan_completion, state, body, principal)
    renderer = CompletionRenderer(plan, state.engine.token_text)
    return await serve_generation(request, state, plan, renderer)
