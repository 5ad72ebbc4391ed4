#!/usr/bin/env python3
"""Turn `loraplex plan --format json` into values of the Helm chart (`model`, `workers`).

    loraplex plan --topology topo.yaml --tenants tenants.yaml --format json > plan.json
    python deploy/plan_to_values.py plan.json --tenant-id acme=ten_... > workers.yaml
    helm upgrade --install loraplex deploy/helm/loraplex -f workers.yaml

Each planned worker becomes one entry: its MIG profile (the chart requests
`nvidia.com/mig-<profile>`, or `nvidia.com/gpu` for a whole GPU, as the plan's
`resources` say), the node it was planned on, its engine flags (the plan's `args`) and,
for a dedicated tenant, `--dedicated-tenant <tenant id>`: the plan names tenants, workers
take ids, so each dedicated tenant needs `--tenant-id NAME=ID` (ids: GET /admin/tenants).

Exit status 2, with the reasons on stderr, when the plan left tenants unplaced (unless
--allow-unplaced), a dedicated tenant has no id, or the plan is inconsistent. The
plan's `setup` steps (e.g. creating MIG slices) are printed on stderr.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_MAX_NAME = 40  # <release>-worker-<name> must stay a valid 63-character label


class PlanError(ValueError):
    """The plan cannot be turned into values; the message says why."""


@dataclass(slots=True)
class Conversion:
    values: dict[str, Any]
    unplaced: list[str] = field(default_factory=list)  # "tenant: reason"
    setup: list[str] = field(default_factory=list)  # steps to run before installing


def gpu_resource(mig_profile: str | None) -> str:
    return f"nvidia.com/mig-{mig_profile}" if mig_profile else "nvidia.com/gpu"


def _dns_label(text: str) -> str:
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return re.sub(r"-{2,}", "-", label)[:_MAX_NAME].rstrip("-") or "worker"


def _tenant_name(tenant: Any) -> str:
    if isinstance(tenant, dict):
        return str(tenant.get("name") or tenant.get("tenant"))
    return str(tenant)


def _split_model(args: list[str]) -> tuple[str | None, list[str]]:
    """(the --model value, the other flags)."""
    model: str | None = None
    rest: list[str] = []
    items = iter(args)
    for arg in items:
        if arg == "--model":
            model = next(items, None)
        elif arg.startswith("--model="):
            model = arg.partition("=")[2]
        else:
            rest.append(arg)
    return model, rest


def _engine_args(planned: dict[str, Any]) -> tuple[str | None, list[str]]:
    if "args" in planned:
        return _split_model([str(a) for a in planned["args"]])
    args: list[str] = []  # a plan without `args`: what it does say
    if planned.get("max_loras"):
        args += ["--max-loras", str(int(planned["max_loras"]))]
    if planned.get("kv_cache_tokens"):
        args += ["--kv-cache-tokens", str(int(planned["kv_cache_tokens"]))]
    return None, args


def convert(plan: dict[str, Any], tenant_ids: dict[str, str] | None = None) -> Conversion:
    tenant_ids = tenant_ids or {}
    workers: list[dict[str, Any]] = []
    models: set[str] = set()
    seen: dict[str, int] = {}
    setup: list[str] = []
    for planned in plan.get("workers", []):
        profile = planned.get("mig_profile")
        resources = planned.get("resources")
        if resources is not None and set(resources) != {gpu_resource(profile)}:
            raise PlanError(
                f"worker on {planned['node']} GPU {planned['gpu']}: resources {resources} do "
                f"not match its MIG profile {profile!r}"
            )
        base = _dns_label(
            f"{planned['node']}-gpu{planned['gpu']}" + (f"-{profile}" if profile else "")
        )
        seen[base] = seen.get(base, 0) + 1
        # Several slices of one profile on one GPU: -1, -2, ... after the first.
        name = base if seen[base] == 1 else f"{base}-{seen[base] - 1}"
        entry: dict[str, Any] = {"name": name}
        if profile:
            entry["migProfile"] = str(profile)
        entry["node"] = str(planned["node"])
        tenants = [_tenant_name(t) for t in planned.get("tenants") or []]
        isolation = planned.get("isolation")
        if isolation:
            entry["isolation"] = str(isolation)
        if tenants:
            entry["tenants"] = tenants
        if isolation == "dedicated":
            missing = [t for t in tenants if t not in tenant_ids]
            if missing:
                raise PlanError(
                    f"worker {name} is dedicated to {', '.join(missing)}: give each tenant's "
                    "id with --tenant-id NAME=ID (GET /admin/tenants lists them)"
                )
            entry["dedicatedTenants"] = [tenant_ids[t] for t in tenants]
        model, engine_args = _engine_args(planned)
        if model is not None:
            models.add(model)
        if engine_args:
            entry["engineArgs"] = engine_args
        workers.append(entry)
        if planned.get("setup"):
            step = str(planned["setup"])
            if step not in setup:
                setup.append(step)
    if len(models) > 1:
        raise PlanError(f"the plan's workers serve different models: {sorted(models)}")
    values: dict[str, Any] = {}
    if models:
        values["model"] = models.pop()
    values["workers"] = workers
    unplaced = [
        f"{item.get('tenant')}: {item.get('reason')}" for item in plan.get("unplaced", [])
    ]
    return Conversion(values=values, unplaced=unplaced, setup=setup)


def _tenant_id(text: str) -> tuple[str, str]:
    name, sep, tenant_id = text.partition("=")
    if not sep or not name or not tenant_id:
        raise argparse.ArgumentTypeError(f"expected NAME=ID, got {text!r}")
    return name, tenant_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("plan", type=Path, nargs="?", help="plan JSON (default: stdin)")
    parser.add_argument("--tenant-id", type=_tenant_id, action="append", default=[],
                        metavar="NAME=ID", help="the id of a dedicated tenant (repeatable)")
    parser.add_argument("--allow-unplaced", action="store_true")
    args = parser.parse_args(argv)
    text = args.plan.read_text() if args.plan else sys.stdin.read()
    try:
        result = convert(json.loads(text), dict(args.tenant_id))
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(
        "# Generated by deploy/plan_to_values.py from `loraplex plan` output.\n"
        + yaml.safe_dump(result.values, sort_keys=False)
    )
    for step in result.setup:
        print(f"setup: {step}", file=sys.stderr)
    for line in result.unplaced:
        print(f"unplaced: {line}", file=sys.stderr)
    return 2 if result.unplaced and not args.allow_unplaced else 0


if __name__ == "__main__":
    sys.exit(main())
