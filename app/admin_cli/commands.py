"""Thin `loraplex admin` commands over the admin API: tenants, keys, adapters, usage,
invoices. Each prints a table (or the server's JSON/CSV/HTML when asked) and nothing
else on stdout, so that its output can be piped."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from app.admin_cli.client import AdminClient, AdminCliError, AdminContext, BadInput
from app.admin_cli.push import push
from app.admin_cli.report import format_version

_QUOTAS = (
    "rpm", "tpm", "max_concurrency", "monthly_tokens", "max_tokens", "max_context_tokens",
    "max_adapters",
)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return lines


def _echo_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    for line in format_table(headers, rows):
        click.echo(line)


def _echo_json(body: Any) -> None:
    click.echo(json.dumps(body, indent=2, ensure_ascii=False))


def _date(unix: int | None) -> str | None:
    return None if unix is None else datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%d")


def _tenant_id(ctx: AdminContext, ref: str | None) -> str | None:
    if ref is None:
        return None
    with ctx.client() as client:
        return client.resolve_tenant(ref).id


# ---------------------------------------------------------------------------- tenants


@click.group()
def tenants() -> None:
    """Tenants: list, create."""


@tenants.command("list")
@click.option("--json", "as_json", is_flag=True, help="The server's JSON.")
@click.pass_obj
def tenants_list(ctx: AdminContext, as_json: bool) -> None:
    with ctx.client() as client:
        body = client.json("GET", "/admin/tenants")
    if as_json:
        _echo_json(body)
        return
    rows = [
        (t["id"], t["name"], t["tier"], t["isolation"], t.get("plan"),
         "disabled" if t["disabled"] else "active", _date(t["created_at"]))
        for t in body["data"]
    ]
    _echo_table(("ID", "NAME", "TIER", "ISOLATION", "PLAN", "STATE", "CREATED"), rows)


@tenants.command("create")
@click.argument("name")
@click.option("--tier", type=click.Choice(["premium", "standard", "batch"]),
              default="standard", show_default=True)
@click.option("--isolation", type=click.Choice(["shared", "dedicated"]),
              default="shared", show_default=True)
@click.option("--plan", default=None, help="A price plan's name (see /admin/plans).")
@click.option("--rpm", type=click.IntRange(min=1), help="Requests per minute.")
@click.option("--tpm", type=click.IntRange(min=1), help="Tokens per minute.")
@click.option("--max-concurrency", type=click.IntRange(min=1))
@click.option("--monthly-tokens", type=click.IntRange(min=1))
@click.option("--max-tokens", type=click.IntRange(min=1), help="Per request.")
@click.option("--max-context-tokens", type=click.IntRange(min=1))
@click.option("--max-adapters", type=click.IntRange(min=1))
@click.pass_obj
def tenants_create(
    ctx: AdminContext, name: str, tier: str, isolation: str, plan: str | None, **quotas: int | None
) -> None:
    """Create tenant NAME; prints its id (quotas omitted: unlimited)."""
    body = {
        "name": name, "tier": tier, "isolation": isolation, "plan": plan,
        "quotas": {k: v for k, v in quotas.items() if k in _QUOTAS and v is not None},
    }
    with ctx.client() as client:
        tenant = client.json("POST", "/admin/tenants", json=body)
    click.echo(f"Created tenant {tenant['name']}: {tenant['id']}")


# ------------------------------------------------------------------------------- keys


@click.group()
def keys() -> None:
    """API keys: create."""


@keys.command("create")
@click.argument("tenant")
@click.option("--name", default="default", show_default=True, help="What lists call the key.")
@click.option("--scope", "scopes", multiple=True,
              type=click.Choice(["inference", "adapters:write"]),
              help="Repeatable; default: inference.")
@click.option("--expires-at", default=None, help="ISO 8601 with a zone, or unix seconds.")
@click.pass_obj
def keys_create(
    ctx: AdminContext, tenant: str, name: str, scopes: tuple[str, ...], expires_at: str | None
) -> None:
    """Create a key for TENANT (id or name). The key is printed once; store it now."""
    body: dict[str, Any] = {"name": name}
    if scopes:
        body["scopes"] = list(scopes)
    if expires_at is not None:
        body["expires_at"] = expires_at
    with ctx.client() as client:
        target = client.resolve_tenant(tenant)
        created = client.json("POST", f"/admin/tenants/{target.id}/keys", json=body)
    click.echo(f"Key {created['id']} for tenant {target.name} ({', '.join(created['scopes'])}):",
               err=True)
    click.echo(created["key"])
    click.echo("Shown this once; only its hash is stored.", err=True)


# --------------------------------------------------------------------------- adapters


@click.group()
def adapters() -> None:
    """Adapters: push a PEFT directory, import one from an object store, list, gc."""


adapters.add_command(push)


@adapters.command("list")
@click.option("--tenant", default=None, help="One tenant (id or name), or 'shared'.")
@click.option("--json", "as_json", is_flag=True, help="The server's JSON.")
@click.pass_obj
def adapters_list(ctx: AdminContext, tenant: str | None, as_json: bool) -> None:
    params = {}
    if tenant is not None:
        params["tenant_id"] = "shared" if tenant == "shared" else _tenant_id(ctx, tenant)
    with ctx.client() as client:
        body = client.json("GET", "/admin/adapters", params=params)
    if as_json:
        _echo_json(body)
        return
    rows = []
    for a in body["data"]:
        statuses = " ".join(f"v{v['version']}:{v['status']}" for v in a["versions"])
        rows.append((a["id"], a["name"], a["tenant_id"] or "shared", a["latest_version"],
                     statuses))
    _echo_table(("ID", "NAME", "OWNER", "LATEST", "VERSIONS"), rows)


@adapters.command("import")
@click.argument("name")
@click.argument("source", metavar="s3://BUCKET/PATH/")
@click.option("--tenant", default=None, help="The owner (id or name); default: shared.")
@click.option("--json", "as_json", is_flag=True, help="The server's JSON.")
@click.pass_obj
def adapters_import(
    ctx: AdminContext, name: str, source: str, tenant: str | None, as_json: bool
) -> None:
    """Import NAME from an object store prefix: the server reads it with its own AWS
    credentials and checks it as an upload."""
    with ctx.client(timeout_s=600.0) as client:
        owner = None if tenant is None else client.resolve_tenant(tenant)
        body = client.json("POST", "/admin/adapters/import", json={
            "name": name, "source": source, "tenant_id": None if owner is None else owner.id,
        })
    if as_json:
        _echo_json(body)
        return
    label = "shared with every tenant" if owner is None else f"tenant {owner.name}, {owner.id}"
    for line in format_version({**body, "id": body["version_id"]}, label):
        click.echo(line)


@adapters.command("gc")
@click.option("--json", "as_json", is_flag=True, help="The server's JSON.")
@click.pass_obj
def adapters_gc(ctx: AdminContext, as_json: bool) -> None:
    """Remove stored adapter files that no version uses, on the server and in the object
    store (what a crash or a shutdown during a delete's grace period left)."""
    with ctx.client(timeout_s=600.0) as client:
        body = client.json("POST", "/admin/adapters/gc")
    if as_json:
        _echo_json(body)
        return
    click.echo(f"Removed {len(body['removed'])} unused adapter file set(s).", err=True)
    for digest in body["removed"]:
        click.echo(digest)


@adapters.command("eval")
@click.argument("name")
@click.option("--data", "data_path", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The eval set: JSONL, one item per line (README, 'Evaluating an adapter').")
@click.option("--version", type=click.IntRange(min=1), default=None,
              help="The version to score; default: the latest ready one.")
@click.option("--tenant", default=None, help="The owner (id or name); default: shared.")
@click.option("--json", "as_json", is_flag=True, help="The finished eval's JSON.")
@click.pass_obj
def adapters_eval(ctx: AdminContext, name: str, data_path: Path, version: int | None,
                  tenant: str | None, as_json: bool) -> None:
    """Score an eval set on NAME's version, the version before it and the base model, on
    the server (at the batch tier's priority); show the progress, then the scores."""
    with ctx.client(timeout_s=60.0) as client:
        adapter_id = _adapter_id(client, name, tenant)
        body = client.json(
            "POST", f"/admin/adapters/{adapter_id}/evals", ok=(202,),
            params={} if version is None else {"version": version},
            content=data_path.read_bytes(), headers={"Content-Type": "application/jsonl"},
        )
        path = f"/admin/adapters/{adapter_id}/evals/{body['id']}"
        with click.progressbar(length=body["total_items"], label=f"{name} v{body['version']}",
                               file=sys.stderr) as bar:
            shown = 0
            while body["status"] == "running":
                time.sleep(0.5)
                body = client.json("GET", path)
                bar.update(body["done_items"] - shown)
                shown = body["done_items"]
    if as_json:
        _echo_json(body)
        return
    if body["status"] == "failed":
        raise AdminCliError(f"the eval failed: {body['error']}")
    scores = body["scores"]
    rows = [(f"v{body['version']}", scores["version"])]
    if body["previous_version"] is not None:
        rows.append((f"v{body['previous_version']} (previous)", scores["previous"]))
    rows.append(("base model", scores["base"]))
    _echo_table(("MODEL", "SCORE"), [(m, f"{s:.3f}") for m, s in rows])


def _adapter_id(client: AdminClient, name: str, tenant: str | None) -> str:
    """The id of the adapter NAME of `tenant` (id or name; None: shared)."""
    owner = "shared" if tenant is None else client.resolve_tenant(tenant).id
    listed = client.json("GET", "/admin/adapters", params={"tenant_id": owner})["data"]
    found = [a for a in listed if a["name"] == name]
    if not found:
        whose = "the shared adapters" if tenant is None else f"tenant {tenant}"
        raise BadInput(f"no adapter '{name}' among {whose} (see `loraplex admin "
                       "adapters list`).")
    return str(found[0]["id"])


def _echo_current(body: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _echo_json(body)
        return
    staged = [f"v{v['version']}" for v in body["versions"]
              if v["status"] == "ready" and v["staged"]]
    click.echo(f"{body['name']}: v{body['latest_version']} is current"
               + (f"; staged: {', '.join(staged)}" if staged else ""))


_TENANT_OPTION = click.option("--tenant", default=None,
                              help="The owner (id or name); default: shared.")
_JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="The adapter's JSON.")


@adapters.command("promote")
@click.argument("name")
@click.option("--version", type=click.IntRange(min=1), required=True,
              help="The staged version that plain NAME is to resolve to.")
@_TENANT_OPTION
@_JSON_OPTION
@click.pass_obj
def adapters_promote(ctx: AdminContext, name: str, version: int, tenant: str | None,
                     as_json: bool) -> None:
    """Make a staged version of NAME current: requests for plain NAME go to it."""
    with ctx.client() as client:
        adapter_id = _adapter_id(client, name, tenant)
        body = client.json("POST", f"/admin/adapters/{adapter_id}/promote",
                           params={"version": version})
    _echo_current(body, as_json)


@adapters.command("rollback")
@click.argument("name")
@_TENANT_OPTION
@_JSON_OPTION
@click.pass_obj
def adapters_rollback(ctx: AdminContext, name: str, tenant: str | None, as_json: bool) -> None:
    """Send plain NAME back to the promoted version before the current one (which goes
    back to staged)."""
    with ctx.client() as client:
        adapter_id = _adapter_id(client, name, tenant)
        body = client.json("POST", f"/admin/adapters/{adapter_id}/rollback")
    _echo_current(body, as_json)


@adapters.command("gate")
@click.argument("name")
@click.option("--data", "data_path", default=None,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The gate's eval set (JSONL, as for `eval`).")
@click.option("--threshold", type=click.FloatRange(0.0, 1.0), default=None,
              help="A staged version must also score at least this.")
@click.option("--off", is_flag=True, help="Turn the gate off.")
@_TENANT_OPTION
@_JSON_OPTION
@click.pass_obj
def adapters_gate(ctx: AdminContext, name: str, data_path: Path | None,
                  threshold: float | None, off: bool, tenant: str | None,
                  as_json: bool) -> None:
    """Turn NAME's promotion gate on (--data) or off (--off): with it on, each new version
    is staged, scored with the set against the current version, and promoted only if it
    scores at least as well (and at least --threshold)."""
    if off == (data_path is not None):
        raise BadInput("give either --data FILE (gate on) or --off.")
    with ctx.client() as client:
        adapter_id = _adapter_id(client, name, tenant)
        path = f"/admin/adapters/{adapter_id}/gate"
        if data_path is None:
            body = client.json("DELETE", path)
        else:
            body = client.json(
                "PUT", path, params={} if threshold is None else {"threshold": threshold},
                content=data_path.read_bytes(), headers={"Content-Type": "application/jsonl"},
            )
    if as_json:
        _echo_json(body)
        return
    if body["gated"]:
        extra = "" if body["gate_threshold"] is None else f", at least {body['gate_threshold']}"
        click.echo(f"{name}: new versions are staged until they score at least the current "
                   f"version{extra}")
    else:
        click.echo(f"{name}: gate off; new versions are current once ready")


# ------------------------------------------------------------------------------ usage


@click.command()
@click.option("--tenant", default=None, help="One tenant (id or name); default: all.")
@click.option("--group-by", type=click.Choice(["day", "adapter", "key"]), default=None)
@click.option("--start", default=None, help="ISO date/time or unix seconds (default: month).")
@click.option("--end", default=None, help="Exclusive.")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table",
              show_default=True)
@click.pass_obj
def usage(
    ctx: AdminContext, tenant: str | None, group_by: str | None, start: str | None,
    end: str | None, fmt: str,
) -> None:
    """Token usage per tenant (and per day, adapter or key)."""
    params = {"tenant_id": _tenant_id(ctx, tenant), "group_by": group_by, "start": start,
              "end": end, "format": "csv" if fmt == "csv" else "json"}
    params = {k: v for k, v in params.items() if v is not None}
    with ctx.client() as client:
        if fmt == "csv":
            click.echo(client.send("GET", "/admin/usage", params=params).text, nl=False)
            return
        body = client.json("GET", "/admin/usage", params=params)
    if fmt == "json":
        _echo_json(body)
        return
    group = {"day": ("day",), "adapter": ("adapter_name",), "key": ("key_name",)}.get(
        group_by or "", ()
    )
    counts = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "total_tokens")
    rows = [[r["tenant_id"], *(r.get(g) for g in group), *(r[c] for c in counts)]
            for r in body["data"]]
    rows.append(["total", *("" for _ in group), *(body["totals"][c] for c in counts)])
    headers = ["TENANT", *(g.upper() for g in group), *(c.upper() for c in counts)]
    click.echo(f"{body['start']} .. {body['end']}", err=True)
    _echo_table(headers, rows)


# --------------------------------------------------------------------------- invoices


@click.group()
def invoices() -> None:
    """Invoices: generate, list, show."""


def _invoice_rows(data: Sequence[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(i["id"], i["tenant_id"], i["period"], i["plan"], f"{i['total']} {i['currency']}",
             i["status"]) for i in data]


_INVOICE_HEADERS = ("ID", "TENANT", "PERIOD", "PLAN", "TOTAL", "STATUS")


@invoices.command("generate")
@click.argument("tenant")
@click.argument("period", metavar="YYYY-MM")
@click.option("--json", "as_json", is_flag=True, help="The server's JSON.")
@click.pass_obj
def invoices_generate(ctx: AdminContext, tenant: str, period: str, as_json: bool) -> None:
    """Generate (or regenerate, while a draft) TENANT's invoice for PERIOD."""
    with ctx.client() as client:
        target = client.resolve_tenant(tenant)
        body = client.json("POST", "/admin/invoices",
                           json={"tenant_id": target.id, "period": period})
    if as_json:
        _echo_json(body)
        return
    _echo_table(_INVOICE_HEADERS, _invoice_rows([body]))


@invoices.command("list")
@click.option("--tenant", default=None, help="One tenant (id or name); default: all.")
@click.pass_obj
def invoices_list(ctx: AdminContext, tenant: str | None) -> None:
    tenant_id = _tenant_id(ctx, tenant)
    with ctx.client() as client:
        body = client.json("GET", "/admin/invoices",
                           params={} if tenant_id is None else {"tenant_id": tenant_id})
    _echo_table(_INVOICE_HEADERS, _invoice_rows(body["data"]))


@invoices.command("show")
@click.argument("invoice_id")
@click.option("--format", "fmt", type=click.Choice(["json", "csv", "html"]), default="json",
              show_default=True)
@click.pass_obj
def invoices_show(ctx: AdminContext, invoice_id: str, fmt: str) -> None:
    """One invoice as JSON, CSV or a printable HTML page (redirect it to a file)."""
    with ctx.client() as client:
        response = client.send("GET", f"/admin/invoices/{invoice_id}", params={"format": fmt})
    if fmt == "json":
        _echo_json(response.json())
    else:
        click.echo(response.text, nl=False)
