"""`loraplex worker` / `loraplex gateway` refuse to start without what they need."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from app.cli import main
from app.scaleout_cli import default_advertise_url
from engine.remote.heartbeat import gpu_uuid_from_env

TOKEN = "worker-token-0123456789abcdef"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["worker"], {"REDIS_URL": None}, "needs REDIS_URL"),
        (["worker"], {"REDIS_URL": "redis://x", "LORAPLEX_WORKER_TOKEN": None},
         "LORAPLEX_WORKER_TOKEN is not set"),
        (["worker", "--insecure-no-token", "--host", "0.0.0.0"],
         {"REDIS_URL": "redis://x", "LORAPLEX_WORKER_TOKEN": None},
         "--insecure-no-token only binds a loopback address"),
        (["worker"], {"REDIS_URL": "redis://x", "LORAPLEX_WORKER_TOKEN": "short"},
         "at least 16 characters"),
        (["worker"], {"REDIS_URL": "redis://x", "LORAPLEX_WORKER_TOKEN": TOKEN,
                      "LORAPLEX_HEARTBEAT_TTL_S": "0.5"}, "heartbeat_ttl_s must be longer"),
        (["gateway"], {"REDIS_URL": None}, "needs REDIS_URL"),
        (["gateway", "--no-auth", "--host", "0.0.0.0"], {"REDIS_URL": "redis://x"},
         "--no-auth serves without API keys"),
    ],
)
def test_refusals(args: list[str], env: dict[str, str | None], message: str) -> None:
    result = CliRunner().invoke(main, args, env=env)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_commands_are_registered() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert "worker" in result.output and "gateway" in result.output


def test_advertised_url_and_device_identity() -> None:
    assert default_advertise_url("10.0.0.7", 8001) == "http://10.0.0.7:8001"
    assert default_advertise_url("::1", 8001) == "http://[::1]:8001"
    assert default_advertise_url("0.0.0.0", 8001).endswith(":8001")
    assert "0.0.0.0" not in default_advertise_url("0.0.0.0", 8001)
    mig = "MIG-4f2e8c1a-9d3b-5e6f-8a7b-0c1d2e3f4a5b"
    assert gpu_uuid_from_env(mig) == mig
    assert gpu_uuid_from_env(f" {mig} ") == mig
    assert gpu_uuid_from_env("0") is None
    assert gpu_uuid_from_env(f"{mig},GPU-1") is None
    assert gpu_uuid_from_env(None) is None
