"""Workers scale on their engines' queues: per worker group a KEDA ScaledObject or an
autoscaling/v2 HPA on the target Deployment, PromQL and metric names that the service
and prometheus-adapter really provide, a scale-down no faster than a drain, pinned
(MIG-planned) groups left alone, and values that cannot work refused at render time."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.deploy.helm_render import ChartFailure, manifests, merge_values, render_chart
from tests.deploy.support import (
    CHART,
    DEPLOY,
    load_yaml,
    promql_problems,
    promql_selectors,
    series_catalog,
)
from tests.deploy.variants import (
    EXAMPLE_VALUES,
    PROMETHEUS_URL,
    WORKER_AUTOSCALING,
    render,
    variants,
    with_provider,
)

ADAPTER_VALUES = DEPLOY / "helm" / "prometheus-adapter.values.yaml"
README = DEPLOY / "README.md"
DEFAULTS = load_yaml(CHART / "values.yaml")["workerDefaults"]["autoscaling"]
SCALED_GROUPS = {"whole": (1, 4), "whole-b": (2, 8)}  # unpinned: (min, max)
PINNED_GROUPS = {"h200-a": 2}  # pinned to node-a: replicas


def _objects(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _workers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["labels"]["loraplex.io/worker"]: d for d in _objects(docs, "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    }


def _worker_scalers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["labels"]["loraplex.io/worker"]: d
        for d in _objects(docs, "ScaledObject") + _objects(docs, "HorizontalPodAutoscaler")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    }


def _k8s_scrape_labels() -> set[str]:
    """The target labels that deploy/README.md's Kubernetes scrape config sets."""
    text = README.read_text()
    section = text[text.index("### Prometheus on Kubernetes"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.DOTALL)
    assert block is not None
    (job,) = yaml.safe_load(block.group(1))
    return {
        r["target_label"] for r in job["relabel_configs"]
        if "target_label" in r and not r["target_label"].startswith("__")
    }


def _k8s_catalog() -> dict[str, frozenset[str]]:
    extra = _k8s_scrape_labels()
    assert {"namespace", "pod"} <= extra
    return {name: labels | extra for name, labels in series_catalog().items()}


# A Kubernetes quantity (resource.Quantity) in decimal notation: what both providers read.
_DECIMAL = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")


def _target_problems(target: str) -> list[str]:
    # KEDA parses thresholds with strconv.ParseFloat, the HPA as quantities: "900m" is a
    # quantity KEDA refuses, "1e3" a float the HPA reads differently; plain decimals pass.
    return [] if _DECIMAL.fullmatch(target) else [f"{target!r} is not a plain decimal"]


def _pod_name(group: str, template_hash: str = "7d9f8c6b4", suffix: str = "x2x4z") -> str:
    # A Deployment's pods: <deployment>-<pod-template-hash>-<5 characters>.
    return f"loraplex-worker-{group}-{template_hash}-{suffix}"


def _pod_regex(query: str) -> str:
    match = re.search(r'pod=~"([^"]+)"', query)
    assert match is not None, query
    return match.group(1)


# ------------------------------------------------------------------------- defaults


def test_off_by_default_so_the_default_render_is_unchanged() -> None:
    assert DEFAULTS["enabled"] is False
    for name in ("k8s/loraplex.yaml", "values-mig.example.yaml", "toggled", "no-autoscaling"):
        docs = variants()[name]
        assert _worker_scalers(docs) == {}, name
        assert all("replicas" in d["spec"] for d in _workers(docs).values()), name


def test_pinned_groups_keep_their_replicas_even_when_enabled() -> None:
    """The MIG plan pins every group to its node: with autoscaling on nothing scales."""
    values = merge_values(load_yaml(EXAMPLE_VALUES), {"workerDefaults": {"autoscaling": {
        "enabled": True, "keda": {"serverAddress": PROMETHEUS_URL}}}})
    docs = render(values)
    assert _worker_scalers(docs) == {}
    workers = _workers(docs)
    assert len(workers) == len(load_yaml(EXAMPLE_VALUES)["workers"])
    assert all(d["spec"]["replicas"] == 1 for d in workers.values())


# --------------------------------------------------------------------- both providers


@pytest.mark.parametrize("provider", ["keda", "hpa"])
def test_each_unpinned_group_gets_its_own_autoscaler(provider: str) -> None:
    docs = variants()[f"workers-{provider}"]
    scalers = _worker_scalers(docs)
    assert sorted(scalers) == sorted(SCALED_GROUPS)
    kind = "ScaledObject" if provider == "keda" else "HorizontalPodAutoscaler"
    workers = _workers(docs)
    for group, scaler in scalers.items():
        assert scaler["kind"] == kind
        assert scaler["metadata"]["name"] == f"loraplex-worker-{group}"
        target = scaler["spec"]["scaleTargetRef"]
        assert target == {"apiVersion": "apps/v1", "kind": "Deployment",
                          "name": workers[group]["metadata"]["name"]}
        assert "replicas" not in workers[group]["spec"]
        spec = scaler["spec"]
        bounds = ((spec["minReplicaCount"], spec["maxReplicaCount"]) if provider == "keda"
                  else (spec["minReplicas"], spec["maxReplicas"]))
        assert bounds == SCALED_GROUPS[group]
        assert bounds[0] >= 1  # the queue lives in the workers: none, no signal
    for group, replicas in PINNED_GROUPS.items():
        assert workers[group]["spec"]["replicas"] == replicas
        assert workers[group]["spec"]["template"]["spec"]["nodeSelector"]


@pytest.mark.parametrize("provider", ["keda", "hpa"])
def test_scale_down_is_slow_and_no_faster_than_a_drain(provider: str) -> None:
    docs = variants()[f"workers-{provider}"]
    workers = _workers(docs)
    for group, scaler in _worker_scalers(docs).items():
        behavior = (scaler["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
                    if provider == "keda" else scaler["spec"]["behavior"])
        assert behavior == DEFAULTS["behavior"]
        down = behavior["scaleDown"]
        assert down["stabilizationWindowSeconds"] >= 300
        pod_spec = workers[group]["spec"]["template"]["spec"]
        grace = pod_spec["terminationGracePeriodSeconds"]
        for policy in down["policies"]:
            # One worker at a time, and the next only once the last one's drain is over.
            assert policy == {"type": "Pods", "value": 1, "periodSeconds": policy["periodSeconds"]}
            assert policy["periodSeconds"] >= grace
        (container,) = pod_spec["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["LORAPLEX_DRAIN_TIMEOUT_S"] == "120"  # workerDefaults.drainTimeoutSeconds
        assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]
        assert grace == 150 > 10 + 120
        up = behavior["scaleUp"]
        assert all(p["type"] == "Pods" and p["value"] == 1 for p in up["policies"])


# ----------------------------------------------------------------------------- KEDA


def test_keda_triggers_query_the_groups_own_pods() -> None:
    files = render_chart(CHART, namespace="serving", values=with_provider("keda"))
    scalers = _worker_scalers(manifests(files))
    catalog = _k8s_catalog()
    for group, scaled in scalers.items():
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        spec = scaled["spec"]
        assert spec["pollingInterval"] == DEFAULTS["keda"]["pollingInterval"]
        assert spec["cooldownPeriod"] == DEFAULTS["keda"]["cooldownPeriod"]
        triggers = {t["name"]: t for t in spec["triggers"]}
        assert sorted(triggers) == ["kv-cache-usage", "requests-waiting"]
        wanted = {"requests-waiting": ("loraplex_num_requests_waiting", "6"),
                  "kv-cache-usage": ("loraplex_kv_cache_usage_ratio", "0.9")}
        for name, trigger in triggers.items():
            metric, threshold = wanted[name]
            assert trigger["type"] == "prometheus"
            # AverageValue: KEDA's HPA divides the group's sum by its replicas.
            assert trigger["metricType"] == "AverageValue"
            assert trigger["authenticationRef"] == {"name": "prometheus"}
            metadata = trigger["metadata"]
            assert metadata["serverAddress"] == PROMETHEUS_URL
            assert metadata["threshold"] == threshold
            assert _target_problems(threshold) == []
            query = metadata["query"]
            assert promql_problems(query, catalog) == []
            assert [s.metric for s in promql_selectors(query)] == [metric]
            assert query.startswith("sum(") and 'namespace="serving"' in query
            regex = re.compile(_pod_regex(query))  # PromQL anchors =~ at both ends
            assert regex.fullmatch(_pod_name(group))
            assert regex.fullmatch(_pod_name(group, "5c6b9f7d8d", "abcde"))
            for other in (*scalers, *PINNED_GROUPS):
                if other != group:
                    assert not regex.fullmatch(_pod_name(other)), (group, other)
            assert not regex.fullmatch(f"loraplex-gateway-{group}-7d9f8c6b4-x2x4z")


def test_keda_without_a_prometheus_address_is_refused() -> None:
    values = merge_values(WORKER_AUTOSCALING, {"workerDefaults": {"autoscaling": {
        "provider": "keda", "keda": {"serverAddress": ""}}}})
    with pytest.raises(ChartFailure, match="serverAddress"):
        render(values)
    # The HPA provider needs none: prometheus-adapter knows its Prometheus.
    hpa = merge_values(values, {"workerDefaults": {"autoscaling": {"provider": "hpa"}}})
    assert _worker_scalers(render(hpa))


# ------------------------------------------------------------------------------ HPA


def _adapter_rules() -> list[dict[str, Any]]:
    rules = load_yaml(ADAPTER_VALUES)["rules"]["custom"]
    assert rules
    return list(rules)


def _exposed_name(rule: dict[str, Any]) -> str:
    (selector,) = promql_selectors(rule["seriesQuery"])
    name = rule.get("name")
    if not name:
        return selector.metric
    # prometheus-adapter: Go regexp with ${1}-style references.
    replacement = re.sub(r"\$\{(\d+)\}", r"\\g<\1>", name["as"])
    return re.sub(name["matches"], replacement, selector.metric)


def test_adapter_rules_name_series_the_service_exports() -> None:
    catalog = _k8s_catalog()
    for rule in _adapter_rules():
        assert promql_problems(rule["seriesQuery"], catalog) == []
        (selector,) = promql_selectors(rule["seriesQuery"])
        assert {"namespace", "pod"} <= set(selector.labels)
        assert rule["resources"] == {"overrides": {"namespace": {"resource": "namespace"},
                                                   "pod": {"resource": "pod"}}}
        query = (rule["metricsQuery"].replace("<<.Series>>", selector.metric)
                 .replace("<<.LabelMatchers>>", 'namespace="serving",pod=~"loraplex-.*"')
                 .replace("<<.GroupBy>>", "pod"))
        assert "<<" not in query
        assert promql_problems(query, catalog) == []


def test_hpa_metrics_are_the_names_the_adapter_serves() -> None:
    served = {_exposed_name(rule) for rule in _adapter_rules()}
    chart = load_yaml(CHART / "values.yaml")
    assert chart["gateway"]["autoscaling"]["requestsPerSecondMetric"] in served
    assert set(DEFAULTS["hpa"].values()) <= served
    for group, hpa in _worker_scalers(variants()["workers-hpa"]).items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        metrics = {m["pods"]["metric"]["name"]: m for m in hpa["spec"]["metrics"]}
        assert sorted(metrics) == sorted(DEFAULTS["hpa"].values()), group
        assert all(m["type"] == "Pods" for m in metrics.values())
        assert metrics["loraplex_num_requests_waiting"]["pods"]["target"] == {
            "type": "AverageValue", "averageValue": "6"}
        assert metrics["loraplex_kv_cache_usage_ratio"]["pods"]["target"] == {
            "type": "AverageValue", "averageValue": "0.9"}


def test_default_targets_are_plain_decimals() -> None:
    for key in ("targetRequestsWaiting", "targetKVCacheUsage"):
        value = DEFAULTS[key]
        assert isinstance(value, str) and _target_problems(value or "0.9") == [], key
    assert _target_problems("900m") and _target_problems("1e3") and _target_problems("")


def test_notes_name_the_autoscalers() -> None:
    for provider, word in (("keda", "scaledobjects"), ("hpa", "hpa")):
        (notes,) = [f.text for f in render_chart(CHART, values=with_provider(provider))
                    if f.template == "templates/NOTES.txt"]
        assert f"kubectl get {word} -l app.kubernetes.io/instance=loraplex," in notes
    (plain,) = [f.text for f in render_chart(CHART) if f.template == "templates/NOTES.txt"]
    assert "scale on their queues" not in plain


def test_one_signal_is_enough() -> None:
    values = with_provider("hpa", merge_values(WORKER_AUTOSCALING, {"workerDefaults": {
        "autoscaling": {"targetKVCacheUsage": ""}}}))
    for hpa in _worker_scalers(render(values)).values():
        assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == [
            "loraplex_num_requests_waiting"]
    values = with_provider("keda", merge_values(WORKER_AUTOSCALING, {"workerDefaults": {
        "autoscaling": {"targetRequestsWaiting": ""}}}))
    for scaled in _worker_scalers(render(values)).values():
        assert [t["name"] for t in scaled["spec"]["triggers"]] == ["kv-cache-usage"]


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"workerDefaults": {"autoscaling": {"provider": "prometheus"}}}, "keda or hpa"),
        ({"workerDefaults": {"autoscaling": {"targetRequestsWaiting": "",
                                             "targetKVCacheUsage": ""}}}, "or both"),
        ({"workers": [{"name": "h200-a", "migProfile": "3g.71gb", "node": "node-a",
                       "maxReplicas": 3}]}, "workers h200-a: pinned to node node-a"),
    ],
)
def test_values_that_cannot_work_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ChartFailure, match=message):
        render(merge_values(WORKER_AUTOSCALING, change))


# ---------------------------------------------------------------------- the docs


def _keys(values: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in values.items():
        keys.append(prefix + key)
        if isinstance(value, dict) and key != "behavior":
            keys.extend(_keys(value, f"{prefix}{key}."))
    return keys


def test_the_readme_documents_every_autoscaling_value() -> None:
    text = README.read_text()
    section = text[text.index("### Scaling workers"):]
    section = section[:section.index("\n### ", 1)]
    for key in _keys(DEFAULTS):
        assert key.rsplit(".", 1)[-1] in section, key
    for word in ("keda", "hpa", "prometheus-adapter.values.yaml", "loraplex_num_requests_waiting",
                 "loraplex_kv_cache_usage_ratio", "preStop", "terminationGracePeriodSeconds",
                 "drainTimeoutSeconds", "minReplicas", "maxReplicas", "node"):
        assert word in section, word
