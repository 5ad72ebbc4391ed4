"""What `loraplex demo` prints once it serves: addresses, keys, and commands to try."""

from __future__ import annotations

import json
import shlex

from app.demo.cache import TrainedAdapter
from app.demo.catalog import DemoAdapter
from app.demo.seed import AdminKey, DemoSetup, TenantCredentials


def _owner_label(spec: DemoAdapter) -> str:
    return "shared" if spec.owner is None else spec.owner


def _tenant_for(setup: DemoSetup, spec: DemoAdapter) -> TenantCredentials:
    """The tenant whose key shows the adapter off: its owner, or the first tenant."""
    for tenant in setup.tenants:
        if tenant.name == spec.owner:
            return tenant
    return setup.tenants[0]


def _curl(base: str, key: str, model: str, prompt: str) -> str:
    body = json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 48,
        "temperature": 0,
    })
    return (
        f"  curl -s {base}/v1/chat/completions \\\n"
        f"    -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\\n"
        f"    -d {shlex.quote(body)}"
    )


def render(
    *,
    base: str,
    model_id: str,
    admin: AdminKey,
    setup: DemoSetup,
    adapters: list[TrainedAdapter],
    keys_file: str,
) -> str:
    lines = [
        "",
        f"loraplex demo: {model_id} with {len(adapters)} LoRA adapters on {base}",
        "",
        f"  admin UI   {base}/admin/ui",
        f"  admin key  {admin.key}   ({admin.source})",
        "",
        f"  tenants (keys kept in {keys_file}):",
    ]
    for tenant in setup.tenants:
        visible = [a.spec.name for a in adapters if a.spec.owner in (None, tenant.name)]
        lines.append(f"    {tenant.name:<8} {tenant.tier:<9} {tenant.key}   "
                     f"models: {model_id}, {', '.join(visible)}")
    lines += ["", "  adapters (trained on the bundled model from app/demo/data/):"]
    for trained in adapters:
        spec = trained.spec
        lines.append(f"    {spec.name:<8} {_owner_label(spec):<9} {spec.behaviour}")
    lines += ["", "Try each adapter, then the base model with the same question:", ""]
    for trained in adapters:
        spec = trained.spec
        tenant = _tenant_for(setup, spec)
        lines += [f"  # {spec.name} ({spec.behaviour}), as {tenant.name}:",
                  _curl(base, tenant.key, spec.name, spec.try_prompt), ""]
    first = adapters[0].spec
    tenant = _tenant_for(setup, first)
    lines += [
        "  # the same with the openai package (pip install openai):",
        "  python - <<'EOF'",
        "from openai import OpenAI",
        f'client = OpenAI(base_url="{base}/v1", api_key="{tenant.key}")',
        f'for model in ["{model_id}", "{first.name}"]:',
        "    reply = client.chat.completions.create(",
        f'        model=model, messages=[{{"role": "user", "content": "{first.try_prompt}"}}],',
        "        max_tokens=48, temperature=0)",
        '    print(f"{model}: {reply.choices[0].message.content}")',
        "EOF",
        "",
        f"  {base}/v1/models (with a tenant key)   {base}/docs   {base}/metrics",
        "  Ctrl-C stops the server.",
        "",
    ]
    return "\n".join(lines)
