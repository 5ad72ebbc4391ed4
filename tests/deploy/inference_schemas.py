"""JSON schemas of the Kubernetes inference gateway's kinds that the chart renders: the
Gateway API Inference Extension's InferencePool (inference.networking.k8s.io/v1) and
InferenceObjective (inference.networking.x-k8s.io/v1alpha2), and the Gateway API's
HTTPRoute (gateway.networking.k8s.io/v1), as far as the chart uses it.

NOTE: the published CRDs are on no package registry the tests can install from (no PyPI
or npm package ships them, as cloudcoil-models-keda does KEDA's), so these are written
here from the extension's v1 API reference: every field the API has at the levels the
chart writes, its type, bounds, enum, pattern and which are required, and no other field
(the CRDs' structural schemas refuse unknown fields too). The CEL rules a CRD adds are
spelled out in `cel_problems` where the chart could break them.
"""

from __future__ import annotations

from typing import Any

INFERENCE_GROUP = "inference.networking.k8s.io"
INFERENCE_X_GROUP = "inference.networking.x-k8s.io"
GATEWAY_GROUP = "gateway.networking.k8s.io"

_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_GROUP = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_KIND = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$"
)


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


def _string(*, min_length: int = 0, max_length: int | None = None,
            pattern: str | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "minLength": min_length}
    if max_length is not None:
        schema["maxLength"] = max_length
    if pattern is not None:
        schema["pattern"] = pattern
    return schema


_PORT_NUMBER = {"type": "integer", "minimum": 1, "maximum": 65535}
_OBJECT_NAME = _string(min_length=1, max_length=253)
_LABELS = {"type": "object", "additionalProperties": _string(max_length=63,
                                                             pattern=_LABEL_VALUE),
           "propertyNames": {"pattern": _LABEL_KEY, "maxLength": 317}}
_METADATA = _object({
    "name": _string(min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN),
    "namespace": _string(max_length=63),
    "labels": _LABELS,
    "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
}, required=("name",))


def _kind(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _object({
        "apiVersion": {"const": api_version},
        "kind": {"const": kind},
        "metadata": _METADATA,
        "spec": spec,
    }, required=("apiVersion", "kind", "metadata", "spec"))


INFERENCE_POOL = _kind(f"{INFERENCE_GROUP}/v1", "InferencePool", _object({
    # Labels only: the structure of a Service's selector, not a LabelSelector.
    "selector": _object({
        "matchLabels": {**_LABELS, "minProperties": 1, "maxProperties": 64},
    }, required=("matchLabels",)),
    "targetPorts": {
        "type": "array", "minItems": 1, "maxItems": 8,
        "items": _object({"number": _PORT_NUMBER}, required=("number",)),
    },
    "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
    "endpointPickerRef": _object({
        "group": _string(max_length=253, pattern=_GROUP),
        "kind": _string(min_length=1, max_length=63, pattern=_KIND),
        "name": _OBJECT_NAME,
        "port": _object({"number": _PORT_NUMBER}, required=("number",)),
        "failureMode": {"enum": ["FailOpen", "FailClose"]},
    }, required=("name",)),
}, required=("selector", "targetPorts", "endpointPickerRef")))

INFERENCE_OBJECTIVE = _kind(f"{INFERENCE_X_GROUP}/v1alpha2", "InferenceObjective", _object({
    "priority": {"type": "integer"},
    "poolRef": _object({
        "group": _string(max_length=253, pattern=_GROUP),
        "kind": _string(min_length=1, max_length=63, pattern=_KIND),
        "name": _OBJECT_NAME,
    }, required=("name",)),
}, required=("poolRef",)))

_PATH_MATCH = _object({
    "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
    "value": _string(max_length=1024),
})
_HEADER_MATCH = _object({
    "type": {"enum": ["Exact", "RegularExpression"]},
    "name": _string(min_length=1, max_length=256),
    "value": _string(min_length=1, max_length=4096),
}, required=("name", "value"))
HTTP_ROUTE = _kind(f"{GATEWAY_GROUP}/v1", "HTTPRoute", _object({
    "parentRefs": {"type": "array", "maxItems": 32, "items": _object({
        "group": _string(max_length=253, pattern=_GROUP),
        "kind": _string(min_length=1, max_length=63, pattern=_KIND),
        "namespace": _string(min_length=1, max_length=63),
        "name": _OBJECT_NAME,
        "sectionName": _string(min_length=1, max_length=253),
        "port": _PORT_NUMBER,
    }, required=("name",))},
    "hostnames": {"type": "array", "maxItems": 16, "items": _string(min_length=1,
                                                                       max_length=253)},
    "rules": {"type": "array", "minItems": 1, "maxItems": 16, "items": _object({
        "name": _string(min_length=1, max_length=253),
        "matches": {"type": "array", "maxItems": 64, "items": _object({
            "path": _PATH_MATCH,
            "headers": {"type": "array", "maxItems": 16, "items": _HEADER_MATCH},
            "method": {"enum": ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT",
                                "OPTIONS", "TRACE", "PATCH"]},
        })},
        "backendRefs": {"type": "array", "maxItems": 16, "items": _object({
            "group": _string(max_length=253, pattern=_GROUP),
            "kind": _string(min_length=1, max_length=63, pattern=_KIND),
            "name": _OBJECT_NAME,
            "namespace": _string(min_length=1, max_length=63),
            "port": _PORT_NUMBER,
            "weight": {"type": "integer", "minimum": 0, "maximum": 1000000},
        }, required=("name",))},
    })},
}))

SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    (f"{INFERENCE_GROUP}/v1", "InferencePool"): INFERENCE_POOL,
    (f"{INFERENCE_X_GROUP}/v1alpha2", "InferenceObjective"): INFERENCE_OBJECTIVE,
    (f"{GATEWAY_GROUP}/v1", "HTTPRoute"): HTTP_ROUTE,
}


def cel_problems(doc: dict[str, Any]) -> list[str]:
    """The CRDs' validation rules beyond the structural schema, where the chart could
    break them: a pool's port numbers are unique; a picker that is a Service (the
    default kind) needs its port; a path match's value starts with '/'; a backend of
    the core group that is a Service needs its port."""
    spec = doc.get("spec", {})
    problems: list[str] = []
    if doc.get("kind") == "InferencePool":
        numbers = [p.get("number") for p in spec.get("targetPorts", [])]
        if len(numbers) != len(set(numbers)):
            problems.append(f"spec.targetPorts: port numbers must be unique: {numbers}")
        ref = spec.get("endpointPickerRef", {})
        if ref.get("kind", "Service") == "Service" and ref.get("group", "") == "" \
                and "port" not in ref:
            problems.append("spec.endpointPickerRef.port: required when kind is Service")
    if doc.get("kind") == "HTTPRoute":
        for i, rule in enumerate(spec.get("rules", [])):
            for j, match in enumerate(rule.get("matches", [])):
                value = match.get("path", {}).get("value", "/")
                if not value.startswith("/"):
                    problems.append(f"spec.rules.{i}.matches.{j}.path.value: must start "
                                    f"with '/': {value!r}")
            for j, ref in enumerate(rule.get("backendRefs", [])):
                if ref.get("group", "") == "" and ref.get("kind", "Service") == "Service" \
                        and "port" not in ref:
                    problems.append(f"spec.rules.{i}.backendRefs.{j}.port: required for "
                                    "a Service")
    return problems
