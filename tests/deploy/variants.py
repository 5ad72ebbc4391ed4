"""The chart rendered with the values the deploy tests check: the defaults (as
deploy/k8s/loraplex.yaml), the MIG example, every switch turned, worker autoscaling
with each provider, and the workers as an InferencePool of the inference gateway."""

from __future__ import annotations

from functools import cache
from typing import Any

from tests.deploy.helm_render import manifests, merge_values, render_chart
from tests.deploy.support import CHART, DEPLOY, K8S_MANIFESTS, load_yaml, load_yaml_all

EXAMPLE_VALUES = DEPLOY / "helm" / "values-mig.example.yaml"

# Every switch of the chart turned away from its default, to render each branch.
TOGGLED_VALUES: dict[str, Any] = {
    "image": {"repository": "registry.example.com/ml/loraplex"},
    "imagePullSecrets": [{"name": "registry"}],
    "secrets": {
        "create": True, "databaseUrl": "postgresql://u:p@db:5432/loraplex",
        "redisUrl": "redis://redis:6379/0", "adminKey": "a" * 32, "secretKey": "s" * 48,
        "workerToken": "w" * 32,
    },
    "persistence": {"existingClaim": "adapters", "storageClass": "nfs"},
    "gateway": {
        "nodeSelector": {"pool": "cpu"},
        "tolerations": [{"key": "cpu-only", "operator": "Exists", "effect": "NoSchedule"}],
        "autoscaling": {"requestsPerSecond": "50"},
    },
    "workers": [
        {"name": "h200-a", "migProfile": "3g.71gb", "node": "node-a", "replicas": 2,
         "tenants": ["acme"], "isolation": "dedicated",
         "dedicatedTenants": ["ten_0123456789abcdef"],
         "engineArgs": ["--max-loras", "4", "--kv-cache-tokens", "2879008"]},
        {"name": "whole", "engineArgs": ["--dtype", "float16"]},
    ],
}
NO_AUTOSCALING: dict[str, Any] = {
    "gateway": {"autoscaling": {"enabled": False}, "replicas": 3},
    "persistence": {"enabled": False},
}

PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
# Worker autoscaling on both signals, a pinned group (keeps its replicas) and two
# unpinned groups whose names share a prefix (each query must see only its own pods).
WORKER_AUTOSCALING: dict[str, Any] = merge_values(TOGGLED_VALUES, {
    "workerDefaults": {
        "autoscaling": {
            "enabled": True, "targetRequestsWaiting": "6", "targetKVCacheUsage": "0.9",
            "keda": {"serverAddress": PROMETHEUS_URL, "authenticationRef": "prometheus"},
        },
        "preStopSleepSeconds": 10,
        "drainTimeoutSeconds": 120,
        "terminationGracePeriodSeconds": 150,
    },
    "workers": [
        *TOGGLED_VALUES["workers"],
        {"name": "whole-b", "migProfile": "1g.18gb", "minReplicas": 2, "maxReplicas": 8},
    ],
})


# The Kubernetes inference gateway as the router: workers run `serve` in an
# InferencePool, adapters in an object store, worker autoscaling on (KEDA).
INFERENCE_POOL: dict[str, Any] = merge_values({
    "workerDefaults": {"autoscaling": {
        "enabled": True, "keda": {"serverAddress": PROMETHEUS_URL}}},
}, {
    "inferencePool": {
        "enabled": True,
        "objectives": [{"name": "support-bot", "priority": 10},
                       {"name": "nightly-summaries", "priority": -5}],
        "gatewayName": "inference-gateway",
    },
    "persistence": {"enabled": False},
    "env": {"LORAPLEX_ADAPTER_STORE": "s3://adapters/loraplex"},
    "workers": [{"name": "h100-a"}, {"name": "h100-b", "migProfile": "3g.40gb",
                                      "engineArgs": ["--max-loras", "16"]}],
})


def with_provider(provider: str, values: dict[str, Any] | None = None) -> dict[str, Any]:
    return merge_values(
        values or WORKER_AUTOSCALING, {"workerDefaults": {"autoscaling": {"provider": provider}}}
    )


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return manifests(render_chart(CHART, values=values))


@cache
def _variants() -> dict[str, list[dict[str, Any]]]:
    return {
        "k8s/loraplex.yaml": load_yaml_all(K8S_MANIFESTS),
        "values-mig.example.yaml": render(load_yaml(EXAMPLE_VALUES)),
        "toggled": render(TOGGLED_VALUES),
        "no-autoscaling": render(NO_AUTOSCALING),
        "workers-keda": render(with_provider("keda")),
        "workers-hpa": render(with_provider("hpa")),
        "inference-pool": render(INFERENCE_POOL),
    }


def variants() -> dict[str, list[dict[str, Any]]]:
    """Variant name -> its objects (rendered once; callers must not change them)."""
    return _variants()
