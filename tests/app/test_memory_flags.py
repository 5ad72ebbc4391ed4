"""--gpu-memory-utilization and --max-model-len: through serve, worker and plan's click
parsing into EngineConfig and the plan, and bad values refused as usage errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from app import cli
from app.plan_cli import plan
from engine.config import EngineConfig

FIXTURES = Path(__file__).parents[1] / "fixtures" / "placement"
SMOLLM2 = str(FIXTURES / "models" / "smollm2-135m")


def _serve(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[Any, list[EngineConfig]]:
    seen: list[EngineConfig] = []

    async def fake_serve_engine(config: EngineConfig, settings: Any, **_: Any) -> None:
        seen.append(config)

    monkeypatch.setattr(cli, "serve_engine", fake_serve_engine)
    return CliRunner().invoke(cli.main, ["serve", "--no-auth", *args]), seen


def test_the_flags_reach_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    result, seen = _serve(monkeypatch, "--gpu-memory-utilization", "0.75",
                          "--max-model-len", "4096")
    assert result.exit_code == 0, result.output
    [config] = seen
    assert (config.gpu_memory_utilization, config.max_model_len) == (0.75, 4096)


def test_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    result, seen = _serve(monkeypatch)
    assert result.exit_code == 0, result.output
    [config] = seen
    assert (config.gpu_memory_utilization, config.max_model_len) == (0.9, None)
    assert config == EngineConfig()


@pytest.mark.parametrize(("env", "args", "want"), [
    (None, [], True),
    (None, ["--no-kv-cache-prefault"], False),
    ("0", [], False),
    ("0", ["--kv-cache-prefault"], True),
])
def test_the_kv_cache_prefault_flag(
    monkeypatch: pytest.MonkeyPatch, env: str | None, args: list[str], want: bool
) -> None:
    if env is None:
        monkeypatch.delenv("LORAPLEX_KV_CACHE_PREFAULT", raising=False)
    else:
        monkeypatch.setenv("LORAPLEX_KV_CACHE_PREFAULT", env)
    result, seen = _serve(monkeypatch, *args)
    assert result.exit_code == 0, result.output
    [config] = seen
    assert config.kv_cache_prefault is want


@pytest.mark.parametrize(("args", "message"), [
    (["--gpu-memory-utilization", "0"], "0<x<=1"),
    (["--gpu-memory-utilization", "1.2"], "0<x<=1"),
    (["--gpu-memory-utilization", "half"], "'half' is not a valid float"),
    (["--max-model-len", "0"], "x>=1"),
    (["--max-model-len", "4k"], "'4k' is not a valid integer"),
])
def test_bad_values_are_usage_errors(
    monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    result, seen = _serve(monkeypatch, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert seen == []


def test_serve_and_worker_document_the_flags() -> None:
    for command in (["serve"], ["worker"]):
        out = CliRunner().invoke(cli.main, [*command, "--help"]).output
        assert "--gpu-memory-utilization" in out and "--max-model-len" in out


def _plan(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(plan, [
        "--topology", str(FIXTURES / "a100_80gb_7x1g.yaml"),
        "--tenants", str(FIXTURES / "tenants_mixed.yaml"), "--model", SMOLLM2, *args,
    ])
    return result.exit_code, result.output


def test_plan_sizes_workers_under_the_utilisation() -> None:
    code, out = _plan()
    assert code == 0, out
    default = json.loads(out)["workers"][0]
    code, out = _plan("--gpu-memory-utilization", "0.5")
    assert code == 0, out
    half = json.loads(out)["workers"][0]
    assert default["memory_gb"] == half["memory_gb"] == 9.5
    assert 0 < half["kv_cache_tokens"] < default["kv_cache_tokens"]
    assert half["memory"]["total_gb"] <= 0.5 * 9.5 < default["memory"]["total_gb"] <= 0.9 * 9.5
    code, out = _plan("--gpu-memory-utilization", "1.5")
    assert code == 2 and "0<x<=1" in out
