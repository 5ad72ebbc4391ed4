"""The smoke run after a push: a few prompts answered greedily by the base model and by
the new adapter, through the tenant API as the admin acting for the adapter's tenant."""

from __future__ import annotations

from collections.abc import Sequence

from app.admin_cli.client import ACT_FOR_TENANT_HEADER, AdminClient, AdminCliError
from app.admin_cli.report import SmokeAnswer

# Short, varied asks: a style, a fact and a format, where tuned adapters tend to differ.
SAMPLE_PROMPTS = (
    "Introduce yourself in one sentence.",
    "What is the capital of France?",
    "List three colours, separated by commas.",
)


def _headers(tenant_id: str | None) -> dict[str, str]:
    return {} if tenant_id is None else {ACT_FOR_TENANT_HEADER: tenant_id}


def base_model_id(client: AdminClient, tenant_id: str | None) -> str:
    """The model adapters apply to: the one card of /v1/models without a parent."""
    body = client.json("GET", "/v1/models", headers=_headers(tenant_id))
    for card in body.get("data", []):
        if card.get("parent") is None:
            return str(card["id"])
    raise AdminCliError("GET /v1/models lists no base model.")


def answer(
    client: AdminClient, *, model: str, prompt: str, max_tokens: int, tenant_id: str | None
) -> str:
    body = client.json(
        "POST",
        "/v1/chat/completions",
        headers=_headers(tenant_id),
        json={
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": max_tokens,
        },
    )
    return str(body["choices"][0]["message"]["content"] or "")


def smoke_run(
    client: AdminClient,
    *,
    base_model: str,
    adapter_model: str,
    prompts: Sequence[str],
    max_tokens: int,
    tenant_id: str | None,
) -> list[SmokeAnswer]:
    """NOTE: the admin's own requests (see X-Loraplex-Tenant): they use none of the
    tenant's quota and are not billed to it."""
    return [
        SmokeAnswer(
            prompt=prompt,
            base=answer(client, model=base_model, prompt=prompt, max_tokens=max_tokens,
                        tenant_id=tenant_id),
            adapted=answer(client, model=adapter_model, prompt=prompt, max_tokens=max_tokens,
                           tenant_id=tenant_id),
        )
        for prompt in prompts
    ]
