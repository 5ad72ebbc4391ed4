"""From a parsed OpenAI request to engine work: checks, model, prompt, sampling params."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from app.api.errors import APIError, invalid_request, model_not_found, overloaded, validation_error
from app.api.protocol import ChatCompletionRequest, CompletionRequest, GenerationFields
from app.api.state import AppState
from app.core.principal import AdapterRef, Principal
from engine.client import EngineClient
from engine.request import SamplingParams, TenantContext

if TYPE_CHECKING:
    from app.api.accounting import RequestAccount

BodyT = TypeVar("BodyT", bound=BaseModel)

MAX_CHOICES = 16
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
# Beyond these a repetition penalty only pushes logits past float32's range.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(slots=True)
class GenerationPlan:
    """One HTTP generation request, ready for the engine (each choice one engine request)."""

    response_id: str  # "cmpl-..." / "chatcmpl-..."; choice i runs as "<response_id>-<i>"
    model: str  # as the client named it; echoed in every response
    principal: Principal
    target: ModelTarget
    prompts: list[list[int]]  # token ids; a completions request may batch several
    # One per choice, prompt-major as OpenAI orders them: prompt p's i-th is p * n + i.
    sampling: list[SamplingParams]
    priority: int  # lower = served first; requests can only raise it
    stream: bool
    include_usage: bool
    created: int  # unix seconds, the `created` of every response object
    arrival: float  # time.monotonic() when the request arrived
    # Quota admission, settlement and metering; set once the request is admitted.
    account: RequestAccount | None = None
    # The share of the KV cache one tenant may hold while others wait (Settings).
    kv_share: float | None = None
    # With `echo`: each prompt's text, which every choice of that prompt starts with.
    echo_texts: list[str] | None = None

    @property
    def num_choices(self) -> int:
        return len(self.sampling)

    @property
    def choices_per_prompt(self) -> int:
        return len(self.sampling) // len(self.prompts)

    def prompt_index(self, choice: int) -> int:
        return choice // self.choices_per_prompt

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompts[self.prompt_index(choice)]

    @property
    def num_prompt_tokens(self) -> int:
        """Each prompt counted once, however many choices share it, as OpenAI does."""
        return sum(len(p) for p in self.prompts)

    @property
    def adapter_id(self) -> str | None:
        """The engine's name of the adapter; None: the base model."""
        return self.target.engine_adapter

    @property
    def adapter(self) -> AdapterRef | None:
        return self.target.ref

    @property
    def metrics_model(self) -> str:
        return self.target.label

    @property
    def reserved_tokens(self) -> int:
        """What the request may use at most: its prompts and every choice's max_tokens."""
        return self.num_prompt_tokens + sum(s.max_tokens for s in self.sampling)

    @property
    def engine_tenant(self) -> TenantContext | None:
        """What the engine's scheduler needs of the tenant: fairness key and caps (it
        enforces the per-request limits again, in case a caller skipped them)."""
        tenant = self.principal.tenant
        if tenant is None:
            return None
        return TenantContext(
            tenant_id=tenant.id,
            max_kv_fraction=self.kv_share,
            max_tokens=tenant.quotas.max_tokens,
            max_context_tokens=tenant.quotas.max_context_tokens,
        )

    @property
    def salt(self) -> str | None:
        """Prefix-cache salt: no tenant ever reuses another tenant's cached KV."""
        return self.principal.tenant_id

    def engine_request_id(self, index: int) -> str:
        return f"{self.response_id}-{index}"


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
    if state.draining:
        raise overloaded(
            "The server is shutting down; retry on another replica.", retry_after_s=retry_after_s
        )
    if state.engine.failure() is not None:
        raise overloaded(
            "The engine of this replica failed and it is restarting; retry on another "
            "replica or shortly.", retry_after_s=retry_after_s,
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


# Engine names of registry adapters (AdapterRef.engine_name); others are operator-preloaded.
REGISTRY_ENGINE_PREFIX = "av/"


@dataclass(frozen=True, slots=True)
class ModelTarget:
    """What a `model` field resolved to for one caller."""

    engine_adapter: str | None  # the engine's adapter name; None: the base model
    ref: AdapterRef | None  # a registry adapter version; None: base model or preloaded
    label: str  # for metrics: the base model id or the adapter's name


def resolve_model(state: AppState, principal: Principal, model: str) -> ModelTarget:
    """The base model, one of the caller's (or the shared) registry adapters, or an adapter
    preloaded with `--lora`; 404 `model_not_found` for anything else, including other
    tenants' adapters. An admin acting for a tenant sees that tenant's adapters."""
    engine = state.engine
    if model == engine.model_id:
        return ModelTarget(engine_adapter=None, ref=None, label=model)
    ref = state.directory.resolve_adapter(principal.adapter_owner_id, model)
    if ref is not None:
        return ModelTarget(engine_adapter=ref.engine_name, ref=ref, label=ref.name)
    if not model.startswith(REGISTRY_ENGINE_PREFIX) and engine.get_adapter(model) is not None:
        return ModelTarget(engine_adapter=model, ref=None, label=model)
    raise model_not_found(model)


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


def _check_common(body: GenerationFields, max_stop: int) -> list[str]:
    """Range checks shared by both routes; returns the stop strings."""
    if body.logit_bias:
        raise _refuse_unsupported("logit_bias", "'logit_bias' is not supported.")
    if body.temperature is not None:
        _check_range("temperature", body.temperature, lo=0, hi=2)
    if body.top_p is not None:
        _check_range("top_p", body.top_p, lo=0, hi=1, lo_exclusive=True)
    if body.top_k is not None:
        _check_range("top_k", body.top_k, lo=-1)
    if body.n is not None:
        _check_range("n", body.n, lo=1, hi=MAX_CHOICES)
    if body.presence_penalty is not None:
        _check_range("presence_penalty", body.presence_penalty, lo=-2, hi=2)
    if body.frequency_penalty is not None:
        _check_range("frequency_penalty", body.frequency_penalty, lo=-2, hi=2)
    if body.repetition_penalty is not None:
        _check_range(
            "repetition_penalty", body.repetition_penalty,
            lo=MIN_REPETITION_PENALTY, hi=MAX_REPETITION_PENALTY,
        )
    if body.priority is not None:
        _check_range("priority", body.priority, lo=0)
    if body.seed is not None:
        _check_range("seed", body.seed, lo=_INT64_MIN, hi=_INT64_MAX - MAX_CHOICES)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > max_stop:
        raise invalid_request(
            f"Invalid 'stop': at most {max_stop} stop sequences are allowed, got {len(stop)}.",
            param="stop",
        )
    # An empty stop string would end every completion before its first token.
    return [s for s in stop if s]


def _check_max_tokens(name: str, value: int | None) -> None:
    if value is not None:
        _check_range(name, value, lo=1)


def _max_tokens_for(
    state: AppState, principal: Principal, num_prompt_tokens: int, requested: int | None, *,
    prompt_param: str, max_tokens_param: str,
) -> int:
    """The max_tokens a request runs with: within the model's context and the tenant's
    limits. An explicit value that does not fit is refused; an omitted one defaults to the
    tenant's max_tokens (or all the context left) and shrinks to fit."""
    quotas = None if principal.tenant is None else principal.tenant.quotas
    limit = None if quotas is None else quotas.max_tokens
    if requested is not None and limit is not None and requested > limit:
        raise invalid_request(
            f"'{max_tokens_param}' is {requested}, above this account's limit of {limit} "
            "tokens per request. Lower it, or ask for a higher limit.",
            param=max_tokens_param,
            code="max_tokens_exceeded",
        )
    max_tokens = _check_context(
        state.engine, num_prompt_tokens, requested,
        prompt_param=prompt_param, max_tokens_param=max_tokens_param,
    )
    if requested is None and limit is not None:
        max_tokens = min(max_tokens, limit)
    context = None if quotas is None else quotas.max_context_tokens
    if context is None or num_prompt_tokens + max_tokens <= context:
        return max_tokens
    if num_prompt_tokens >= context:
        raise invalid_request(
            f"This account's context limit is {context} tokens, and the prompt alone has "
            f"{num_prompt_tokens} tokens. Shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return context - num_prompt_tokens
    raise invalid_request(
        f"This account's context limit is {context} tokens, but the prompt has "
        f"{num_prompt_tokens} tokens and '{max_tokens_param}' asks for {requested} more "
        f"({num_prompt_tokens + requested} in total). Shorten the prompt or lower "
        f"'{max_tokens_param}'.",
        param=max_tokens_param,
        code="context_length_exceeded",
    )


def _priority(principal: Principal, requested: int | None) -> int:
    """The tenant's tier sets the priority; a request may only lower its own (a higher
    number is served later)."""
    base = 0 if principal.tenant is None else principal.tenant.tier.priority
    return max(base, requested or 0)


def _check_context(
    engine: EngineClient, num_prompt_tokens: int, max_tokens: int | None, *, prompt_param: str,
    max_tokens_param: str,
) -> int:
    """The max_tokens the engine gets: as asked, or all the context the prompt leaves.

    NOTE: the messages begin as OpenAI's do ("This model's maximum context length is N
    tokens."): clients such as litellm match that phrase to fall back to a model with a
    longer context.
    """
    context = engine.max_model_len
    what = "messages" if prompt_param == "messages" else "prompt"
    if num_prompt_tokens >= context:
        raise invalid_request(
            f"This model's maximum context length is {context} tokens. However, your {what} "
            f"resulted in {num_prompt_tokens} tokens, leaving no room for a completion. "
            f"Please reduce the length of the {what}.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return context - num_prompt_tokens
    if num_prompt_tokens + max_tokens > context:
        raise invalid_request(
            f"This model's maximum context length is {context} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"{what}, {max_tokens} in the completion). Please reduce the length of the "
            f"{what} or '{max_tokens_param}'.",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    return max_tokens


def _sampling_per_choice(
    body: GenerationFields, *, max_tokens: int, stop: list[str], logprobs: int | None
) -> list[SamplingParams]:
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    params = []
    for i in range(body.n or 1):
        params.append(
            SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=top_k,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if body.repetition_penalty is None else body.repetition_penalty
                ),
                # Distinct seeds so that n seeded choices differ yet stay reproducible.
                seed=None if body.seed is None else body.seed + i,
                stop=list(stop),
                ignore_eos=bool(body.ignore_eos),
                logprobs=logprobs,
            )
        )
    return params


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
    if body.echo and body.logprobs is not None:
        # The engine returns no logprobs of prompt tokens, which echo's logprobs start with.
        raise _refuse_unsupported(
            "echo", "'echo' with 'logprobs' is not supported: the prompt's logprobs are not "
            "available. Send 'echo' without 'logprobs'.",
        )
    if body.suffix:
        raise _refuse_unsupported("suffix", "'suffix' is not supported.")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise _refuse_unsupported("best_of", "'best_of' other than 'n' is not supported.")
    stop = _check_common(body, state.settings.max_stop_sequences)
    _check_max_tokens("max_tokens", body.max_tokens)
    if body.logprobs is not None:
        _check_range("logprobs", body.logprobs, lo=0, hi=MAX_COMPLETION_LOGPROBS)
    target = resolve_model(state, principal, body.model)
    batch = _prompt_batch(body.prompt)
    prompts = _completion_prompts(state.engine, batch, body.n or 1)
    sampling = []
    for prompt in prompts:
        max_tokens = _max_tokens_for(
            state, principal, len(prompt), body.max_tokens,
            prompt_param="prompt", max_tokens_param="max_tokens",
        )
        sampling += _sampling_per_choice(
            body, max_tokens=max_tokens, stop=stop, logprobs=body.logprobs
        )
    echo_texts = [_echo_text(state.engine, one) for one in batch] if body.echo else None
    return GenerationPlan(
        response_id=new_response_id("cmpl"),
        model=body.model,
        principal=principal,
        target=target,
        prompts=prompts,
        sampling=sampling,
        priority=_priority(principal, body.priority),
        stream=bool(body.stream),
        include_usage=body.include_usage,
        created=int(time.time()),
        arrival=arrival,
        kv_share=state.settings.tenant_kv_share,
        echo_texts=echo_texts,
    )


def _chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    if not body.messages:
        raise invalid_request("'messages' must contain at least one message.", param="messages")
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise invalid_request(
                        f"Only text content parts are supported, got type '{part.type}'.",
                        param=f"messages[{i}].content[{j}]",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        # "developer" is OpenAI's newer name for the system role.
        role = "system" if message.role == "developer" else message.role
        messages.append({"role": role, "content": content or ""})
    return messages


def plan_chat(
    state: AppState, body: ChatCompletionRequest, principal: Principal
) -> GenerationPlan:
    arrival = time.monotonic()
    if body.tools or body.functions:
        param = "tools" if body.tools else "functions"
        raise _refuse_unsupported(param, f"'{param}' (function calling) is not supported.")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise _refuse_unsupported(
            "response_format", "Only the 'text' response format is supported."
        )
    stop = _check_common(body, state.settings.max_stop_sequences)
    # max_completion_tokens is the newer name; it wins when both are sent.
    requested_max_tokens: int | None
    if body.max_completion_tokens is not None:
        max_tokens_param, requested_max_tokens = "max_completion_tokens", body.max_completion_tokens
    else:
        max_tokens_param, requested_max_tokens = "max_tokens", body.max_tokens
    _check_max_tokens(max_tokens_param, requested_max_tokens)
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise invalid_request(
                "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs"
            )
        _check_range("top_logprobs", body.top_logprobs, lo=0, hi=MAX_CHAT_TOP_LOGPROBS)
    messages = _chat_messages(body)
    target = resolve_model(state, principal, body.model)
    try:
        prompt_token_ids = state.engine.apply_chat_template(messages)
    except ValueError as exc:
        message = f"Could not apply the chat template: {exc}"
        raise invalid_request(message, param="messages") from exc
    max_tokens = _max_tokens_for(
        state, principal, len(prompt_token_ids), requested_max_tokens,
        prompt_param="messages", max_tokens_param=max_tokens_param,
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return GenerationPlan(
        response_id=new_response_id("chatcmpl"),
        model=body.model,
        principal=principal,
        target=target,
        prompts=[prompt_token_ids],
        sampling=_sampling_per_choice(body, max_tokens=max_tokens, stop=stop, logprobs=logprobs),
        priority=_priority(principal, body.priority),
        stream=bool(body.stream),
        include_usage=body.include_usage,
        created=int(time.time()),
        arrival=arrival,
        kv_share=state.settings.tenant_kv_share,
    )
