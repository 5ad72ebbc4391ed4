"""MIG-aware placement: which engine workers to start on which GPUs and MIG slices.

    topology = load_topology(path)            # or discover_nvml() on the machine itself
    tenants = load_tenants(path)
    cfg, _ = planning_model_config("default", data_dir)
    result = plan(topology, tenants, cfg, PlanOptions())
    result.to_dict()  # {"workers": [...], "unplaced": [...]}
"""

from engine.placement.memory import MemoryBreakdown, MemoryModel, WorkerShape
from engine.placement.model_source import planning_model_config
from engine.placement.planner import Plan, PlanOptions, Unplaced, Worker, plan
from engine.placement.profiles import GPU_MODELS, GpuModel, MigProfile, check_combination
from engine.placement.tenants import TenantSpec, load_tenants, parse_tenants
from engine.placement.topology import (
    Gpu,
    MigInstance,
    MigMode,
    Node,
    PlacementInputError,
    Topology,
    discover_nvml,
    load_topology,
    parse_topology,
)

__all__ = [
    "GPU_MODELS",
    "Gpu",
    "GpuModel",
    "MemoryBreakdown",
    "MemoryModel",
    "MigInstance",
    "MigMode",
    "MigProfile",
    "Node",
    "PlacementInputError",
    "Plan",
    "PlanOptions",
    "TenantSpec",
    "Topology",
    "Unplaced",
    "Worker",
    "WorkerShape",
    "check_combination",
    "discover_nvml",
    "load_tenants",
    "load_topology",
    "parse_tenants",
    "parse_topology",
    "plan",
    "planning_model_config",
]
