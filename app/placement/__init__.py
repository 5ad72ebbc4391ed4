"""MIG-aware placement: which engine workers to start on which GPUs and MIG slices.

    topology = load_topology(path)            # or discover_nvml() on the machine itself
    tenants = load_tenants(path)
    cfg, _ = planning_model_config("default", data_dir)
    result = plan(topology, tenants, cfg, PlanOptions())
    result.to_dict()  # {"workers": [...], "unplaced": [...]}
"""

from app.placement.model_source import planning_model_config
from app.placement.planner import Plan, PlanOptions, Unplaced, Worker, plan
from app.placement.profiles import GPU_MODELS, GpuModel, MigProfile, check_combination
from app.placement.tenants import TenantSpec, load_tenants, parse_tenants
from app.placement.topology import (
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
from engine.core.memory import MemoryBreakdown, MemoryModel, WorkerShape

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
