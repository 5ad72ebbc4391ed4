"""deploy/compose.yaml: the services, their images, the commands they run, ports that
agree with Prometheus and the health checks, the GPU reservation, startup order and a
stop grace period longer than the drain."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.deploy.support import (
    COMPOSE,
    DEPLOY,
    GATEWAY_PORT,
    WORKER_PORT,
    cli_problems,
    env_problems,
    load_yaml,
    project_image,
)

LORAPLEX_SERVICES = ("migrate", "gateway", "worker")
# Official images, pinned to a release (never `latest`).
THIRD_PARTY_IMAGES = {
    "postgres": r"postgres:\d+\.\d+",
    "redis": r"redis:\d+\.\d+\.\d+",
    "prometheus": r"prom/prometheus:v\d+\.\d+\.\d+",
    "grafana": r"grafana/grafana:\d+\.\d+\.\d+",
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m)", duration)
    assert match is not None, duration
    return int(match.group(1)) * (60 if match.group(2) == "m" else 1)


def _interpolated(value: str) -> str:
    """What Compose makes of ${VAR:?message} / ${VAR:-default}, with VAR set to `VAR`."""
    return re.sub(r"\$\{(\w+)(:[?-][^}]*)?\}", lambda m: m.group(1), value)


def test_the_stack_has_every_service(services: dict[str, Any]) -> None:
    assert sorted(services) == sorted(
        ["postgres", "redis", "migrate", "gateway", "worker", "prometheus", "grafana"]
    )


def test_images_are_the_project_image_or_pinned_official_ones(
    services: dict[str, Any],
) -> None:
    for name in LORAPLEX_SERVICES:
        service = services[name]
        assert service["image"] == project_image(), name
        assert service["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}, name
        assert (COMPOSE.parent / service["build"]["context"] / "deploy/Dockerfile").is_file()
    for name, pattern in THIRD_PARTY_IMAGES.items():
        assert re.fullmatch(pattern, services[name]["image"]), services[name]["image"]


def test_commands_are_loraplex_commands_the_cli_accepts(services: dict[str, Any]) -> None:
    commands = [services[name]["command"] for name in LORAPLEX_SERVICES]
    assert [c[0] for c in commands] == ["db", "gateway", "worker"]
    assert commands[0] == ["db", "upgrade"]
    assert all(isinstance(arg, str) for command in commands for arg in command)
    assert cli_problems(commands) == []


def test_ports_agree_across_command_publishing_healthchecks_and_scraping(
    services: dict[str, Any],
) -> None:
    gateway, worker = services["gateway"], services["worker"]
    assert int(_flag(gateway["command"], "--port")) == GATEWAY_PORT
    assert gateway["ports"] == [f"{GATEWAY_PORT}:{GATEWAY_PORT}"]
    assert int(_flag(worker["command"], "--port")) == WORKER_PORT
    assert "ports" not in worker, "the worker's internal API is not published"
    assert worker["expose"] == [str(WORKER_PORT)]
    assert _flag(worker["command"], "--advertise-url") == f"http://worker:{WORKER_PORT}"
    for service, port in ((gateway, GATEWAY_PORT), (worker, WORKER_PORT)):
        test = service["healthcheck"]["test"]
        assert test[:2] == ["CMD", "loraplex-healthcheck"]
        assert int(_flag(test, "--port")) == port and _flag(test, "--path") == "/health"
    scrape = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")["scrape_configs"]
    targets = {
        job["job_name"]: (sd["names"], sd["port"])
        for job in scrape for sd in job.get("dns_sd_configs", [])
    }
    assert targets == {
        "loraplex-gateway": (["gateway"], GATEWAY_PORT),
        "loraplex-worker": (["worker"], WORKER_PORT),
    }
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in scrape)


async def test_healthcheck_paths_answer_on_the_apps(services: dict[str, Any]) -> None:
    from tests.deploy.support import probe

    for name in ("gateway", "worker"):
        path = _flag(services[name]["healthcheck"]["test"], "--path")
        assert await probe(name, {path, "/metrics"}) == {path: 200, "/metrics": 200}


def test_the_worker_reserves_an_nvidia_gpu(services: dict[str, Any]) -> None:
    (device,) = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert device["capabilities"] == ["gpu"]
    (device_id,) = device["device_ids"]
    assert _interpolated(device_id) == "LORAPLEX_WORKER_GPU"
    assert _flag(services["worker"]["command"], "--device") == "cuda"
    for name in ("gateway", "migrate"):
        assert "deploy" not in services[name], f"{name} needs no GPU"


def test_servers_start_after_the_migration_and_redis(services: dict[str, Any]) -> None:
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["migrate"]["restart"] == "no"
    for name in ("gateway", "worker"):
        assert services[name]["depends_on"] == {
            "migrate": {"condition": "service_completed_successfully"},
            "redis": {"condition": "service_healthy"},
        }
    for name in ("postgres", "redis"):
        assert services[name]["healthcheck"]["test"][0] == "CMD"


def test_stop_grace_period_outlasts_the_drain(services: dict[str, Any]) -> None:
    for name in ("gateway", "worker"):
        env = services[name]["environment"]
        drain = float(env["LORAPLEX_DRAIN_TIMEOUT_S"])
        assert _seconds(services[name]["stop_grace_period"]) > drain, name
        assert services[name]["init"] is True  # signals reach loraplex through tini


def test_environment_is_settings_with_secrets_from_the_env_file(
    services: dict[str, Any],
) -> None:
    secret_names = {"LORAPLEX_ADMIN_KEY", "LORAPLEX_SECRET_KEY", "LORAPLEX_WORKER_TOKEN"}
    example = (DEPLOY / "env.example").read_text()
    example_names = set(re.findall(r"^(\w+)=", example, re.MULTILINE))
    for name in LORAPLEX_SERVICES:
        env = services[name]["environment"]
        assert env_problems(env, name) == []
        assert env["LORAPLEX_ENVIRONMENT"] == "production"
        assert env["LORAPLEX_DATA_DIR"] == "/data"
        assert env["REDIS_URL"] == "redis://redis:6379/0"
        assert env["DATABASE_URL"].startswith("postgresql://loraplex:${POSTGRES_PASSWORD:?")
        assert env["DATABASE_URL"].endswith("@postgres:5432/loraplex")
        for secret in secret_names:
            # Required (`:?`) and never written in the file itself.
            assert env[secret].startswith(f"${{{secret}:?"), secret
    used = set(re.findall(r"\$\{(\w+)", COMPOSE.read_text()))
    assert used <= example_names, f"not in env.example: {sorted(used - example_names)}"
    assert (DEPLOY / ".gitignore").read_text().splitlines()[-1] == ".env"


def test_the_adapter_store_is_shared_and_the_spool_is_not(services: dict[str, Any]) -> None:
    gateway = services["gateway"]["volumes"]
    worker = services["worker"]["volumes"]
    assert "data:/data" in gateway and "data:/data" in worker
    assert "gateway-spool:/data/spool" in gateway


def test_bind_mounts_exist_and_match_the_configs(services: dict[str, Any]) -> None:
    mounts: dict[str, str] = {}
    for service in services.values():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                assert (COMPOSE.parent / source).exists(), source
                mounts[target] = source
    prometheus = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    (rules,) = prometheus["rule_files"]
    assert mounts[rules] == "./prometheus/alerts.yaml"
    config_flag = next(
        a for a in services["prometheus"]["command"] if a.startswith("--config.file=")
    )
    assert mounts[config_flag.partition("=")[2]] == "./prometheus/prometheus.yml"
    provider = load_yaml(
        DEPLOY / "grafana" / "provisioning" / "dashboards" / "loraplex.yaml"
    )["providers"][0]
    assert mounts[provider["options"]["path"]] == "./grafana/dashboards"
    assert mounts["/etc/grafana/provisioning/datasources"] == "./grafana/provisioning/datasources"
    (datasource,) = load_yaml(
        DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
    )["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    assert services["prometheus"]["ports"] == ["127.0.0.1:9090:9090"]
    assert services["grafana"]["ports"] == ["127.0.0.1:3000:3000"]


def test_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    declared = set(compose["volumes"])
    used = {
        volume.split(":")[0]
        for service in compose["services"].values()
        for volume in service.get("volumes", [])
        if not volume.startswith(("./", "/"))
    }
    assert used == declared
