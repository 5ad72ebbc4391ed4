"""deploy/plan_to_values.py: `loraplex plan` JSON into the chart's `model` and `workers`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.support import load_deploy_script

converter = load_deploy_script("plan_to_values")


def _worker(**overrides: Any) -> dict[str, Any]:
    worker: dict[str, Any] = {
        "node": "node-a", "gpu": 0, "mig_profile": "1g.18gb", "memory_gb": 16.5,
        "isolation": "shared", "tenants": ["small-co"], "max_loras": 8,
        "kv_cache_tokens": 354192, "env": {"CUDA_VISIBLE_DEVICES": "MIG-abc"},
        "resources": {"nvidia.com/mig-1g.18gb": 1},
        "args": ["--model", "default", "--max-loras", "8", "--kv-cache-tokens", "354192"],
        "setup": None,
    }
    worker.update(overrides)
    return worker


def test_workers_become_chart_entries_with_unique_names() -> None:
    plan = {
        "workers": [
            _worker(),
            _worker(),  # a second 1g.18gb slice of the same GPU
            _worker(gpu=2, mig_profile=None, resources={"nvidia.com/gpu": 1},
                    isolation="dedicated", tenants=["acme"],
                    setup="create the MIG instances"),
        ],
        "unplaced": [],
    }
    result = converter.convert(plan, {"acme": "ten_0123456789abcdef"})
    assert result.values == {
        "model": "default",
        "workers": [
            {"name": "node-a-gpu0-1g-18gb", "migProfile": "1g.18gb", "node": "node-a",
             "isolation": "shared", "tenants": ["small-co"],
             "engineArgs": ["--max-loras", "8", "--kv-cache-tokens", "354192"]},
            {"name": "node-a-gpu0-1g-18gb-1", "migProfile": "1g.18gb", "node": "node-a",
             "isolation": "shared", "tenants": ["small-co"],
             "engineArgs": ["--max-loras", "8", "--kv-cache-tokens", "354192"]},
            {"name": "node-a-gpu2", "node": "node-a", "isolation": "dedicated",
             "tenants": ["acme"], "dedicatedTenants": ["ten_0123456789abcdef"],
             "engineArgs": ["--max-loras", "8", "--kv-cache-tokens", "354192"]},
        ],
    }
    assert result.setup == ["create the MIG instances"]
    assert result.unplaced == []


def test_a_plan_without_args_keeps_what_it_says() -> None:
    worker = _worker()
    del worker["args"], worker["resources"]
    result = converter.convert({"workers": [worker]})
    assert result.values == {"workers": [{
        "name": "node-a-gpu0-1g-18gb", "migProfile": "1g.18gb", "node": "node-a",
        "isolation": "shared", "tenants": ["small-co"],
        "engineArgs": ["--max-loras", "8", "--kv-cache-tokens", "354192"],
    }]}


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"workers": [_worker(isolation="dedicated", tenants=["acme"])]},
         "dedicated to acme: give each tenant's id with --tenant-id"),
        ({"workers": [_worker(resources={"nvidia.com/gpu": 1})]},
         "do not match its MIG profile '1g.18gb'"),
        ({"workers": [_worker(), _worker(args=["--model", "/models/other"])]},
         "different models"),
    ],
)
def test_inconsistent_plans_are_refused(plan: dict[str, Any], message: str) -> None:
    with pytest.raises(converter.PlanError, match=message):
        converter.convert(plan)


def test_main_writes_values_and_fails_on_unplaced_tenants(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({
        "workers": [_worker()],
        "unplaced": [{"tenant": "huge", "reason": "needs 200 GiB, the largest slice has 141"}],
    }))
    assert converter.main([str(path)]) == 2
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["workers"][0]["name"] == "node-a-gpu0-1g-18gb"
    assert err == "unplaced: huge: needs 200 GiB, the largest slice has 141\n"
    assert converter.main([str(path), "--allow-unplaced"]) == 0


def test_main_reports_a_missing_tenant_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"workers": [_worker(isolation="dedicated", tenants=["acme"])]}))
    assert converter.main([str(path)]) == 2
    assert "--tenant-id" in capsys.readouterr().err
    assert converter.main([str(path), "--tenant-id", "acme=ten_1"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["workers"][0]["dedicatedTenants"] == ["ten_1"]
    with pytest.raises(SystemExit):
        converter.main([str(path), "--tenant-id", "acme"])
