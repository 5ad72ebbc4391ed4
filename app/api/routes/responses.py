"""POST /v1/responses: OpenAI's Responses API, served statelessly over the chat path."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response

from app.api.deps import ServingPrincipal
from app.api.openai.generation import serve_generation
from app.api.openai.planning import read_body
from app.api.openai.planning_responses import plan_response
from app.api.openai.protocol_responses import ResponseObject, ResponsesRequest, ResponseStreamEvent
from app.api.openai.rendering_responses import ResponsesRenderer
from app.api.openapi import (
    act_for_tenant_parameter,
    error_responses,
    event_stream,
    request_body,
)
from app.api.state import AppStateDep

router = APIRouter(tags=["responses"])


@router.post(
    "/v1/responses",
    response_model=ResponseObject,
    responses={
        200: {"description": "The response", "content": event_stream(
            ResponseStreamEvent, 'With `"stream": true`: typed events (`event:` names the type)'
        )},
        **error_responses(404, 429, 502, 503, 504),
    },
    openapi_extra=request_body(ResponsesRequest) | act_for_tenant_parameter(),
)
async def create_response(
    request: Request, state: AppStateDep, principal: ServingPrincipal
) -> Response:
    body = await read_body(request, ResponsesRequest)
    # NOTE: in a thread, as for chat: tokenizing a long input would stall the event loop.
    plan = await asyncio.to_thread(plan_response, state, body, principal)
    return await serve_generation(request, state, plan, ResponsesRenderer(plan, body))
