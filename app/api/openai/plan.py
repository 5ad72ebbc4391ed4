"""A generation request ready for the engine: an immutable value built once by planning
(app/api/openai/planning.py) and read by admission, accounting, the engine run and rendering."""

from __future__ import annotations

from dataclasses import dataclass

from app.api.openai.tools import NO_TOOLS, ToolPlan
from app.core.principal import AdapterRef, Principal
from app.tables import Isolation
from engine.client import RouteHint
from engine.request import EngineRequest, SamplingParams, TenantContext


@dataclass(frozen=True, slots=True)
class ModelTarget:
    """What a `model` field resolved to for one caller."""

    engine_adapter: str | None  # the engine's adapter name; None: the base model
    ref: AdapterRef | None  # a registry adapter version; None: base model or preloaded
    label: str  # for metrics: the base model id or the adapter's name


@dataclass(frozen=True, slots=True)
class GenerationPlan:
    """One HTTP generation request, ready for the engine (each choice one engine request)."""

    response_id: str  # "cmpl-..." / "chatcmpl-..."; choice i runs as "<response_id>-<i>"
    model: str  # as the client named it; echoed in every response
    principal: Principal
    target: ModelTarget
    prompts: tuple[tuple[int, ...], ...]  # token ids; a completions request may batch several
    # One per choice, prompt-major as OpenAI orders them: prompt p's i-th is p * n + i.
    sampling: tuple[SamplingParams, ...]
    priority: int  # lower = served first; requests can only raise it
    stream: bool
    include_usage: bool
    created: int  # unix seconds, the `created` of every response object
    arrival: float  # time.monotonic() when the request arrived
    # The share of the KV cache one tenant may hold while others wait (Settings).
    kv_share: float | None = None
    # With `echo`: each prompt's text, which every choice of that prompt starts with.
    echo_texts: tuple[str, ...] | None = None
    # The functions the model may call (chat and responses); their calls are parsed out
    # of its text.
    tools: ToolPlan = NO_TOOLS
    # `prompt_logprobs` asked for (vLLM's field): its N; None: not asked.
    prompt_logprobs: int | None = None
    # `max_tokens: 0` with `echo`: the engine samples one token, which nobody is shown or
    # billed (the prompt's logprobs come with it).
    echo_only: bool = False

    @property
    def num_choices(self) -> int:
        return len(self.sampling)

    @property
    def choices_per_prompt(self) -> int:
        return len(self.sampling) // len(self.prompts)

    def prompt_index(self, choice: int) -> int:
        return choice // self.choices_per_prompt

    def prompt_of(self, choice: int) -> tuple[int, ...]:
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

    @property
    def engine_request_ids(self) -> list[str]:
        return [self.engine_request_id(i) for i in range(self.num_choices)]

    def engine_request(self, index: int) -> EngineRequest:
        """What choice `index` asks of the engine."""
        return EngineRequest(
            request_id=self.engine_request_id(index),
            prompt_token_ids=self.prompt_of(index),
            sampling=self.sampling[index],
            adapter=self.adapter_id,
            salt=self.salt,
            priority=self.priority,
            tenant=self.engine_tenant,
        )

    @property
    def route_hint(self) -> RouteHint:
        """What a gateway needs to choose the worker for this request's choices."""
        tenant = self.principal.tenant
        return RouteHint(
            adapter=self.adapter_id,
            tenant_id=None if tenant is None else tenant.id,
            tenant_name=None if tenant is None else tenant.name,
            dedicated=tenant is not None and tenant.isolation == Isolation.DEDICATED,
        )
