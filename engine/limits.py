"""How many tokens a request may generate: the one context-length policy.

The app calls `resolve_max_tokens` to pick a request's max_tokens (an omitted value
defaults to what is left of the context); the engine calls it again on what it is given,
with its KV capacity too, so a gateway that forgets a limit cannot get past it.

NOTE: the model-context refusals begin as OpenAI's do ("This model's maximum context
length is N tokens."): clients such as litellm match that phrase to fall back to a model
with a longer context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.client import RequestRejected
from engine.request import TenantContext


@dataclass(frozen=True, slots=True)
class ContextLimits:
    max_model_len: int  # prompt + completion, in tokens
    kv_capacity_tokens: int | None = None  # None: not checked (the app does not know it)
    tenant_max_tokens: int | None = None  # completion tokens per request
    tenant_max_context: int | None = None  # prompt + completion per request

    @classmethod
    def of(
        cls, max_model_len: int, tenant: TenantContext | None, *,
        kv_capacity_tokens: int | None = None,
    ) -> ContextLimits:
        if tenant is None:
            return cls(max_model_len, kv_capacity_tokens)
        return cls(max_model_len, kv_capacity_tokens, tenant.max_tokens,
                   tenant.max_context_tokens)


def resolve_max_tokens(
    limits: ContextLimits,
    num_prompt_tokens: int,
    requested: int | None,
    *,
    prompt_param: str = "prompt",
    max_tokens_param: str = "max_tokens",
) -> int:
    """The max_tokens a request runs with. An explicit value that does not fit is refused
    (RequestRejected); an omitted one (None) defaults to the tenant's max_tokens, or all
    the context left, and shrinks to fit. `prompt_param` / `max_tokens_param` name the
    request fields the refusals point at ("messages" words them for a chat)."""
    n = num_prompt_tokens
    cap = limits.tenant_max_tokens
    if requested is not None and cap is not None and requested > cap:
        raise RequestRejected(
            f"'{max_tokens_param}' is {requested}, above this account's limit of {cap} "
            "tokens per request. Lower it, or ask for a higher limit.",
            code="max_tokens_exceeded",
            param=max_tokens_param,
        )
    max_tokens = _fit_model_context(
        limits.max_model_len, n, requested, prompt_param=prompt_param,
        max_tokens_param=max_tokens_param,
    )
    if requested is None and cap is not None:
        max_tokens = min(max_tokens, cap)
    if limits.tenant_max_context is not None:
        max_tokens = _fit_tenant_context(
            limits.tenant_max_context, n, max_tokens, explicit=requested is not None,
            prompt_param=prompt_param, max_tokens_param=max_tokens_param,
        )
    if limits.kv_capacity_tokens is not None:
        max_tokens = _fit_kv_capacity(
            limits.kv_capacity_tokens, n, max_tokens, explicit=requested is not None,
            prompt_param=prompt_param, max_tokens_param=max_tokens_param,
        )
    return max_tokens


def check_prompt_ids(prompt_token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise RequestRejected for token ids outside the model's vocabulary."""
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestRejected(
            f"Token id {bad} is outside this model's vocabulary (0..{vocab_size - 1}).",
            code="invalid_prompt",
            param="prompt",
        )


def _fit_model_context(
    context: int, n: int, requested: int | None, *, prompt_param: str, max_tokens_param: str
) -> int:
    what = "messages" if prompt_param == "messages" else "prompt"
    if n >= context:
        raise RequestRejected(
            f"This model's maximum context length is {context} tokens. However, your {what} "
            f"resulted in {n} tokens, leaving no room for a completion. "
            f"Please reduce the length of the {what}.",
            code="context_length_exceeded",
            param=prompt_param,
        )
    if requested is None:
        return context - n
    if n + requested > context:
        raise RequestRejected(
            f"This model's maximum context length is {context} tokens. However, you "
            f"requested {n + requested} tokens ({n} in the {what}, {requested} in the "
            f"completion). Please reduce the length of the {what} or '{max_tokens_param}'.",
            code="context_length_exceeded",
            param=max_tokens_param,
        )
    return requested


def _fit_tenant_context(
    context: int, n: int, max_tokens: int, *, explicit: bool, prompt_param: str,
    max_tokens_param: str,
) -> int:
    if n + max_tokens <= context:
        return max_tokens
    if n >= context:
        raise RequestRejected(
            f"This account's context limit is {context} tokens, and the prompt alone has "
            f"{n} tokens. Shorten the prompt.",
            code="context_length_exceeded",
            param=prompt_param,
        )
    if not explicit:
        return context - n
    raise RequestRejected(
        f"This account's context limit is {context} tokens, but the prompt has {n} tokens "
        f"and '{max_tokens_param}' asks for {max_tokens} more ({n + max_tokens} in total). "
        f"Shorten the prompt or lower '{max_tokens_param}'.",
        code="context_length_exceeded",
        param=max_tokens_param,
    )


def _fit_kv_capacity(
    capacity: int, n: int, max_tokens: int, *, explicit: bool, prompt_param: str,
    max_tokens_param: str,
) -> int:
    # NOTE: a sequence is only ever preempted for others; alone it must fit.
    if n + max_tokens <= capacity:
        return max_tokens
    if not explicit and n < capacity:
        return capacity - n
    needed = n + max_tokens if explicit else n + 1
    raise RequestRejected(
        f"The request needs up to {needed} tokens of KV cache; this server holds {capacity}.",
        code="context_length_exceeded",
        param=max_tokens_param if explicit else prompt_param,
    )
