"""From a parsed OpenAI request to engine work: checks, model, prompt, sampling params."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from app.api.engine_errors import rejected
from app.api.errors import APIError, invalid_request, model_not_found, overloaded, validation_error
from app.api.openai.plan import GenerationPlan, ModelTarget
from app.api.openai.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationFields,
    bounds_of,
)
from app.api.openai.structured import check_structured_output, structured_output_of
from app.api.openai.tool_prompt import chat_template_messages
from app.api.openai.tools import NO_TOOLS, ToolPlan, tool_constraint, tool_plan
from app.api.state import AppState
from app.core.principal import REGISTRY_ENGINE_PREFIX, Principal
from engine.client import EngineClient
from engine.errors import RequestRejected
from engine.limits import ContextLimits, check_prompt_ids, resolve_max_tokens
from engine.request import SamplingParams
from engine.structured import OutputKind, StructuredOutput

# The answer formats a turn with tools can take (the text answer's, beside the calls).
JSON_ANSWERS = (OutputKind.JSON_OBJECT, OutputKind.JSON_SCHEMA)

BodyT = TypeVar("BodyT", bound=BaseModel)

# The request fields that pass to the engine's SamplingParams under their own name (the
# others are derived below: max_tokens, top_k, seed, stop, ignore_eos, logprobs).
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {
    "max_tokens", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs",
    "structured", "prompt_logprobs",
}


async def read_body(request: Request, model: type[BodyT]) -> BodyT:
    """Parse the JSON body whatever its Content-Type.

    NOTE: parsed here rather than as a FastAPI body parameter because clients such as
    `curl -d` send JSON as form data, and every failure must become OpenAI's 400 body.
    """
    raw = await request.body()
    try:
        data = json.loads(raw, parse_constant=_refuse_constant) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        error = {"type": "json_invalid", "loc": (), "ctx": {"error": detail}}
        raise validation_error([error]) from exc
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from exc


def _refuse_constant(name: str) -> Any:
    # Python's json module reads NaN, Infinity and -Infinity, which JSON does not have;
    # a NaN would slip through every range check (all its comparisons are False).
    raise json.JSONDecodeError(f"{name} is not a JSON number", name, 0)


def new_response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_admission(state: AppState, num_requests: int) -> None:
    """Refuse new work while draining, starting, or when the engine's queue is full."""
    retry_after_s = state.settings.retry_after_s
    # A failed engine also drains the server: say why, whichever the client sees first.
    if state.engine.failure() is not None:
        raise overloaded(
            "The engine of this replica failed and it is restarting; retry on another "
            "replica or shortly.", retry_after_s=retry_after_s,
        )
    if state.draining:
        raise overloaded(
            "The server is shutting down; retry on another replica.", retry_after_s=retry_after_s
        )
    if not state.engine.is_ready():
        raise overloaded(
            "The engine is still starting; retry shortly.", retry_after_s=retry_after_s
        )
    num_waiting = state.engine.stats().num_waiting
    if num_waiting + num_requests > state.settings.max_waiting_requests:
        raise overloaded(
            "The server is overloaded with other requests; retry after a short wait.",
            retry_after_s=retry_after_s,
        )


def resolve_target(state: AppState, principal: Principal, model: str) -> ModelTarget:
    """The base model, one of the caller's (or the shared) registry adapters, or an adapter
    preloaded with `--lora`; 404 `model_not_found` for anything else, including other
    tenants' adapters. An admin acting for a tenant sees that tenant's adapters."""
    engine = state.engine
    if model == engine.model_id:
        return ModelTarget(engine_adapter=None, ref=None, label=model)
    ref = state.directory.resolve_adapter(principal.adapter_owner_id, model)
    if ref is not None:
        if engine.get_adapter(ref.engine_name) is None and (
            reason := state.registry.engine_sync.retry(ref.engine_name)
        ):
            raise overloaded(
                f"The adapter '{model}' cannot be loaded on this replica right now ({reason}); "
                "retry shortly.", retry_after_s=state.settings.retry_after_s,
                code="adapter_unavailable",
            )
        return ModelTarget(engine_adapter=ref.engine_name, ref=ref, label=ref.name)
    if not model.startswith(REGISTRY_ENGINE_PREFIX) and engine.get_adapter(model) is not None:
        return ModelTarget(engine_adapter=model, ref=None, label=model)
    raise model_not_found(model)


# How long a request for a ready version waits for this replica's engine to load it
# (fetched from the object store, read and checked: well under a second for most).
ADAPTER_LOAD_WAIT_S = 60.0


async def wait_until_served(state: AppState, target: ModelTarget, model: str) -> None:
    """A registry version the directory lists as ready may not be loaded into this
    replica's engine yet (just started with many, or just uploaded elsewhere): load it
    now, ahead of the rest, and wait for that instead of a 404. Still not served then:
    503 `adapter_unavailable` (retry), 404 if the version went away meanwhile.
    `model`: as the client named it."""
    ref = target.ref
    if ref is None or state.engine.get_adapter(ref.engine_name) is not None:
        return
    sync = state.registry.engine_sync
    reason: str | None = None
    try:
        async with asyncio.timeout(ADAPTER_LOAD_WAIT_S):
            reason = await sync.ensure_loaded(ref)
    except TimeoutError:
        pass  # the load goes on; a retry finds it done
    if state.directory.model_name(ref.engine_name) is None:
        # Deleted (or replaced) while it loaded: not served, and not left loaded.
        if state.engine.get_adapter(ref.engine_name) is not None:
            sync.on_versions_changed((), (ref,))
        raise model_not_found(model)
    if state.engine.get_adapter(ref.engine_name) is not None:
        return
    why = f" ({reason})" if reason else ""
    raise overloaded(
        f"The adapter '{model}' is not loaded on this replica yet{why}; retry shortly.",
        retry_after_s=state.settings.retry_after_s, code="adapter_unavailable",
    )


def preloaded_adapters(engine: EngineClient) -> list[str]:
    """Adapters served to every caller because the operator named them (`--lora`)."""
    return sorted(
        a.name for a in engine.list_adapters() if not a.name.startswith(REGISTRY_ENGINE_PREFIX)
    )


def _check_range(
    name: str,
    value: float,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_exclusive: bool = False,
) -> None:
    kind = "integer" if isinstance(value, int) else "decimal"
    if isinstance(value, float) and not math.isfinite(value):  # 1e400 parses as inf
        raise invalid_request(
            f"Invalid '{name}': must be a finite number, got {value}.",
            param=name,
            code="invalid_value",
        )
    if lo is not None and (value <= lo if lo_exclusive else value < lo):
        bound = f"greater than {lo}" if lo_exclusive else f"at least {lo}"
        raise invalid_request(
            f"Invalid '{name}': must be {bound}, got {value}.",
            param=name,
            code=f"{kind}_below_min_value",
        )
    if hi is not None and value > hi:
        raise invalid_request(
            f"Invalid '{name}': must be at most {hi}, got {value}.",
            param=name,
            code=f"{kind}_above_max_value",
        )


def _refuse_unsupported(param: str, message: str) -> APIError:
    return invalid_request(message, param=param, code="unsupported_parameter")


def _check_bounds(body: GenerationFields, *, skip: frozenset[str] = frozenset()) -> None:
    """Every numeric field within the range its protocol model documents."""
    for name, bounds in bounds_of(type(body)).items():
        value = getattr(body, name)
        if name in skip or value is None or isinstance(value, bool):
            continue
        _check_range(name, value, lo=bounds.lo, hi=bounds.hi, lo_exclusive=bounds.lo_exclusive)


def _check_common(
    body: GenerationFields, max_stop: int, *, skip: frozenset[str] = frozenset()
) -> list[str]:
    """Checks shared by both routes; returns the stop strings."""
    if body.logit_bias:
        raise _refuse_unsupported("logit_bias", "'logit_bias' is not supported.")
    _check_bounds(body, skip=skip)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > max_stop:
        raise invalid_request(
            f"Invalid 'stop': at most {max_stop} stop sequences are allowed, got {len(stop)}.",
            param="stop",
        )
    # An empty stop string would end every completion before its first token.
    return [s for s in stop if s]


def _max_tokens_for(
    state: AppState, principal: Principal, num_prompt_tokens: int, requested: int | None, *,
    prompt_param: str, max_tokens_param: str,
) -> int:
    """The max_tokens a request runs with: within the model's context and the tenant's
    limits (engine/limits.py, the policy the engine enforces again)."""
    quotas = None if principal.tenant is None else principal.tenant.quotas
    limits = ContextLimits(
        max_model_len=state.engine.max_model_len,
        tenant_max_tokens=None if quotas is None else quotas.max_tokens,
        tenant_max_context=None if quotas is None else quotas.max_context_tokens,
    )
    try:
        return resolve_max_tokens(
            limits, num_prompt_tokens, requested,
            prompt_param=prompt_param, max_tokens_param=max_tokens_param,
        )
    except RequestRejected as exc:
        raise rejected(exc, model=None) from exc


def _priority(principal: Principal, requested: int | None) -> int:
    """The tenant's tier sets the priority; a request may only lower its own (a higher
    number is served later)."""
    base = 0 if principal.tenant is None else principal.tenant.tier.priority
    return max(base, requested or 0)


def _checked_constraint(
    state: AppState, constraint: tuple[str, StructuredOutput] | None
) -> StructuredOutput | None:
    if constraint is None:
        return None
    param, spec = constraint
    check_structured_output(state.engine, spec, param=param)
    return spec


def _sampling_per_choice(
    body: GenerationFields, *, max_tokens: int, stop: list[str], logprobs: int | None,
    structured: StructuredOutput | None = None, prompt_logprobs: int | None = None,
) -> list[SamplingParams]:
    given = {name: getattr(body, name) for name in _SAMPLING_FIELDS}
    same = {name: value for name, value in given.items() if value is not None}
    return [
        SamplingParams(
            max_tokens=max_tokens,
            top_k=body.top_k if body.top_k is not None and body.top_k > 0 else 0,
            # Distinct seeds so that n seeded choices differ yet stay reproducible.
            seed=None if body.seed is None else body.seed + i,
            stop=list(stop),
            ignore_eos=bool(body.ignore_eos),
            logprobs=logprobs,
            structured=structured,
            prompt_logprobs=prompt_logprobs,
            **same,
        )
        for i in range(body.n or 1)
    ]


def _prompt_batch(
    prompt: str | list[int] | list[str] | list[list[int]],
) -> list[str | list[int]]:
    """A completions `prompt` (one text or token-id list, or a batch of either) as a batch."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)


def _completion_prompts(
    engine: EngineClient, batch: list[str | list[int]], n: int
) -> list[list[int]]:
    """Each prompt's token ids."""
    if len(batch) * n > MAX_CHOICES:
        # Checked before tokenizing: every prompt of a huge batch would be tokenized first.
        raise invalid_request(
            f"Invalid 'prompt': a request may ask for at most {MAX_CHOICES} completions "
            f"(prompts times 'n'), got {len(batch)} prompts times {n}.",
            param="prompt",
        )
    prompts = []
    for one in batch:
        if isinstance(one, str):
            token_ids = engine.encode(one) if one else []
        else:
            token_ids = list(one)
            if any(t < 0 for t in token_ids):
                raise invalid_request(
                    "Token ids in 'prompt' must be non-negative.", param="prompt"
                )
            # Refused here, not by the engine: a stream would already have begun.
            try:
                check_prompt_ids(token_ids, engine.vocab_size)
            except RequestRejected as exc:
                raise rejected(exc, model=None) from exc
        if not token_ids:
            raise invalid_request("'prompt' must not be empty.", param="prompt")
        prompts.append(token_ids)
    return prompts


def _echo_text(engine: EngineClient, prompt: str | list[int]) -> str:
    # NOTE: a token-id prompt is echoed token by token, special tokens included.
    if isinstance(prompt, str):
        return prompt
    return "".join(engine.token_text(t) for t in prompt)


def plan_completion(
    state: AppState, body: CompletionRequest, principal: Principal
) -> GenerationPlan:
    arrival = time.monotonic()
    echo_only = body.max_tokens == 0
    if echo_only and not body.echo:
        raise invalid_request(
            "'max_tokens' must be at least 1; 0 is only accepted with 'echo' (the prompt "
            "alone, with its logprobs when 'logprobs' is set).", param="max_tokens",
        )
    if body.suffix:
        raise _refuse_unsupported("suffix", "'suffix' is not supported.")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise _refuse_unsupported("best_of", "'best_of' other than 'n' is not supported.")
    stop = _check_common(body, state.settings.max_stop_sequences)
    target = resolve_target(state, principal, body.model)
    # The engine computes the prompt's logprobs for echo's and for prompt_logprobs'.
    wanted = [n for n in (body.logprobs if body.echo else None, body.prompt_logprobs)
              if n is not None]
    prompt_logprobs = max(wanted) if wanted else None
    batch = _prompt_batch(body.prompt)
    prompts = _completion_prompts(state.engine, batch, body.n or 1)
    structured = _checked_constraint(state, structured_output_of(body))
    sampling = []
    for prompt in prompts:
        max_tokens = _max_tokens_for(
            state, principal, len(prompt), 1 if echo_only else body.max_tokens,
            prompt_param="prompt", max_tokens_param="max_tokens",
        )
        sampling += _sampling_per_choice(
            body, max_tokens=max_tokens, stop=stop, logprobs=body.logprobs,
            structured=structured, prompt_logprobs=prompt_logprobs,
        )
    echo_texts = [_echo_text(state.engine, one) for one in batch] if body.echo else None
    return _plan(
        state, body, principal, target,
        response_id=new_response_id("cmpl"), prompts=prompts, sampling=sampling,
        arrival=arrival, echo_texts=None if echo_texts is None else tuple(echo_texts),
        echo_only=echo_only,
    )


def plan_chat(
    state: AppState, body: ChatCompletionRequest, principal: Principal, *,
    response_id: str | None = None,
) -> GenerationPlan:
    """`response_id`: the id of the response object (default "chatcmpl-<hex>")."""
    arrival = time.monotonic()
    if body.functions:
        raise _refuse_unsupported(
            "functions", "'functions' (the legacy form of function calling) is not supported; "
            "send 'tools'.",
        )
    if not body.messages:
        raise invalid_request("'messages' must contain at least one message.", param="messages")
    tools = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
    constraint = structured_output_of(body, body.response_format)
    if tools.functions:
        # A JSON answer format applies to the turn's text answer, which with `auto` the
        # model may give instead of calls; other constraints have no place beside calls.
        answer = None
        if constraint is not None:
            param, answer = constraint
            if answer.kind not in JSON_ANSWERS:
                raise invalid_request(
                    f"'{param}' cannot be combined with tools the model may call; send "
                    "'tool_choice': 'none' to keep the tools out of this turn.",
                    param=param, code="invalid_structured_output",
                )
        spec = tool_constraint(tools, answer=answer)
        constraint = None if spec is None else ("tools", spec)
    # max_completion_tokens is the newer name; it wins when both are sent.
    requested_max_tokens: int | None
    if body.max_completion_tokens is not None:
        max_tokens_param, requested_max_tokens = "max_completion_tokens", body.max_completion_tokens
    else:
        max_tokens_param, requested_max_tokens = "max_tokens", body.max_tokens
    # The range of top_logprobs matters only once logprobs are on; the max_tokens that
    # lost to max_completion_tokens is not used at all.
    skip = {"top_logprobs"} if not body.logprobs else set()
    if body.max_completion_tokens is not None:
        skip.add("max_tokens")
    stop = _check_common(body, state.settings.max_stop_sequences, skip=frozenset(skip))
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid_request(
            "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs"
        )
    prompt = chat_template_messages(
        body.messages, tools, template_has_tools=state.engine.chat_template_has_tools
    )
    target = resolve_target(state, principal, body.model)
    try:
        prompt_token_ids = state.engine.apply_chat_template(prompt.messages, tools=prompt.tools)
    except ValueError as exc:
        message = f"Could not apply the chat template: {exc}"
        raise invalid_request(message, param="messages") from exc
    structured = _checked_constraint(state, constraint)
    max_tokens = _max_tokens_for(
        state, principal, len(prompt_token_ids), requested_max_tokens,
        prompt_param="messages", max_tokens_param=max_tokens_param,
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.prompt_logprobs is not None and body.stream:
        raise invalid_request(
            "'prompt_logprobs' is not supported with 'stream' on chat completions; send the "
            "request without 'stream'.", param="prompt_logprobs",
        )
    sampling = _sampling_per_choice(
        body, max_tokens=max_tokens, stop=stop, logprobs=logprobs, structured=structured,
        prompt_logprobs=body.prompt_logprobs,
    )
    return _plan(
        state, body, principal, target,
        response_id=response_id or new_response_id("chatcmpl"), prompts=[prompt_token_ids],
        sampling=sampling, arrival=arrival, tools=tools,
    )


def _plan(
    state: AppState, body: CompletionRequest | ChatCompletionRequest, principal: Principal,
    target: ModelTarget, *, response_id: str, prompts: Sequence[Sequence[int]],
    sampling: Sequence[SamplingParams], arrival: float,
    echo_texts: tuple[str, ...] | None = None, tools: ToolPlan = NO_TOOLS,
    echo_only: bool = False,
) -> GenerationPlan:
    """The one place a GenerationPlan is made: what every endpoint's plan shares comes
    from the request body, the caller and the settings here."""
    return GenerationPlan(
        response_id=response_id,
        model=body.model,
        principal=principal,
        target=target,
        prompts=tuple(tuple(p) for p in prompts),
        sampling=tuple(sampling),
        priority=_priority(principal, body.priority),
        stream=bool(body.stream),
        include_usage=body.include_usage,
        created=int(time.time()),
        arrival=arrival,
        kv_share=state.settings.tenant_kv_share,
        echo_texts=echo_texts,
        tools=tools,
        prompt_logprobs=body.prompt_logprobs,
        echo_only=echo_only,
    )
