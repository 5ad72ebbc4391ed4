"""Kubernetes objects checked against the upstream schemas, not against our own idea of
them: the built-in kinds against the JSON schemas of Kubernetes' OpenAPI documents
(kubernetes-validate ships them per release; the strict flavour refuses unknown fields,
as `kubectl apply --validate=strict` does), KEDA's ScaledObject against the
openAPIV3Schema of KEDA's CRD (cloudcoil-models-keda's models are generated from it;
their JSON schema is made as strict as the CRD: no unknown fields, no nulls). The
inference gateway's kinds have no such package: inference_schemas.py says how theirs
are made."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib.metadata import version
from importlib.resources import files
from typing import Any

import jsonschema
import kubernetes_validate
from jsonschema.protocols import Validator
from referencing import Registry, Resource

from tests.deploy import inference_schemas
from tests.deploy.support import CHART, load_yaml

KEDA_API_VERSION = "keda.sh/v1alpha1"


def _oldest_supported() -> str:
    """The lowest Kubernetes release the chart's `kubeVersion` (">=1.25.0-0") admits."""
    match = re.fullmatch(r">=\s*v?(\d+)\.(\d+)(\.\d+)?(-0)?", load_yaml(CHART / "Chart.yaml")[
        "kubeVersion"].strip())
    assert match is not None, "kubeVersion must be a plain lower bound"
    return f"{match.group(1)}.{match.group(2)}"


# NOTE: the oldest release the chart installs on and the newest the package knows: an
# API that is too new (a field added later) fails the first, one that is gone the second.
KUBE_VERSIONS = (
    _oldest_supported(), ".".join(kubernetes_validate.latest_version().split(".")[:2])
)


def _schema_dir(kube: str) -> Any:
    return files("kubernetes_validate") / "kubernetes-json-schema" / f"v{kube}.0-local-strict"


@cache
def _kube_registry(kube: str) -> Registry:
    # Every kind's schema refers into this one document (by its $id).
    definitions = json.loads((_schema_dir(kube) / "_definitions.json").read_text())
    return Resource.from_contents(definitions) @ Registry()


@cache
def _kube_validator(kube: str, api_version: str, kind: str) -> Validator | None:
    """The strict schema of apiVersion/kind in release `kube`, as kubernetes-validate names
    its files (apps/v1 Deployment: deployment-apps-v1.json; policy/v1: policy-v1; v1: v1).
    NOTE: kubernetes_validate.validate() reads 2 MB of definitions on every call; this
    reads them once per release and reports every error, not only the first."""
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    path = _schema_dir(kube) / f"{kind.lower()}-{group_version}.json"
    if not path.is_file():
        return None
    schema = json.loads(path.read_text())
    return jsonschema.Draft202012Validator(schema, registry=_kube_registry(kube))


def keda_version() -> str:
    """The KEDA release whose CRD the ScaledObject schema comes from (e.g. 2.16.1)."""
    return ".".join(version("cloudcoil-models-keda").split(".")[:3])


def _as_strict_as_the_crd(node: Any) -> Any:
    """A pydantic JSON schema the way the CRD's structural schema validates: fields the
    model declares `Optional` may be absent but not null, and no undeclared field passes
    (the API server prunes those, and strict field validation refuses them)."""
    if isinstance(node, list):
        return [_as_strict_as_the_crd(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _as_strict_as_the_crd(v) for k, v in node.items() if k != "default"}
    options = node.get("anyOf")
    if isinstance(options, list) and {"type": "null"} in options:
        rest = [o for o in options if o != {"type": "null"}]
        del node["anyOf"]
        if len(rest) == 1:
            node.update(rest[0])
        else:
            node["anyOf"] = rest
    if "properties" in node and "additionalProperties" not in node:
        node["additionalProperties"] = False
    return node


@cache
def _keda_validator() -> Validator:
    from cloudcoil.models.keda.v1alpha1 import ScaledObject

    schema = _as_strict_as_the_crd(ScaledObject.model_json_schema(by_alias=True))
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@dataclass(frozen=True, slots=True)
class SchemaProblem:
    object: str  # Kind/name
    schema: str  # e.g. "Kubernetes 1.25", "KEDA 2.16.1"
    path: str  # where in the object, dotted
    message: str

    def __str__(self) -> str:
        return f"{self.object} against {self.schema}: {self.path or '(top)'}: {self.message}"


def _path(parts: Any) -> str:
    return ".".join(str(p) for p in parts)


def schema_problems(doc: dict[str, Any]) -> list[SchemaProblem]:
    """Where `doc` breaks its kind's upstream schema (for KUBE_VERSIONS); a kind without
    one is a problem too, so that nothing passes unchecked."""
    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    inference = inference_schemas.SCHEMAS.get((str(doc.get("apiVersion")), str(doc.get("kind"))))
    if inference is not None:
        schema = "the inference gateway's API (tests/deploy/inference_schemas.py)"
        validator = jsonschema.Draft202012Validator(inference)
        return [
            SchemaProblem(name, schema, _path(error.absolute_path), error.message)
            for error in sorted(validator.iter_errors(doc), key=str)
        ] + [SchemaProblem(name, schema, "", rule) for rule in inference_schemas.cel_problems(doc)]
    if doc.get("apiVersion") == KEDA_API_VERSION:
        if doc.get("kind") != "ScaledObject":
            return [SchemaProblem(name, "KEDA", "kind", "only ScaledObject is known here")]
        schema = f"KEDA {keda_version()}"
        return [
            SchemaProblem(name, schema, _path(error.absolute_path), error.message)
            for error in sorted(_keda_validator().iter_errors(doc), key=str)
        ]
    problems: list[SchemaProblem] = []
    for kube in KUBE_VERSIONS:
        schema = f"Kubernetes {kube}"
        validator = _kube_validator(kube, str(doc.get("apiVersion")), str(doc.get("kind")))
        if validator is None:
            problems.append(SchemaProblem(
                name, schema, "apiVersion", f"no {doc.get('apiVersion')} {doc.get('kind')}"
            ))
            continue
        problems.extend(
            SchemaProblem(name, schema, _path(error.absolute_path), error.message)
            for error in sorted(validator.iter_errors(doc), key=str)
        )
    return problems
