"""Every object of every chart variant (and deploy/k8s/loraplex.yaml) against the
upstream schemas: Kubernetes' for the oldest release the chart admits and the newest
kubernetes-validate ships, KEDA's CRD for the ScaledObject. And the validator refuses
objects that are broken in the ways a chart gets them wrong."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest

from tests.deploy.k8s_schemas import KUBE_VERSIONS, keda_version, schema_problems
from tests.deploy.variants import variants


def _first(variant: str, kind: str, component: str) -> dict[str, Any]:
    return next(
        d for d in variants()[variant]
        if d["kind"] == kind and d["metadata"]["labels"].get("app.kubernetes.io/component")
        == component
    )


@pytest.mark.parametrize("variant", sorted(variants()))
def test_every_object_matches_its_upstream_schema(variant: str) -> None:
    problems = [str(p) for doc in variants()[variant] for p in schema_problems(doc)]
    assert problems == []


def test_the_variants_hold_every_kind_the_chart_makes() -> None:
    kinds = {(d["apiVersion"], d["kind"]) for docs in variants().values() for d in docs}
    assert kinds == {
        ("v1", "ConfigMap"), ("v1", "Secret"), ("v1", "Service"),
        ("v1", "PersistentVolumeClaim"), ("apps/v1", "Deployment"), ("batch/v1", "Job"),
        ("policy/v1", "PodDisruptionBudget"), ("autoscaling/v2", "HorizontalPodAutoscaler"),
        ("keda.sh/v1alpha1", "ScaledObject"),
        ("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "Role"),
        ("rbac.authorization.k8s.io/v1", "RoleBinding"),
        ("inference.networking.k8s.io/v1", "InferencePool"),
        ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective"),
        ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    }


def test_the_schemas_are_the_releases_the_chart_supports() -> None:
    oldest, newest = KUBE_VERSIONS
    assert oldest == "1.25"  # Chart.yaml: kubeVersion >=1.25.0-0
    assert tuple(map(int, newest.split("."))) >= (1, 37)
    assert newest == ".".join(kubernetes_validate.latest_version().split(".")[:2])
    assert tuple(map(int, keda_version().split("."))) >= (2, 16)


# ----------------------------------------------------------------- broken on purpose


def _pods_metric_v2beta1(hpa: dict[str, Any]) -> None:
    # autoscaling/v2beta1's shape, which v2 dropped.
    hpa["spec"]["metrics"].append({"type": "Pods", "pods": {
        "metricName": "loraplex_num_requests_waiting", "targetAverageValue": "4"}})


def _pods_metric_unknown_field(hpa: dict[str, Any]) -> None:
    hpa["spec"]["metrics"].append({"type": "Pods", "pods": {
        "metric": {"name": "loraplex_num_requests_waiting"},
        "target": {"type": "AverageValue", "averageValue": "4", "averageUtilisation": 50}}})


def _policy_value_as_string(hpa: dict[str, Any]) -> None:
    hpa["spec"]["behavior"]["scaleDown"]["policies"][0]["value"] = "1"


def _replicas_as_string(hpa: dict[str, Any]) -> None:
    hpa["spec"]["maxReplicas"] = "10"


def _grace_period_typo(deployment: dict[str, Any]) -> None:
    spec = deployment["spec"]["template"]["spec"]
    spec["terminationGracePeriod"] = spec.pop("terminationGracePeriodSeconds")


def _sleep_action(deployment: dict[str, Any]) -> None:
    # The preStop `sleep` action exists from Kubernetes 1.29 on: 1.25 refuses it.
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    container["lifecycle"]["preStop"] = {"sleep": {"seconds": 5}}


def _service_port_as_dict(service: dict[str, Any]) -> None:
    service["spec"]["ports"][0]["port"] = {"number": 80}


def _pdb_without_selector_shape(pdb: dict[str, Any]) -> None:
    pdb["spec"]["selector"] = {"app.kubernetes.io/component": "gateway"}  # no matchLabels


def _threshold_as_number(scaled: dict[str, Any]) -> None:
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 4  # KEDA wants strings


def _hpa_field_names_in_keda(scaled: dict[str, Any]) -> None:
    scaled["spec"]["minReplicas"] = scaled["spec"].pop("minReplicaCount")


def _behaviour_typo(scaled: dict[str, Any]) -> None:
    config = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]
    config["behaviour"] = config.pop("behavior")


def _trigger_without_metadata(scaled: dict[str, Any]) -> None:
    del scaled["spec"]["triggers"][0]["metadata"]


def _null_cooldown(scaled: dict[str, Any]) -> None:
    scaled["spec"]["cooldownPeriod"] = None  # what an empty value would render


BROKEN: dict[str, tuple[str, str, Callable[[dict[str, Any]], None], str]] = {
    # name: (kind, component of the object, how to break it, words of the refusal)
    "hpa-v2beta1-pods-metric": ("HorizontalPodAutoscaler", "worker", _pods_metric_v2beta1,
                                "'metric' is a required property"),
    "hpa-unknown-target-field": ("HorizontalPodAutoscaler", "worker",
                                 _pods_metric_unknown_field, "'averageUtilisation' was unexpected"),
    "hpa-policy-value-string": ("HorizontalPodAutoscaler", "gateway", _policy_value_as_string,
                                "is not of type 'integer'"),
    "hpa-replicas-string": ("HorizontalPodAutoscaler", "gateway", _replicas_as_string,
                            "is not of type 'integer'"),
    "deployment-typo": ("Deployment", "worker", _grace_period_typo,
                        "'terminationGracePeriod' was unexpected"),
    "deployment-sleep-action": ("Deployment", "worker", _sleep_action,
                                "Kubernetes 1.25: spec.template.spec.containers.0.lifecycle"),
    "service-port-object": ("Service", "gateway", _service_port_as_dict,
                            "is not of type 'integer'"),
    "pdb-selector-shape": ("PodDisruptionBudget", "gateway", _pdb_without_selector_shape,
                           "was unexpected"),
    "keda-threshold-number": ("ScaledObject", "worker", _threshold_as_number,
                              "4 is not of type 'string'"),
    "keda-hpa-field-names": ("ScaledObject", "worker", _hpa_field_names_in_keda,
                             "'minReplicas' was unexpected"),
    "keda-behaviour-typo": ("ScaledObject", "worker", _behaviour_typo,
                            "'behaviour' was unexpected"),
    "keda-trigger-metadata": ("ScaledObject", "worker", _trigger_without_metadata,
                              "'metadata' is a required property"),
    "keda-null": ("ScaledObject", "worker", _null_cooldown, "None is not of type 'integer'"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_the_validator_refuses_broken_objects(case: str) -> None:
    kind, component, breaker, refusal = BROKEN[case]
    variant = "workers-keda" if kind == "ScaledObject" else "workers-hpa"
    doc = copy.deepcopy(_first(variant, kind, component))
    assert schema_problems(doc) == []
    breaker(doc)
    problems = [str(p) for p in schema_problems(doc)]
    assert problems, f"{case}: the broken object passed"
    assert any(refusal in p for p in problems), problems


def test_only_the_old_release_refuses_a_newer_field() -> None:
    doc = copy.deepcopy(_first("workers-hpa", "Deployment", "worker"))
    _sleep_action(doc)
    refused_by = {p.schema for p in schema_problems(doc)}
    assert refused_by == {f"Kubernetes {KUBE_VERSIONS[0]}"}


def test_kinds_without_a_schema_do_not_pass_unchecked() -> None:
    doc = copy.deepcopy(_first("workers-hpa", "HorizontalPodAutoscaler", "worker"))
    doc["apiVersion"] = "autoscaling/v2beta3"
    assert {p.path for p in schema_problems(doc)} == {"apiVersion"}
    scaled = copy.deepcopy(_first("workers-keda", "ScaledObject", "worker"))
    scaled["kind"] = "ScaledThing"
    assert schema_problems(scaled)


def test_our_lookup_agrees_with_kubernetes_validate() -> None:
    """The cached validators read the same files kubernetes_validate.validate() does."""
    good = _first("workers-hpa", "HorizontalPodAutoscaler", "worker")
    bad = copy.deepcopy(good)
    _pods_metric_v2beta1(bad)
    for kube in KUBE_VERSIONS:
        assert kubernetes_validate.validate(good, kube, strict=True)
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, kube, strict=True)
