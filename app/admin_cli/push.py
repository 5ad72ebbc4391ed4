"""`loraplex admin adapters push DIR`: upload a PEFT adapter, wait for its validation,
print the report, then compare its answers with the base model's."""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from app.admin_cli.client import (
    AdminClient,
    AdminCliError,
    AdminContext,
    BadInput,
    ServerError,
    Tenant,
    ValidationFailed,
)
from app.admin_cli.pack import MultipartUpload, check_adapter_dir, pack_adapter
from app.admin_cli.report import format_smoke, format_version, human_bytes
from app.admin_cli.smoke import SAMPLE_PROMPTS, base_model_id, smoke_run

# As the server names adapters (app.registry.views.ADAPTER_NAME); checked here too, so
# that a bad name costs no upload.
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_POLL_INTERVAL_S = 0.5
_SETTLED = ("ready", "failed")


@contextlib.contextmanager
def _progress(total: int) -> Iterator[Callable[[int], None]]:
    """A bar on stderr (bytes sent of total) when it is a terminal; silence otherwise."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    with click.progressbar(
        length=total, label=f"Uploading {human_bytes(total)}", file=sys.stderr,
        show_percent=True, show_pos=False, show_eta=True,
    ) as bar:
        yield bar.update


def _upload(
    client: AdminClient, archive: Path, *, name: str, tenant: Tenant | None, timeout_s: float,
    stage: bool = False,
) -> dict[str, Any]:
    fields = {"name": name} if tenant is None else {"name": name, "tenant_id": tenant.id}
    if stage:
        fields["stage"] = "true"
    form = MultipartUpload.of(fields, "file", archive)
    with _progress(form.length) as on_sent:
        response = client.send(
            "POST", "/admin/adapters",
            ok=(200, 201),
            content=form.chunks(on_sent),
            headers={"Content-Type": form.content_type, "Content-Length": str(form.length)},
            # The server validates before it answers: loading the adapter takes a while.
            timeout=timeout_s,
        )
    return dict(response.json())


def _wait(client: AdminClient, uploaded: dict[str, Any], deadline: float) -> dict[str, Any]:
    """The upload's version once it is ready or failed (the upload may answer before
    that). `uploaded` is the upload's answer: the adapter, with the version flat in it."""
    # Older servers answered the version alone, with its id as `id`.
    version_id = uploaded.get("version_id") or uploaded["id"]
    version = uploaded
    while True:
        adapter = client.json("GET", f"/admin/adapters/{uploaded['adapter_id']}")
        for current in adapter.get("versions", []):
            if current["id"] == version_id:
                version = current
                break
        else:
            raise AdminCliError(
                f"version {version['version']} of '{version['name']}' is gone "
                "(was the adapter deleted meanwhile?)."
            )
        if version["status"] in _SETTLED:
            return version
        if version["status"] != "validating":
            raise AdminCliError(f"the new version is {version['status']}, not validated.")
        if time.monotonic() >= deadline:
            raise AdminCliError(
                f"version {version['version']} of '{version['name']}' is still validating "
                "after --timeout; check it later with `loraplex admin adapters list`."
            )
        time.sleep(_POLL_INTERVAL_S)


def _failed_version(client: AdminClient, name: str, tenant: Tenant | None) -> dict[str, Any]:
    """The newest failed version of `name` (the server keeps it with the reason)."""
    owner = "shared" if tenant is None else tenant.id
    body = client.json("GET", "/admin/adapters", params={"tenant_id": owner})
    for adapter in body.get("data", []):
        if adapter["name"] != name:
            continue
        failed = [v for v in adapter["versions"] if v["status"] == "failed"]
        if failed:
            return dict(max(failed, key=lambda v: v["version"]))
    raise LookupError(name)


def _owner_label(tenant: Tenant | None) -> str:
    return "shared with every tenant" if tenant is None else f"tenant {tenant.name}, {tenant.id}"


def _echo_report(version: dict[str, Any], tenant: Tenant | None) -> None:
    click.echo("Validation report")
    for line in format_version(version, _owner_label(tenant)):
        click.echo(line)


def _validation_failed(
    client: AdminClient, error: ServerError, name: str, tenant: Tenant | None
) -> AdminCliError:
    try:
        version = _failed_version(client, name, tenant)
    except (LookupError, AdminCliError):
        reason = error.server_message
    else:
        _echo_report(version, tenant)
        reason = str(version.get("report", {}).get("error") or error.server_message)
    return ValidationFailed(f"validation failed: {reason}")


@click.command("push")
@click.argument("directory", type=click.Path(path_type=Path, file_okay=False))
@click.option("--tenant", "tenant_ref", default=None, metavar="TENANT",
              help="The owning tenant's id or name; omitted: an adapter shared with every "
                   "tenant.")
@click.option("--name", required=True, help="What requests call it in `model`.")
@click.option("--prompt", "prompts", multiple=True, metavar="TEXT",
              help="A smoke-run prompt (repeatable); default: three built-in samples.")
@click.option("--max-tokens", default=48, show_default=True, type=click.IntRange(min=1),
              help="Tokens per smoke-run answer.")
@click.option("--no-smoke", is_flag=True, help="Skip the smoke run.")
@click.option("--stage", is_flag=True,
              help="Keep the version staged: NAME keeps its current version until "
                   "`loraplex admin adapters promote` (a gated adapter stages every upload).")
@click.option("--timeout", "timeout_s", default=300.0, show_default=True,
              type=click.FloatRange(min=1), help="Seconds for the upload and validation.")
@click.pass_obj
def push(
    ctx: AdminContext,
    directory: Path,
    tenant_ref: str | None,
    name: str,
    prompts: tuple[str, ...],
    max_tokens: int,
    no_smoke: bool,
    stage: bool,
    timeout_s: float,
) -> None:
    """Upload the PEFT adapter in DIRECTORY as the next version of NAME.

    Exit status: 0 ready (and smoke run done), 1 validation failed, 2 bad usage or local
    input, 3 server unreachable or another error.
    """
    check_adapter_dir(directory)
    if not _ADAPTER_NAME.fullmatch(name):
        raise BadInput(
            f"invalid adapter name '{name}': 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit."
        )
    deadline = time.monotonic() + timeout_s
    with ctx.client(timeout_s=min(timeout_s, 60.0)) as client:
        tenant = None if tenant_ref is None else client.resolve_tenant(tenant_ref)
        tmp = Path(tempfile.mkdtemp(prefix="loraplex-push-"))
        try:
            archive = pack_adapter(directory, tmp)
            try:
                uploaded = _upload(client, archive, name=name, tenant=tenant,
                                   timeout_s=timeout_s, stage=stage)
            except ServerError as error:
                if error.status_code == 422 and error.code == "invalid_adapter":
                    raise _validation_failed(client, error, name, tenant) from None
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        version = _wait(client, uploaded, deadline)
        _echo_report(version, tenant)
        if version["status"] == "failed":
            reason = version.get("report", {}).get("error", "no reason given")
            raise ValidationFailed(f"validation failed: {reason}")
        if no_smoke:
            return
        model = f"{version['name']}@{version['version']}"
        tenant_id = None if tenant is None else tenant.id
        base = base_model_id(client, tenant_id)
        click.echo("")
        click.echo(f"Smoke run: {base} vs {model}, greedy, up to {max_tokens} tokens")
        click.echo("")
        answers = smoke_run(
            client, base_model=base, adapter_model=model, prompts=prompts or SAMPLE_PROMPTS,
            max_tokens=max_tokens, tenant_id=tenant_id,
        )
        width = shutil.get_terminal_size((100, 24)).columns
        for line in format_smoke(answers, base_label=base, adapter_label=model, width=width):
            click.echo(line)
