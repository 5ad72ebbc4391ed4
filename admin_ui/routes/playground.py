"""The playground: one prompt, answered by the base model and by an adapter side by side,
for a tenant chosen by the admin.

The answers run through the serving path of POST /v1/chat/completions (plan_chat and
serve_generation) as the admin acting for the tenant, as with the X-Loraplex-Tenant
header: the tenant's own and the shared adapters resolve, and the usage is the admin's,
never billed to the tenant.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from pydantic import ValidationError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from admin_ui import forms
from admin_ui.deps import Authed, AuthedDep, CheckedForm
from admin_ui.web import PREFIX, render
from app import tenants as crud
from app.api.deps import SessionDep
from app.api.errors import APIError, validation_error
from app.api.openai.generation import serve_generation
from app.api.openai.planning import plan_chat
from app.api.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
from app.api.openai.rendering import ChatRenderer
from app.api.state import AppState, AppStateDep
from app.core.errors import ServiceError
from app.core.principal import Principal

router = APIRouter()

DEFAULT_MAX_TOKENS = 64
# What the answer may be: free text, a document valid against a JSON schema, or a call
# of one function (`tool_choice: required`); the form's `spec` holds the schema or the
# function definition, as JSON.
OUTPUTS = (("text", "Text"), ("json_schema", "JSON schema"), ("tool", "A tool call"))


@dataclass(frozen=True, slots=True)
class Answer:
    model: str
    text: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class AdapterOption:
    name: str
    owner: str  # a tenant id, or "shared"
    label: str


def _adapter_options(state: AppState, tenant_names: dict[str, str]) -> list[AdapterOption]:
    seen: dict[tuple[str, str], AdapterOption] = {}
    for ref in state.directory.ready_versions():
        owner = ref.tenant_id or "shared"
        whose = "shared" if ref.tenant_id is None else tenant_names.get(owner, owner)
        seen[(owner, ref.name)] = AdapterOption(ref.name, owner, f"{ref.name} ({whose})")
    return sorted(seen.values(), key=lambda o: (o.owner != "shared", o.label))


def _page(
    request: Request, authed: Authed, session: Session, state: AppState, *,
    values: dict[str, Any], answers: list[Answer] | None = None, error: str | None = None,
    status_code: int = 200,
) -> HTMLResponse:
    tenants = crud.list_tenants(session)
    names = {t.id: t.name for t in tenants}
    return render(request, "playground.html", {
        "authed": authed, "active": "playground", "title": "Playground",
        "tenants": [(t.id, t.name) for t in tenants],
        "adapters": _adapter_options(state, names),
        "base_model": state.engine.model_id,
        "values": values, "answers": answers, "error": error, "outputs": OUTPUTS,
    }, status_code=status_code)


@router.get(PREFIX + "/playground", response_class=HTMLResponse)
def playground_page(request: Request, authed: AuthedDep, session: SessionDep,
                    state: AppStateDep) -> HTMLResponse:
    values = {"tenant_id": "", "adapter": "", "prompt": "", "max_tokens": DEFAULT_MAX_TOKENS,
              "output": "text", "spec": ""}
    return _page(request, authed, session, state, values=values)


def _constraint(output: str, spec: str) -> dict[str, Any]:
    """The chat request fields the chosen output asks for (FormProblem when the JSON of
    `spec` is not what it needs)."""
    if output == "text":
        return {}
    try:
        value = json.loads(spec)
    except ValueError as exc:
        raise forms.FormProblem(f"The {_label(output)} is not valid JSON: {exc}.") from exc
    if not isinstance(value, dict):
        raise forms.FormProblem(f"The {_label(output)} must be a JSON object.")
    if output == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": value, "strict": True}}}
    return {"tools": [{"type": "function", "function": value}], "tool_choice": "required"}


def _label(output: str) -> str:
    return "JSON schema" if output == "json_schema" else "function definition"


async def _answer(request: Request, state: AppState, principal: Principal, model: str,
                  prompt: str, max_tokens: int, constraint: dict[str, Any]) -> Answer:
    try:
        body = ChatCompletionRequest.model_validate({
            "model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, **constraint,
        })
        plan = await asyncio.to_thread(plan_chat, state, body, principal)  # off the loop
        renderer = ChatRenderer(plan, state.engine.token_text)
        response = await serve_generation(request, state, plan, renderer)
    except ValidationError as exc:
        return Answer(model, error=validation_error(exc.errors()).message)
    except (APIError, ServiceError) as exc:
        return Answer(model, error=exc.message)
    if response.status_code != 200:
        return Answer(model, error=f"The request ended with status {response.status_code}.")
    result = ChatCompletionResponse.model_validate_json(bytes(response.body))
    choice = result.choices[0]
    text = choice.message.content or ""
    for call in choice.message.tool_calls or ():
        text += ("\n" if text else "") + f"{call.function.name}({call.function.arguments})"
    return Answer(
        model=model, text=text, finish_reason=choice.finish_reason,
        prompt_tokens=result.usage.prompt_tokens,
        completion_tokens=result.usage.completion_tokens,
    )


@router.post(PREFIX + "/playground", response_class=HTMLResponse)
async def run_playground(request: Request, authed: AuthedDep, form: CheckedForm,
                         session: SessionDep, state: AppStateDep) -> HTMLResponse:
    values: dict[str, Any] = {name: forms.text(form, name)
                              for name in ("tenant_id", "adapter", "prompt", "output", "spec")}
    if values["output"] not in dict(OUTPUTS):
        values["output"] = "text"
    values["max_tokens"] = forms.text(form, "max_tokens")  # as typed, until it parses
    try:
        max_tokens = forms.optional_int(form, "max_tokens", "Max tokens") or DEFAULT_MAX_TOKENS
        constraint = _constraint(values["output"], values["spec"])
    except forms.FormProblem as exc:
        return await run_in_threadpool(
            _page, request, authed, session, state, values=values, error=str(exc),
            status_code=400,
        )
    values["max_tokens"] = max_tokens
    tenant = state.directory.tenant(values["tenant_id"])
    problem = (
        "Choose a tenant." if tenant is None
        else "Choose an adapter." if not values["adapter"]
        else "Enter a prompt." if not values["prompt"]
        else None
    )
    if problem is not None:
        return await run_in_threadpool(
            _page, request, authed, session, state, values=values, error=problem,
            status_code=400,
        )
    acting = dataclasses.replace(authed.principal, acting_for=tenant)
    # One after the other: both read the same request's disconnect.
    answers = [
        await _answer(request, state, acting, model, values["prompt"], max_tokens, constraint)
        for model in (state.engine.model_id, values["adapter"])
    ]
    # The page reads the database: off the event loop.
    return await run_in_threadpool(
        _page, request, authed, session, state, values=values, answers=answers
    )
