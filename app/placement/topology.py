"""The machines a plan places workers on: nodes, GPUs, MIG mode and GPU instances.

Two sources give the same `Topology`: NVML on the machine itself (`discover_nvml`), or a
YAML file for machines planned from elsewhere (`load_topology`):

    nodes:
      - name: node-a
        gpus:
          - {index: 0, model: H200, memory_gb: 141, mig: ["3g.71gb", "2g.35gb", "1g.18gb"]}
          - {index: 1, model: A100-80GB, mig: auto}   # MIG on, the planner picks profiles
          - {index: 2, model: A100-40GB}              # MIG off: one whole-GPU worker

A `mig` entry may also be a mapping `{profile: 1g.18gb, uuid: MIG-...}`; GPUs may carry a
`uuid`. Without UUIDs the plan says where to look them up.
"""

from __future__ import annotations

import enum
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from app.placement.profiles import (
    GpuModel,
    UnknownGpuModel,
    check_combination,
    compute_slices_of,
    resolve_gpu_model,
)

GIB = 1 << 30


class PlacementInputError(ValueError):
    """A topology or tenants file (or NVML's answer) the planner cannot use; says why."""


class MigMode(enum.StrEnum):
    OFF = "off"  # one whole-GPU worker
    INSTANCES = "instances"  # the GPU instances that exist are the slots
    AUTO = "auto"  # MIG on; the planner chooses the profiles to create


@dataclass(frozen=True, slots=True)
class MigInstance:
    profile: str
    memory_gib: float  # usable: NVML's figure, or the profile table's
    compute_slices: int
    uuid: str | None = None


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    name: str  # as given or as NVML reports it
    model: GpuModel | None  # None: outside the MIG tables (only allowed with MIG off)
    memory_gib: float  # usable with MIG off
    mig: MigMode
    instances: tuple[MigInstance, ...] = ()
    uuid: str | None = None


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    gpus: tuple[Gpu, ...]


@dataclass(frozen=True, slots=True)
class Topology:
    nodes: tuple[Node, ...]

    def without_fp8(self) -> list[str]:
        """The GPUs that cannot serve `--quantization fp8` (compute capability under 8.9:
        Ampere and older), as "node GPU i (name)"."""
        return [f"{node.name} GPU {gpu.index} ({gpu.name})" for node in self.nodes
                for gpu in node.gpus if not has_fp8_units(gpu.name)]


# Model names of GPUs of compute capability 8.9 or newer (fp8 tensor cores): Ada (L4, L40,
# L40S, RTX 40xx / Ada), Hopper (H100, H200, H800, H20, GH200), Blackwell (B100, B200,
# GB200, RTX 50xx).
_FP8_MARKERS = ("H100", "H200", "H800", "H20", "GH200", "L4", "L40", "RTX 40", "RTX 50",
                "ADA", "B100", "B200", "GB200", "B300")


def has_fp8_units(name: str) -> bool:
    """Whether a GPU model name (as a topology file or NVML gives it) is one of compute
    capability 8.9 or newer. Unknown names count as not: a plan must not start a worker
    that refuses to load."""
    upper = name.upper()
    return any(marker in upper for marker in _FP8_MARKERS)


# ---------------------------------------------------------------------------- file


_NODE_KEYS = {"name", "gpus"}
_GPU_KEYS = {"index", "model", "memory_gb", "mig", "uuid"}
_INSTANCE_KEYS = {"profile", "uuid"}


def load_topology(path: Path) -> Topology:
    return parse_topology(read_yaml(path), source=str(path))


def parse_topology(raw: Any, source: str = "topology") -> Topology:
    if not isinstance(raw, dict) or not isinstance(raw.get("nodes"), list) or not raw["nodes"]:
        raise PlacementInputError(f"{source}: expected a mapping with a non-empty 'nodes' list")
    nodes: list[Node] = []
    for i, raw_node in enumerate(raw["nodes"]):
        where = f"{source}: nodes[{i}]"
        check_keys(raw_node, _NODE_KEYS, where)
        name = raw_node.get("name")
        if not isinstance(name, str) or not name:
            raise PlacementInputError(f"{where}: 'name' must be a non-empty string")
        if any(n.name == name for n in nodes):
            raise PlacementInputError(f"{where}: node name {name!r} appears twice")
        raw_gpus = raw_node.get("gpus")
        if not isinstance(raw_gpus, list) or not raw_gpus:
            raise PlacementInputError(f"{where} ({name}): 'gpus' must be a non-empty list")
        gpus = [_parse_gpu(g, f"{source}: node {name} gpus[{j}]") for j, g in enumerate(raw_gpus)]
        indexes = [g.index for g in gpus]
        if len(set(indexes)) != len(indexes):
            raise PlacementInputError(f"{where} ({name}): GPU indexes repeat: {indexes}")
        nodes.append(Node(name=name, gpus=tuple(sorted(gpus, key=lambda g: g.index))))
    return Topology(nodes=tuple(nodes))


def _parse_gpu(raw: Any, where: str) -> Gpu:
    check_keys(raw, _GPU_KEYS, where)
    index = raw.get("index")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise PlacementInputError(f"{where}: 'index' must be an integer >= 0")
    where = f"{where} (GPU {index})"
    name = raw.get("model")
    if not isinstance(name, str) or not name:
        raise PlacementInputError(f"{where}: 'model' must be a GPU model name, e.g. H200")
    memory = raw.get("memory_gb")
    if memory is not None and (
        not isinstance(memory, int | float) or isinstance(memory, bool) or memory <= 0
    ):
        raise PlacementInputError(f"{where}: 'memory_gb' must be a positive number")
    uuid = _optional_str(raw.get("uuid"), f"{where}: 'uuid'")
    mig_raw = raw.get("mig")
    try:
        model: GpuModel | None = resolve_gpu_model(name, memory)
    except UnknownGpuModel as e:
        if mig_raw is not None or memory is None:
            # NOTE: a GPU outside the tables (L40S, H100 NVL, ...) is still a whole-GPU
            # worker when its memory is given; only MIG needs the profile tables.
            raise PlacementInputError(f"{where}: {e}") from None
        model = None
    if model is not None and memory is not None and abs(memory - model.nominal_gb) > (
        0.1 * model.nominal_gb
    ):
        raise PlacementInputError(
            f"{where}: memory_gb {memory:g} does not match a {model.key} ({model.nominal_gb} GB)"
        )
    memory_gib = model.usable_gib if model is not None else float(memory or 0)
    if mig_raw is None:
        return Gpu(index, name, model, memory_gib, MigMode.OFF, uuid=uuid)
    assert model is not None
    if mig_raw == "auto":
        return Gpu(index, name, model, memory_gib, MigMode.AUTO, uuid=uuid)
    if not isinstance(mig_raw, list) or not mig_raw:
        raise PlacementInputError(
            f"{where}: 'mig' must be 'auto' or a non-empty list of MIG profiles"
        )
    instances = [_parse_instance(item, model, f"{where} mig[{k}]") for k, item in
                 enumerate(mig_raw)]
    reason = check_combination(model, [i.profile for i in instances])
    if reason is not None:
        raise PlacementInputError(f"{where}: {reason}")
    return Gpu(index, name, model, memory_gib, MigMode.INSTANCES, tuple(instances), uuid)


def _parse_instance(raw: Any, model: GpuModel, where: str) -> MigInstance:
    uuid: str | None = None
    if isinstance(raw, dict):
        check_keys(raw, _INSTANCE_KEYS, where)
        uuid = _optional_str(raw.get("uuid"), f"{where}: 'uuid'")
        raw = raw.get("profile")
    if not isinstance(raw, str):
        raise PlacementInputError(f"{where}: expected a MIG profile name such as '1g.10gb'")
    profile = model.profile(raw)
    if profile is None:
        raise PlacementInputError(
            f"{where}: {model.key} has no MIG profile {raw!r}; "
            f"its profiles: {', '.join(model.profile_names)}"
        )
    return MigInstance(profile.name, profile.usable_gib, profile.compute_slices, uuid)


def check_keys(raw: Any, allowed: set[str], where: str) -> None:
    if not isinstance(raw, dict):
        raise PlacementInputError(f"{where}: expected a mapping")
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise PlacementInputError(
            f"{where}: unknown key(s) {', '.join(map(str, unknown))}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )


def _optional_str(value: Any, what: str) -> str | None:
    if value is None or (isinstance(value, str) and value):
        return value
    raise PlacementInputError(f"{what} must be a non-empty string")


def read_yaml(path: Path) -> Any:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise PlacementInputError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise PlacementInputError(f"{path} is not valid YAML: {e}") from None


# ---------------------------------------------------------------------------- NVML


_MIG_NAME = re.compile(r"MIG\s+(\d+g\.\d+gb(?:\+me)?)", re.IGNORECASE)


def discover_nvml(nvml_module: Any = None, node_name: str | None = None) -> Topology:
    """This machine's GPUs through NVML (`nvidia-ml-py`, imported here: CPU-only machines
    never need it). `nvml_module` stands in for `pynvml`, e.g. in tests."""
    nvml: Any = nvml_module
    if nvml is None:
        try:
            import pynvml
        except ImportError as e:
            raise PlacementInputError(
                "nvidia-ml-py is not installed; install it or pass --topology FILE"
            ) from e
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        raise PlacementInputError(
            f"NVML is not available on this machine ({e}); pass --topology FILE"
        ) from None
    try:
        count = nvml.nvmlDeviceGetCount()
        gpus = [_nvml_gpu(nvml, i) for i in range(count)]
    except nvml.NVMLError as e:
        raise PlacementInputError(f"NVML query failed: {e}") from None
    finally:
        nvml.nvmlShutdown()
    if not gpus:
        raise PlacementInputError("NVML reports no GPUs on this machine")
    return Topology(nodes=(Node(name=node_name or socket.gethostname(), gpus=tuple(gpus)),))


def _nvml_gpu(nvml: Any, index: int) -> Gpu:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = _text(nvml.nvmlDeviceGetName(handle))
    uuid = _text(nvml.nvmlDeviceGetUUID(handle))
    memory_gib = nvml.nvmlDeviceGetMemoryInfo(handle).total / GIB
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:
        current = None  # a GPU without MIG support
    try:
        model: GpuModel | None = resolve_gpu_model(name, memory_gib)
    except UnknownGpuModel:
        model = None
    if current != nvml.NVML_DEVICE_MIG_ENABLE:
        return Gpu(index, name, model, round(memory_gib, 2), MigMode.OFF, uuid=uuid)
    instances: list[MigInstance] = []
    for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except nvml.NVMLError:
            continue  # an empty slot
        mig_name = _text(nvml.nvmlDeviceGetName(mig))
        match = _MIG_NAME.search(mig_name)
        if match is None:
            raise PlacementInputError(
                f"GPU {index}: cannot tell the MIG profile of device {mig_name!r}"
            )
        profile = match.group(1).lower()
        instances.append(
            MigInstance(
                profile=profile,
                memory_gib=round(nvml.nvmlDeviceGetMemoryInfo(mig).total / GIB, 2),
                compute_slices=compute_slices_of(profile) or 1,
                uuid=_text(nvml.nvmlDeviceGetUUID(mig)),
            )
        )
    if not instances:
        if model is None:
            raise PlacementInputError(
                f"GPU {index} ({name}) has MIG on and no instances, and no MIG table to "
                "choose profiles from; create the instances first"
            )
        # NOTE: MIG on with no instances yet: the plan proposes the profiles to create.
        return Gpu(index, name, model, round(memory_gib, 2), MigMode.AUTO, uuid=uuid)
    return Gpu(index, name, model, round(memory_gib, 2), MigMode.INSTANCES, tuple(instances),
               uuid)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
