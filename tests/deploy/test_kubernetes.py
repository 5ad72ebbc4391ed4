"""The Helm chart and deploy/k8s/loraplex.yaml (what it renders with default values):
the same objects, commands the CLI accepts, consistent ports, probes on routes that
answer, GPU and MIG requests as `loraplex plan` prints them, and a drain that fits in
the grace period."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from tests.deploy.helm_render import ChartFailure, manifests, merge_values, render_chart
from tests.deploy.support import (
    CHART,
    K8S_MANIFESTS,
    WORKER_PORT,
    cli_problems,
    env_problems,
    gpu_resource_problem,
    load_deploy_script,
    load_yaml,
    load_yaml_all,
    probe,
    project_image,
    pyproject,
)
from tests.deploy.variants import variants


def _render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return manifests(render_chart(CHART, values=values))


def _key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


VARIANTS = variants()


@pytest.fixture(params=sorted(VARIANTS))
def docs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return VARIANTS[request.param]


def _objects(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if _key(d) == (kind, name)]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


# The inference gateway's endpoint picker: its image and its ways are the extension's
# (tests/deploy/test_inference_pool.py checks it); every other pod runs loraplex.
PICKER = "endpoint-picker"


def _component(doc: dict[str, Any]) -> str:
    return str(doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"])


def _pod_specs(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The pods that run loraplex."""
    return [
        (d["metadata"]["name"], d["spec"]["template"]["spec"])
        for d in docs if d["kind"] in {"Deployment", "StatefulSet", "Job"}
        and _component(d) != PICKER
    ]


def _deployments(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Deployments that run loraplex."""
    return [d for d in docs if d["kind"] == "Deployment" and _component(d) != PICKER]


def _in_pool(docs: list[dict[str, Any]]) -> bool:
    """The workers run `serve` in an InferencePool (no gateway Deployment)."""
    return bool(_objects(docs, "InferencePool"))


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _named_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert port in ports, f"port {port!r} is not a port of container {container['name']}"
    return int(ports[port])


def _drain_timeout_s(docs: list[dict[str, Any]]) -> float:
    (config,) = _objects(docs, "ConfigMap")
    return float(config["data"]["LORAPLEX_DRAIN_TIMEOUT_S"])


# ------------------------------------------------------------------ chart vs manifests


def test_manifests_are_what_the_chart_renders_with_default_values() -> None:
    rendered = {_key(d): d for d in _render()}
    plain = {_key(d): d for d in load_yaml_all(K8S_MANIFESTS)}
    assert sorted(plain) == sorted(rendered)
    for key, doc in rendered.items():
        assert plain[key] == doc, f"{key[0]}/{key[1]} differs: regenerate deploy/k8s/loraplex.yaml"
    assert sorted(rendered) == [
        ("ConfigMap", "loraplex-env"),
        ("Deployment", "loraplex-gateway"),
        ("Deployment", "loraplex-worker-gpu0"),
        ("HorizontalPodAutoscaler", "loraplex-gateway"),
        ("Job", "loraplex-migrate"),
        ("PersistentVolumeClaim", "loraplex-data"),
        ("PodDisruptionBudget", "loraplex-gateway"),
        ("Service", "loraplex-gateway"),
    ]


def test_chart_version_and_image_follow_the_project_version() -> None:
    chart = load_yaml(CHART / "Chart.yaml")
    values = load_yaml(CHART / "values.yaml")
    version = pyproject()["project"]["version"]
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == version
    assert f"{values['image']['repository']}:{values['image']['tag']}" == project_image()


def test_notes_render() -> None:
    (notes,) = [f for f in render_chart(CHART) if f.template == "templates/NOTES.txt"]
    assert "kubectl port-forward svc/loraplex-gateway 8000:80" in notes.text


def test_the_renderer_refuses_what_it_does_not_know(tmp_path: Path) -> None:
    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: c\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("big: 2879008\nnested: {a: 1}\n")
    template = chart / "templates" / "x.yaml"
    template.write_text("a: {{ .Values.big }}\nb: {{ .Values.big | int }}\n")
    # Like Helm: an int in values is a float64 and prints in exponent form without `int`.
    assert manifests(render_chart(chart)) == [{"a": 2.879008e06, "b": 2879008}]
    for bad in ("{{ .Values.nested.typo }}", "{{ include \"x\" . }}", "{{ if .Values.big }}",
                "{{ .Values.big | sha256sum }}", "{{ .Values.nested.a.b }}",
                "{{ eq .Values.big \"2879008\" }}", "{{ eq .Values.nested .Values.nested }}",
                "{{ (.Values.nested).a }}", "{{ not (.Values.big }}", "{{ and .Values.big }}"):
        template.write_text(f"a: {bad}\n")
        with pytest.raises(ValueError):
            render_chart(chart)


@pytest.mark.parametrize(
    ("template", "rendered"),
    [
        # Go's and / or give the deciding argument, and stop evaluating there.
        ('{{ and .Values.big "" "x" }}', ""),
        ('{{ and .Values.big "x" }}', "x"),
        ('{{ or "" .Values.big }}', "2.879008e+06"),  # a float64, as Helm prints it
        ("{{ or .Values.big .Values.missing.field | int }}", "2879008"),
        ("{{ if and .Values.missing .Values.missing.field }}yes{{ else }}no{{ end }}", "no"),
        ('{{ if eq .Values.word "keda" }}yes{{ else }}no{{ end }}', "yes"),
        ('{{ if ne .Values.word "keda" }}yes{{ else }}no{{ end }}', "no"),
        ("{{ not (and .Values.word (not .Values.big)) }}", "true"),
        ("{{ .Values.big | int | eq 2879008 }}", "true"),
        # fmt.Sprint: spaces only between two operands that are not strings.
        ('{{ print "a" 1 2 "b" .Values.word }}', "a1 2bkeda"),
        ('{{ (print "x" "y") | quote }}', '"xy"'),
    ],
)
def test_the_renderer_follows_go_templates(tmp_path: Path, template: str, rendered: str) -> None:
    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: c\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("big: 2879008\nword: keda\n")
    (chart / "templates" / "x.txt").write_text(template)
    (text,) = [f.text for f in render_chart(chart)]
    assert text == rendered


def test_fail_stops_the_render_with_its_message(tmp_path: Path) -> None:
    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: c\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("name: gpu0\n")
    (chart / "templates" / "x.yaml").write_text(
        '{{ if .Values.name }}{{ fail (print "workers " .Values.name ": no") }}{{ end }}\n'
    )
    with pytest.raises(ChartFailure, match=r"^workers gpu0: no$"):
        render_chart(chart)


# ----------------------------------------------------------------------- every variant


def test_every_object_is_named_and_labelled(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc)
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "loraplex"
        assert labels["app.kubernetes.io/instance"] == "loraplex"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
        assert len(doc["metadata"]["name"]) <= 63


def test_containers_run_loraplex_commands_the_cli_accepts(docs: list[dict[str, Any]]) -> None:
    invocations = []
    for name, spec in _pod_specs(docs):
        for container in spec["containers"]:
            assert "command" not in container, f"{name}: the image's ENTRYPOINT is loraplex"
            args = container["args"]
            assert all(isinstance(a, str) for a in args), f"{name}: args must be strings"
            # Kubernetes expands $(VAR) from the container's own env.
            env = {e["name"] for e in container.get("env", [])}
            for var in re.findall(r"\$\((\w+)\)", " ".join(args)):
                assert var in env, f"{name}: $({var}) is not in the container's env"
            invocations.append([re.sub(r"\$\((\w+)\)", "10.0.0.1", a) for a in args])
    commands = {tuple(i[:1]) for i in invocations}
    if _in_pool(docs):
        assert commands == {("serve",), ("db",)}
    else:
        assert commands >= {("gateway",), ("worker",), ("db",)}
        assert ("serve",) not in commands
    assert cli_problems(invocations) == []


def test_images_are_the_project_image(docs: list[dict[str, Any]]) -> None:
    for name, spec in _pod_specs(docs):
        for container in spec["containers"]:
            repository, _, tag = container["image"].rpartition(":")
            assert repository.rsplit("/", 1)[-1] == "loraplex", name
            assert f"loraplex:{tag}" == project_image(), name


def test_ports_probes_and_service_agree(docs: list[dict[str, Any]]) -> None:
    for deployment in _deployments(docs):
        spec = deployment["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        port = int(_flag(container["args"], "--port"))
        assert _named_port(container, "http") == port
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(port)
        assert annotations["prometheus.io/path"] == "/metrics"
        for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = container[probe_name]["httpGet"]
            assert _named_port(container, get["port"]) == port, probe_name
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert container["startupProbe"]["httpGet"]["path"] == "/health"
        if _component(deployment) == "worker":
            assert port == WORKER_PORT
            if container["args"][0] == "serve":  # in the pool: reached through the picker
                assert "--advertise-url" not in container["args"]
            else:
                assert _flag(container["args"], "--advertise-url") == f"http://$(POD_IP):{port}"
    if _in_pool(docs):
        (pool,) = _objects(docs, "InferencePool")
        assert pool["spec"]["targetPorts"] == [{"number": WORKER_PORT}]
        gateway = next(d for d in _deployments(docs) if _component(d) == "worker")
        service = _one(docs, "Service", "loraplex-serve")
    else:
        gateway = _one(docs, "Deployment", "loraplex-gateway")
        service = _one(docs, "Service", "loraplex-gateway")
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    (service_port,) = service["spec"]["ports"]
    assert _named_port(container, service_port["targetPort"]) == int(
        _flag(container["args"], "--port")
    )


async def test_probe_paths_answer_on_the_apps_they_probe(docs: list[dict[str, Any]]) -> None:
    paths: dict[str, set[str]] = (
        {"serve": set()} if _in_pool(docs) else {"gateway": set(), "worker": set()}
    )
    for deployment in _deployments(docs):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        kind = container["args"][0]
        for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
            paths[kind].add(container[probe_name]["httpGet"]["path"])
        paths[kind].add(deployment["spec"]["template"]["metadata"]["annotations"][
            "prometheus.io/path"])
    for kind, wanted in paths.items():
        assert wanted, kind
        statuses = await probe(kind, wanted)
        assert statuses == dict.fromkeys(sorted(wanted), 200), kind


def test_grace_period_outlasts_prestop_and_drain(docs: list[dict[str, Any]]) -> None:
    for deployment in _deployments(docs):
        spec = deployment["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        # A container's own LORAPLEX_DRAIN_TIMEOUT_S wins over the ConfigMap's.
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        drain = float(env.get("LORAPLEX_DRAIN_TIMEOUT_S") or _drain_timeout_s(docs))
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        pre_stop = float(command[1])
        assert spec["terminationGracePeriodSeconds"] > pre_stop + drain, deployment["metadata"]


def test_workers_request_one_gpu_or_one_known_mig_slice(docs: list[dict[str, Any]]) -> None:
    workers = [d for d in _objects(docs, "Deployment") if _component(d) == "worker"]
    assert workers
    for worker in workers:
        (container,) = worker["spec"]["template"]["spec"]["containers"]
        resources = container["resources"]
        gpu = {k: v for k, v in resources["limits"].items() if k.startswith("nvidia.com/")}
        assert len(gpu) == 1 and list(gpu.values()) == [1], worker["metadata"]["name"]
        ((name, _),) = gpu.items()
        assert gpu_resource_problem(name) is None, gpu_resource_problem(name)
        assert resources["requests"][name] == 1
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        profile = env.get("LORAPLEX_MIG_PROFILE")
        assert name == (f"nvidia.com/mig-{profile}" if profile else "nvidia.com/gpu")
        assert _flag(container["args"], "--device") == "cuda"


def test_environment_names_are_settings_and_refs_resolve(docs: list[dict[str, Any]]) -> None:
    (config,) = _objects(docs, "ConfigMap")
    assert all(isinstance(v, str) for v in config["data"].values())
    assert env_problems(config["data"], "ConfigMap") == []
    assert config["data"]["LORAPLEX_ENVIRONMENT"] == "production"
    assert config["data"]["LORAPLEX_DATA_DIR"] == "/data"
    values_secret = load_yaml(CHART / "values.yaml")["secrets"]["name"]
    for name, spec in _pod_specs(docs):
        for container in spec["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            assert env_problems(env, name) == []
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] == config["metadata"]["name"]
                else:
                    assert source["secretRef"]["name"] == values_secret
            for item in env.values():
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == values_secret and ref["key"] == item["name"]
    for secret in _objects(docs, "Secret"):
        assert secret["metadata"]["name"] == values_secret
        assert sorted(secret["stringData"]) == sorted([
            "DATABASE_URL", "REDIS_URL", "LORAPLEX_ADMIN_KEY", "LORAPLEX_SECRET_KEY",
            "LORAPLEX_WORKER_TOKEN",
        ])
        assert env_problems(secret["stringData"], "Secret") == []
        # Created before the migration Job, which reads DATABASE_URL.
        assert secret["metadata"]["annotations"]["helm.sh/hook-weight"] == "-10"


def test_pods_run_as_the_image_user_without_privileges(docs: list[dict[str, Any]]) -> None:
    for name, spec in _pod_specs(docs):
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] == 10001, name  # USER in the Dockerfile
        assert spec["automountServiceAccountToken"] is False, name
        for container in spec["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"]["drop"] == ["ALL"]
            if security.get("readOnlyRootFilesystem"):
                mounts = {m["mountPath"] for m in container["volumeMounts"]}
                assert "/tmp" in mounts, f"{name}: a read-only root needs a writable /tmp"


def test_selectors_and_references_point_at_the_right_objects(
    docs: list[dict[str, Any]],
) -> None:
    every_deployment = _objects(docs, "Deployment")
    for deployment in every_deployment:
        selector = deployment["spec"]["selector"]["matchLabels"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        others = [d for d in every_deployment if d is not deployment]
        for other in others:  # no Deployment adopts another's pods
            assert not selector.items() <= other["spec"]["template"]["metadata"]["labels"].items()
    deployments = _deployments(docs)
    worker_labels = [
        d["spec"]["template"]["metadata"]["labels"] for d in deployments
        if _component(d) == "worker"
    ]
    others_labels = [
        d["spec"]["template"]["metadata"]["labels"] for d in every_deployment
        if _component(d) != "worker"
    ]
    if _in_pool(docs):
        # The pool and the Service of everything else select every worker and only them.
        (pool,) = _objects(docs, "InferencePool")
        for selector in (pool["spec"]["selector"]["matchLabels"],
                         _one(docs, "Service", "loraplex-serve")["spec"]["selector"]):
            assert all(selector.items() <= labels.items() for labels in worker_labels)
            assert not any(selector.items() <= labels.items() for labels in others_labels)
    else:
        gateway_labels = _one(docs, "Deployment", "loraplex-gateway")["spec"]["template"][
            "metadata"]["labels"]
        for selector in (
            _one(docs, "Service", "loraplex-gateway")["spec"]["selector"],
            _one(docs, "PodDisruptionBudget", "loraplex-gateway")["spec"]["selector"][
                "matchLabels"],
        ):
            assert selector.items() <= gateway_labels.items()
            assert not any(selector.items() <= labels.items() for labels in worker_labels)
    for scaler in _objects(docs, "HorizontalPodAutoscaler") + _objects(docs, "ScaledObject"):
        target = scaler["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
        deployment = _one(docs, "Deployment", target["name"])
        # The autoscaler owns the count: a `replicas` in the chart would reset it on upgrade.
        assert "replicas" not in deployment["spec"], target["name"]
        labels = scaler["metadata"]["labels"]
        assert labels.items() <= deployment["metadata"]["labels"].items()
        if _component(deployment) == "gateway":
            assert scaler["kind"] == "HorizontalPodAutoscaler"
            assert scaler["metadata"]["name"] == "loraplex-gateway"
            assert scaler["spec"]["minReplicas"] >= 2 and scaler["spec"]["maxReplicas"] >= 2
            assert scaler["spec"]["metrics"][0]["resource"]["name"] == "cpu"
        else:
            pod_spec = deployment["spec"]["template"]["spec"]
            assert "nodeSelector" not in pod_spec, "a worker pinned to a node cannot scale"
    scaled = {s["spec"]["scaleTargetRef"]["name"] for s in _objects(docs, "ScaledObject")}
    hpa_targets = [
        h["spec"]["scaleTargetRef"]["name"] for h in _objects(docs, "HorizontalPodAutoscaler")
    ]
    assert len(hpa_targets) == len(set(hpa_targets)) and not scaled & set(hpa_targets)
    for deployment in deployments:
        if "replicas" not in deployment["spec"]:  # someone must scale it
            assert deployment["metadata"]["name"] in scaled | set(hpa_targets)
    claims = {d["metadata"]["name"] for d in _objects(docs, "PersistentVolumeClaim")}
    for name, spec in _pod_specs(docs):
        for volume in spec.get("volumes", []):
            claim = volume.get("persistentVolumeClaim", {}).get("claimName")
            assert claim is None or claim in claims or claim == "adapters", (name, claim)


def test_gateways_and_workers_share_the_adapter_store(docs: list[dict[str, Any]]) -> None:
    sources = set()
    for deployment in _deployments(docs):
        spec = deployment["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        data = volumes[mounts["/data"]]
        sources.add(json.dumps(data.get("persistentVolumeClaim") or data, sort_keys=True))
        if _component(deployment) == "gateway" or container["args"][0] == "serve":
            # A usage spool belongs to one process: never on the shared volume.
            assert "emptyDir" in volumes[mounts["/data/spool"]]
        else:
            assert "/data/spool" not in mounts  # a worker records no usage
    assert len(sources) == 1, sources


def test_migration_job_is_a_helm_hook_running_db_upgrade(docs: list[dict[str, Any]]) -> None:
    job = _one(docs, "Job", "loraplex-migrate")
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"]
    spec = job["spec"]["template"]["spec"]
    assert spec["restartPolicy"] == "Never"
    (container,) = spec["containers"]
    assert container["args"] == ["db", "upgrade"]


def test_gateway_disruption_budget_and_autoscaling(docs: list[dict[str, Any]]) -> None:
    if _in_pool(docs):  # the pool's members serve the API: no gateway at all
        assert not [d for d in docs if d["metadata"]["labels"].get(
            "app.kubernetes.io/component") == "gateway"]
        return
    pdb = _one(docs, "PodDisruptionBudget", "loraplex-gateway")
    assert pdb["spec"]["minAvailable"] == 1
    gateway = _one(docs, "Deployment", "loraplex-gateway")
    assert gateway["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    hpas = [
        h for h in _objects(docs, "HorizontalPodAutoscaler")
        if h["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"
    ]
    if not hpas:
        assert gateway["spec"]["replicas"] == 3  # NO_AUTOSCALING
        return
    (hpa,) = hpas
    pods_metrics = [m for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    for metric in pods_metrics:
        # prometheus-adapter's rule turns loraplex_http_requests_total into this name.
        assert metric["pods"]["metric"]["name"] == "loraplex_http_requests_per_second"
        assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "50"}


def test_gpu_resource_names_are_checked() -> None:
    assert gpu_resource_problem("nvidia.com/gpu") is None
    assert gpu_resource_problem("nvidia.com/mig-3g.71gb") is None
    assert gpu_resource_problem("nvidia.com/mig-1g.10gb") is None
    assert gpu_resource_problem("nvidia.com/mig-3g.70gb") is not None  # no such profile
    assert gpu_resource_problem("nvidia.com/mig-3g.71GB") is not None
    assert gpu_resource_problem("amd.com/gpu") is not None


# -------------------------------------------------------------- from a live plan


# The example of the issue: one node, an H200 in mixed MIG profiles, an A100-80GB whose
# profiles the planner picks, an A100-40GB without MIG.
TOPOLOGY = """
nodes:
  - name: node-a
    gpus:
      - {index: 0, model: H200, memory_gb: 141, mig: ["3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"]}
      - {index: 1, model: A100-80GB, memory_gb: 80, mig: auto}
      - {index: 2, model: A100-40GB, memory_gb: 40}
"""
TENANTS = """
tenants:
  - {name: acme, isolation: dedicated, concurrency: 32, context: 4096}
  - {name: small-co, isolation: shared}
"""
# A Llama-3-8B-shaped config: the planner reads nothing else of a model.
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 8192, "vocab_size": 128256,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128009,
}


def test_the_chart_deploys_what_loraplex_plan_prints(tmp_path: Path) -> None:
    from app.cli import main

    (tmp_path / "topo.yaml").write_text(TOPOLOGY)
    (tmp_path / "tenants.yaml").write_text(TENANTS)
    model = tmp_path / "Llama-3-8B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    result = CliRunner().invoke(main, [
        "plan", "--topology", str(tmp_path / "topo.yaml"), "--tenants",
        str(tmp_path / "tenants.yaml"), "--model", str(model), "--format", "json",
    ])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)

    converter = load_deploy_script("plan_to_values")
    with pytest.raises(converter.PlanError, match="--tenant-id"):
        converter.convert(plan)  # acme is dedicated: its id is needed
    values = converter.convert(plan, {"acme": "ten_0123456789abcdef"}).values
    assert values["model"] == str(model)
    docs = _render(merge_values({}, yaml.safe_load(yaml.safe_dump(values))))

    workers = {
        d["metadata"]["name"]: d for d in _objects(docs, "Deployment") if _component(d) == "worker"
    }
    assert len(workers) == len(plan["workers"])
    requested = []
    for planned, entry in zip(plan["workers"], values["workers"], strict=True):
        deployment = workers[f"loraplex-worker-{entry['name']}"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        gpu = {k: v for k, v in container["resources"]["limits"].items() if "nvidia.com/" in k}
        assert gpu == planned["resources"]  # exactly the request the plan printed
        requested.append(next(iter(gpu)))
        args = container["args"]
        assert _flag(args, "--model") == str(model)
        _, engine_args = converter._split_model(planned["args"])
        assert engine_args and args[-len(engine_args):] == engine_args
        selector = deployment["spec"]["template"]["spec"]["nodeSelector"]
        assert selector == {"kubernetes.io/hostname": planned["node"]}
        dedicated = [args[i + 1] for i, a in enumerate(args) if a == "--dedicated-tenant"]
        assert dedicated == (["ten_0123456789abcdef"] if planned["isolation"] == "dedicated"
                             else [])
    assert any(r.startswith("nvidia.com/mig-") for r in requested)
    assert "nvidia.com/gpu" in requested  # the A100-40GB without MIG
    for problem in (gpu_resource_problem(r) for r in requested):
        assert problem is None, problem
    invocations = [
        [re.sub(r"\$\((\w+)\)", "10.0.0.1", a) for a in spec_["containers"][0]["args"]]
        for _, spec_ in _pod_specs(docs)
    ]
    assert cli_problems(invocations) == []
