"""The chart's InferencePool mode (the Kubernetes inference gateway routes to `loraplex
serve` pods): the pool, its endpoint picker and what the picker is told to read, the
objectives, the route, and the render refusing what a pool cannot serve. The objects'
schemas are checked with every variant (test_schemas.py); here, that they fit together
and that the schemas refuse what a chart gets wrong."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.helm_render import ChartFailure, merge_values, render_chart
from tests.deploy.k8s_schemas import schema_problems
from tests.deploy.support import CHART, WORKER_PORT, metric_defs
from tests.deploy.variants import INFERENCE_POOL, render, variants

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def _docs() -> list[dict[str, Any]]:
    return variants()["inference-pool"]


def _one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _flags(args: list[str]) -> dict[str, str]:
    assert len(args) % 2 == 0, args
    return dict(zip(args[::2], args[1::2], strict=True))


def _labels_of_component(component: str) -> list[dict[str, str]]:
    return [
        d["spec"]["template"]["metadata"]["labels"] for d in _docs()
        if d["kind"] == "Deployment"
        and d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        == component
    ]


def test_the_pool_selects_the_serve_pods_and_names_its_picker() -> None:
    pool = _one("InferencePool", "loraplex")
    workers = _labels_of_component("worker")
    assert len(workers) == len(INFERENCE_POOL["workers"]) == 2
    selector = pool["spec"]["selector"]["matchLabels"]
    assert all(selector.items() <= labels.items() for labels in workers)
    assert not any(selector.items() <= labels.items()
                   for labels in _labels_of_component("endpoint-picker"))
    assert pool["spec"]["targetPorts"] == [{"number": WORKER_PORT}]
    ref = pool["spec"]["endpointPickerRef"]
    service = _one("Service", ref["name"])
    (port,) = service["spec"]["ports"]
    assert port["port"] == ref["port"]["number"] and port["appProtocol"] == "http2"
    assert ref["failureMode"] == "FailClose"
    (picker,) = [d for d in _docs() if d["kind"] == "Deployment"
                 and d["metadata"]["name"] == "loraplex-epp"]
    (container,) = picker["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[port["targetPort"]] == ref["port"]["number"]
    assert service["spec"]["selector"].items() <= \
        picker["spec"]["template"]["metadata"]["labels"].items()


def test_the_picker_watches_this_pool_with_the_rights_it_needs() -> None:
    picker = _one("Deployment", "loraplex-epp")
    spec = picker["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    flags = _flags(container["args"])
    assert flags["--pool-name"] == "loraplex"
    assert flags["--pool-namespace"] == "default"  # the release's namespace
    health = int(flags["--grpc-health-port"])
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == health
    assert container["image"] == (
        "registry.k8s.io/gateway-api-inference-extension/epp:v1.1.0"
    )
    # It reads the API server: its token is mounted, under its own account.
    assert spec.get("automountServiceAccountToken", True) is True
    account = spec["serviceAccountName"]
    binding = _one("RoleBinding", account)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                    "namespace": "default"}]
    role = _one(binding["roleRef"]["kind"], binding["roleRef"]["name"])
    granted = {(group, resource): set(rule["verbs"])
               for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"]}
    for needed in (("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
                   ("inference.networking.x-k8s.io", "inferenceobjectives")):
        assert granted[needed] >= {"get", "list", "watch"}, needed
    assert all(verbs <= {"get", "list", "watch"} for verbs in granted.values())
    assert spec["securityContext"]["runAsNonRoot"] is True
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security["readOnlyRootFilesystem"] is True


async def test_the_picker_reads_gauges_a_serve_pod_exports() -> None:
    """The metric flags name series that `loraplex serve`'s /metrics has, as gauges; the
    LoRA one (exported by an engine with an adapter cache, which the FakeEngine has not:
    tests/app/test_gateway_protocol_http.py reads it live) is declared as a gauge with
    the labels the picker parses."""
    from tests.utils.fake_engine import asgi_client, make_app

    (container,) = _one("Deployment", "loraplex-epp")["spec"]["template"]["spec"]["containers"]
    flags = _flags(container["args"])
    queue_and_kv = {flag: flags[flag] for flag in (
        "--total-queued-requests-metric", "--total-running-requests-metric",
        "--kv-cache-usage-percentage-metric")}
    app, _ = make_app()
    async with asgi_client(app) as client:
        text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for flag, name in queue_and_kv.items():
        assert name in families, f"{flag} {name}: not on /metrics"
        assert families[name].type == "gauge", flag
    (lora,) = [d for d in metric_defs() if d.name == flags["--lora-info-metric"]]
    assert lora.kind == "gauge"
    assert lora.labels == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}


def test_one_objective_per_published_adapter() -> None:
    objectives = [d for d in _docs() if d["kind"] == "InferenceObjective"]
    wanted = INFERENCE_POOL["inferencePool"]["objectives"]
    assert [(o["metadata"]["name"], o["spec"]["priority"]) for o in objectives] == [
        (w["name"], w["priority"]) for w in wanted]
    for objective in objectives:
        assert objective["spec"]["poolRef"] == {
            "group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "loraplex"}


async def test_the_route_sends_generation_to_the_pool_and_the_rest_to_serve() -> None:
    from tests.utils.fake_engine import make_app

    route = _one("HTTPRoute", "loraplex")
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway"}]
    pooled, rest = route["spec"]["rules"]
    assert [m["path"] for m in pooled["matches"]] == [
        {"type": "Exact", "value": path} for path in GENERATION_PATHS]
    assert pooled["backendRefs"] == [{"group": "inference.networking.k8s.io",
                                      "kind": "InferencePool", "name": "loraplex"}]
    assert rest["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    (backend,) = rest["backendRefs"]
    service = _one("Service", backend["name"])
    assert [p["port"] for p in service["spec"]["ports"]] == [backend["port"]]
    # The paths are the app's generation routes.
    app, _ = make_app()
    paths = app.openapi()["paths"]
    assert all("post" in paths[path] for path in GENERATION_PATHS)


def test_without_a_gateway_name_no_route_is_made() -> None:
    values = merge_values(INFERENCE_POOL, {"inferencePool": {"gatewayName": ""}})
    kinds = {d["kind"] for d in render(values)}
    assert "InferencePool" in kinds and "HTTPRoute" not in kinds


def test_dedicated_tenants_cannot_be_served_in_a_pool() -> None:
    values = merge_values(INFERENCE_POOL, {"workers": [
        {"name": "acme", "dedicatedTenants": ["ten_0123456789abcdef"]}]})
    with pytest.raises(ChartFailure, match=r"workers\[acme\]: dedicatedTenants cannot be "
                                           r"served in an InferencePool"):
        render_chart(CHART, values=values)


def test_the_notes_say_where_the_api_is() -> None:
    (notes,) = [f for f in render_chart(CHART, values=INFERENCE_POOL)
                if f.template == "templates/NOTES.txt"]
    assert "kubectl port-forward svc/loraplex-serve 8000:80" in notes.text
    assert "HTTPRoute loraplex" in notes.text
    assert "loraplex-gateway" not in notes.text


# ----------------------------------------------------------------- broken on purpose


def _no_ports(pool: dict[str, Any]) -> None:
    pool["spec"]["targetPorts"] = []


def _nine_ports(pool: dict[str, Any]) -> None:
    pool["spec"]["targetPorts"] = [{"number": 8100 + i} for i in range(9)]


def _same_port_twice(pool: dict[str, Any]) -> None:
    pool["spec"]["targetPorts"] = [{"number": 8100}, {"number": 8100}]


def _failure_mode_typo(pool: dict[str, Any]) -> None:
    pool["spec"]["endpointPickerRef"]["failureMode"] = "FailClosed"


def _picker_without_port(pool: dict[str, Any]) -> None:
    del pool["spec"]["endpointPickerRef"]["port"]


def _v1alpha2_field(pool: dict[str, Any]) -> None:
    # v1alpha2's shape, which v1 renamed.
    pool["spec"]["targetPortNumber"] = pool["spec"].pop("targetPorts")[0]["number"]


def _selector_expression(pool: dict[str, Any]) -> None:
    pool["spec"]["selector"]["matchExpressions"] = [{"key": "a", "operator": "Exists"}]


def _port_as_string(pool: dict[str, Any]) -> None:
    pool["spec"]["targetPorts"][0]["number"] = "8100"


def _objective_without_pool(objective: dict[str, Any]) -> None:
    del objective["spec"]["poolRef"]


def _objective_criticality(objective: dict[str, Any]) -> None:
    # InferenceModel's field, gone with it.
    objective["spec"]["criticality"] = "Critical"


def _route_path_without_slash(route: dict[str, Any]) -> None:
    route["spec"]["rules"][0]["matches"][0]["path"]["value"] = "v1/completions"


def _route_service_without_port(route: dict[str, Any]) -> None:
    del route["spec"]["rules"][1]["backendRefs"][0]["port"]


@pytest.mark.parametrize(("kind", "name", "breaks"), [
    ("InferencePool", "loraplex", _no_ports),
    ("InferencePool", "loraplex", _nine_ports),
    ("InferencePool", "loraplex", _same_port_twice),
    ("InferencePool", "loraplex", _failure_mode_typo),
    ("InferencePool", "loraplex", _picker_without_port),
    ("InferencePool", "loraplex", _v1alpha2_field),
    ("InferencePool", "loraplex", _selector_expression),
    ("InferencePool", "loraplex", _port_as_string),
    ("InferenceObjective", "support-bot", _objective_without_pool),
    ("InferenceObjective", "support-bot", _objective_criticality),
    ("HTTPRoute", "loraplex", _route_path_without_slash),
    ("HTTPRoute", "loraplex", _route_service_without_port),
])
def test_the_schemas_refuse_what_a_chart_gets_wrong(
    kind: str, name: str, breaks: Callable[[dict[str, Any]], None]
) -> None:
    doc = copy.deepcopy(_one(kind, name))
    assert schema_problems(doc) == []
    breaks(doc)
    assert schema_problems(doc), f"{breaks.__name__} passed"
