"""Every file under deploy/ parses and is one the deploy tests know about."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from tests.deploy.helm_render import render_chart
from tests.deploy.support import CHART, DEPLOY

# Each is checked by a test of this package; a new file needs one too.
KNOWN_FILES = {
    ".gitignore", "Dockerfile", "Dockerfile.dockerignore", "README.md", "compose.yaml",
    "env.example", "healthcheck.py", "plan_to_values.py",
    "grafana/dashboards/loraplex.json",
    "grafana/provisioning/dashboards/loraplex.yaml",
    "grafana/provisioning/datasources/prometheus.yaml",
    "helm/loraplex/Chart.yaml", "helm/loraplex/values.yaml",
    "helm/loraplex/templates/NOTES.txt",
    "helm/loraplex/templates/configmap.yaml",
    "helm/loraplex/templates/gateway-deployment.yaml",
    "helm/loraplex/templates/gateway-hpa.yaml",
    "helm/loraplex/templates/gateway-pdb.yaml",
    "helm/loraplex/templates/gateway-service.yaml",
    "helm/loraplex/templates/inferencepool.yaml",
    "helm/loraplex/templates/migrate-job.yaml",
    "helm/loraplex/templates/pvc.yaml",
    "helm/loraplex/templates/secret.yaml",
    "helm/loraplex/templates/worker-autoscaling.yaml",
    "helm/loraplex/templates/worker-deployments.yaml",
    "helm/prometheus-adapter.values.yaml",
    "helm/values-mig.example.yaml",
    "k8s/loraplex.yaml",
    "prometheus/alerts.test.yaml", "prometheus/alerts.yaml", "prometheus/prometheus.yml",
}


def _files() -> set[str]:
    return {
        str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.name != ".env"
    }


def test_every_file_is_known() -> None:
    assert _files() == KNOWN_FILES


def test_every_yaml_and_json_file_parses() -> None:
    templates = CHART / "templates"
    for name in sorted(_files()):
        path = DEPLOY / name
        if path.suffix == ".json":
            assert isinstance(json.loads(path.read_text()), dict), name
        elif path.suffix in {".yaml", ".yml"}:
            if templates in path.parents:
                continue  # Go templates: rendered below
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
            assert docs and all(isinstance(d, dict) for d in docs), name
    rendered = {f.template for f in render_chart(CHART)}
    assert rendered == {
        str(p.relative_to(CHART)) for p in templates.iterdir() if not p.name.startswith("_")
    }


def test_python_scripts_run() -> None:
    for script in ("healthcheck.py", "plan_to_values.py"):
        result = subprocess.run(
            [sys.executable, str(DEPLOY / script), "--help"],
            capture_output=True, text=True, timeout=30, check=False,
        )
        assert result.returncode == 0 and result.stdout.startswith("usage:"), result.stderr
