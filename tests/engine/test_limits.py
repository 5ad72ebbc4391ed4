"""The context-length policy: defaults, refusals, their codes, params and wording."""

from __future__ import annotations

import pytest

from engine.client import RequestRejected
from engine.limits import ContextLimits, check_prompt_ids, resolve_max_tokens
from engine.request import TenantContext

MODEL = ContextLimits(max_model_len=64)


def rejected(limits: ContextLimits, n: int, requested: int | None, **params: str) -> (
    RequestRejected
):
    with pytest.raises(RequestRejected) as info:
        resolve_max_tokens(limits, n, requested, **params)
    return info.value


# ------------------------------------------------------------------------ the model


def test_an_omitted_max_tokens_takes_the_context_left() -> None:
    assert resolve_max_tokens(MODEL, 5, None) == 59
    assert resolve_max_tokens(MODEL, 63, None) == 1


def test_an_explicit_max_tokens_that_fits_is_kept() -> None:
    assert resolve_max_tokens(MODEL, 5, 59) == 59
    assert resolve_max_tokens(MODEL, 5, 3) == 3


def test_a_prompt_that_fills_the_context_is_refused_on_the_prompt() -> None:
    for requested in (None, 1):
        err = rejected(MODEL, 64, requested)
        assert str(err) == (
            "This model's maximum context length is 64 tokens. However, your prompt resulted "
            "in 64 tokens, leaving no room for a completion. Please reduce the length of the "
            "prompt."
        )
        assert (err.code, err.param) == ("context_length_exceeded", "prompt")


def test_messages_word_the_refusal_for_a_chat() -> None:
    err = rejected(MODEL, 82, None, prompt_param="messages")
    assert str(err) == (
        "This model's maximum context length is 64 tokens. However, your messages resulted "
        "in 82 tokens, leaving no room for a completion. Please reduce the length of the "
        "messages."
    )
    assert (err.code, err.param) == ("context_length_exceeded", "messages")
    err = rejected(MODEL, 23, 64, prompt_param="messages",
                   max_tokens_param="max_completion_tokens")
    assert str(err) == (
        "This model's maximum context length is 64 tokens. However, you requested 87 tokens "
        "(23 in the messages, 64 in the completion). Please reduce the length of the messages "
        "or 'max_completion_tokens'."
    )
    assert (err.code, err.param) == ("context_length_exceeded", "max_completion_tokens")


def test_a_prompt_param_other_than_messages_is_worded_as_a_prompt() -> None:
    err = rejected(MODEL, 70, None, prompt_param="input")
    assert "However, your prompt resulted in 70 tokens" in str(err)
    assert err.param == "input"


def test_an_explicit_max_tokens_past_the_context_is_refused() -> None:
    err = rejected(MODEL, 5, 60)
    assert str(err) == (
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
        "(5 in the prompt, 60 in the completion). Please reduce the length of the prompt or "
        "'max_tokens'."
    )
    assert (err.code, err.param) == ("context_length_exceeded", "max_tokens")


# ----------------------------------------------------------------------- the tenant


def test_the_tenant_s_max_tokens_caps_the_default_and_refuses_more() -> None:
    limits = ContextLimits(max_model_len=64, tenant_max_tokens=10)
    assert resolve_max_tokens(limits, 5, None) == 10
    assert resolve_max_tokens(limits, 60, None) == 4  # the context left is smaller
    assert resolve_max_tokens(limits, 5, 10) == 10
    err = rejected(limits, 5, 11)
    assert str(err) == (
        "'max_tokens' is 11, above this account's limit of 10 tokens per request. Lower it, "
        "or ask for a higher limit."
    )
    assert (err.code, err.param) == ("max_tokens_exceeded", "max_tokens")
    err = rejected(limits, 5, 11, max_tokens_param="max_completion_tokens")
    assert str(err).startswith("'max_completion_tokens' is 11, above")
    assert err.param == "max_completion_tokens"


def test_the_tenant_s_max_tokens_is_checked_before_the_model_context() -> None:
    limits = ContextLimits(max_model_len=64, tenant_max_tokens=10)
    assert rejected(limits, 64, 11).code == "max_tokens_exceeded"


def test_the_tenant_s_context_shrinks_the_default() -> None:
    limits = ContextLimits(max_model_len=64, tenant_max_context=20)
    assert resolve_max_tokens(limits, 5, None) == 15
    assert resolve_max_tokens(limits, 5, 15) == 15
    capped = ContextLimits(max_model_len=64, tenant_max_tokens=8, tenant_max_context=20)
    assert resolve_max_tokens(capped, 5, None) == 8  # the lower of the two
    assert resolve_max_tokens(capped, 15, None) == 5


def test_a_prompt_that_fills_the_tenant_s_context_is_refused() -> None:
    limits = ContextLimits(max_model_len=64, tenant_max_context=20)
    for requested in (None, 1):
        err = rejected(limits, 20, requested, prompt_param="messages")
        assert str(err) == (
            "This account's context limit is 20 tokens, and the prompt alone has 20 tokens. "
            "Shorten the prompt."
        )
        assert (err.code, err.param) == ("context_length_exceeded", "messages")


def test_an_explicit_max_tokens_past_the_tenant_s_context_is_refused() -> None:
    limits = ContextLimits(max_model_len=64, tenant_max_context=20)
    err = rejected(limits, 13, 8)
    assert str(err) == (
        "This account's context limit is 20 tokens, but the prompt has 13 tokens and "
        "'max_tokens' asks for 8 more (21 in total). Shorten the prompt or lower "
        "'max_tokens'."
    )
    assert (err.code, err.param) == ("context_length_exceeded", "max_tokens")


def test_the_model_context_is_checked_before_the_tenant_s() -> None:
    limits = ContextLimits(max_model_len=64, tenant_max_context=20)
    err = rejected(limits, 70, None)
    assert str(err).startswith("This model's maximum context length is 64 tokens.")


def test_limits_of_a_tenant() -> None:
    tenant = TenantContext("A", max_tokens=100, max_context_tokens=300)
    assert ContextLimits.of(64, tenant, kv_capacity_tokens=128) == ContextLimits(64, 128, 100,
                                                                                 300)
    assert ContextLimits.of(64, None) == ContextLimits(64)
    assert ContextLimits.of(64, TenantContext("B")) == ContextLimits(64)


# --------------------------------------------------------------------- the KV cache


def test_an_explicit_max_tokens_past_the_kv_capacity_is_refused() -> None:
    limits = ContextLimits(max_model_len=64, kv_capacity_tokens=48)
    assert resolve_max_tokens(limits, 40, 8) == 8
    err = rejected(limits, 40, 9)
    assert str(err) == (
        "The request needs up to 49 tokens of KV cache; this server holds 48."
    )
    assert (err.code, err.param) == ("context_length_exceeded", "max_tokens")


def test_the_kv_capacity_shrinks_the_default_or_refuses_the_prompt() -> None:
    limits = ContextLimits(max_model_len=64, kv_capacity_tokens=48)
    assert resolve_max_tokens(limits, 40, None) == 8
    err = rejected(limits, 50, None, prompt_param="messages")
    assert str(err) == (
        "The request needs up to 51 tokens of KV cache; this server holds 48."
    )
    assert (err.code, err.param) == ("context_length_exceeded", "messages")


def test_without_a_kv_capacity_it_is_not_checked() -> None:
    assert resolve_max_tokens(ContextLimits(max_model_len=10**6), 10, 10**5) == 10**5


# ------------------------------------------------------------------------ token ids


def test_prompt_ids_outside_the_vocabulary_are_refused() -> None:
    check_prompt_ids([0, 5, 9], 10)
    for bad in (10, -1):
        with pytest.raises(RequestRejected) as info:
            check_prompt_ids([1, bad, 11], 10)
        assert str(info.value) == f"Token id {bad} is outside this model's vocabulary (0..9)."
        assert (info.value.code, info.value.param) == ("invalid_prompt", "prompt")
