"""`loraplex plan`: which workers to start on which GPUs and MIG slices for a set of tenants."""

from __future__ import annotations

import json
from pathlib import Path

import click

from app.server_options import engine_option

_FORMATS = ("json", "table")


class PlanInputError(click.ClickException):
    """A bad topology, tenants file or model: the message, exit status 2."""

    exit_code = 2


@click.command()
@click.option("--topology", "topology_path", type=click.Path(path_type=Path), default=None,
              help="Topology YAML (nodes, GPUs, MIG instances); default: this machine's "
                   "GPUs through NVML.")
@click.option("--tenants", "tenants_path", type=click.Path(path_type=Path), required=True,
              help="Tenants YAML: name, isolation (dedicated|shared), concurrency, context.")
@click.option("--model", default="default", show_default=True,
              help="'default' (bundled SmolLM2-135M-Instruct) or a local HF directory; only "
                   "its config.json is read.")
@click.option("--dtype", default="bfloat16", show_default=True,
              type=click.Choice(["bfloat16", "float16", "float32"]))
@click.option("--quantization", default="none", show_default=True,
              type=click.Choice(["none", "int8", "int4", "fp8"]),
              help="The workers' base model quantization: its decoder linear layers at the "
                   "scheme's bytes in the memory model (fp8 needs compute capability 8.9+).")
@engine_option("--quantization-group-size")
@engine_option("--max-loras", help="Adapter slots on each worker's device.")
@engine_option("--max-lora-rank")
@engine_option("--max-num-seqs",
               help="Sequences per step on shared workers (dedicated: the tenant's concurrency).")
@engine_option("--max-num-batched-tokens", help=None)
@engine_option("--block-size")
@engine_option("--gpu-memory-utilization",
               help="The share of each GPU or MIG slice a worker may use, as the engine's "
                    "--gpu-memory-utilization.")
@click.option("--format", "fmt", default="json", show_default=True, type=click.Choice(_FORMATS))
def plan(
    topology_path: Path | None,
    tenants_path: Path,
    model: str,
    dtype: str,
    quantization: str,
    quantization_group_size: int | None,
    max_loras: int,
    max_lora_rank: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
    gpu_memory_utilization: float,
    fmt: str,
) -> None:
    """Plan engine workers for TENANTS on the GPUs of a topology file or of this machine.

    Dedicated tenants each get a GPU or MIG slice of their own, shared tenants share the
    rest (at least one worker whenever there are shared tenants, even if a dedicated
    tenant then goes unplaced); a worker goes only where the memory model (weights + KV
    cache + adapter slots + activations + CUDA context) says it fits. Prints each
    worker's device, tenants, KV cache size, environment and Kubernetes resource request,
    and the tenants that fit nowhere with the reason.
    """
    # Imported here: the planner reads model configs through the engine (torch).
    from app.placement import (
        MemoryModel,
        PlacementInputError,
        PlanOptions,
        WorkerShape,
        discover_nvml,
        load_tenants,
        load_topology,
        planning_model_config,
    )
    from app.placement import plan as make_plan
    from engine.config import default_data_dir
    from engine.models.loader import ModelLoadError

    try:
        shape = WorkerShape(dtype=dtype, quantization=quantization,
                            quantization_group_size=quantization_group_size,
                            max_loras=max_loras, max_lora_rank=max_lora_rank,
                            max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                            gpu_memory_utilization=gpu_memory_utilization)
        topology = load_topology(topology_path) if topology_path else discover_nvml()
        lacking_fp8 = topology.without_fp8() if quantization == "fp8" else []
        if lacking_fp8:
            raise ValueError(
                "--quantization fp8 needs GPUs of compute capability 8.9 or newer (Ada, "
                f"Hopper, Blackwell); not {', '.join(lacking_fp8)}: use int8 or "
                "int4 there, or leave them out of the topology")
        tenants = load_tenants(tenants_path)
        config, _ = planning_model_config(model, default_data_dir())
        # A group size the model's layers cannot take: refused here, in one line.
        MemoryModel(config, shape)
    except (PlacementInputError, ModelLoadError, ValueError) as e:
        raise PlanInputError(str(e)) from e
    result = make_plan(topology, tenants, config, PlanOptions(shape=shape, model=model))
    data = result.to_dict()
    if fmt == "json":
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(render_table(data))


def render_table(data: dict) -> str:
    """The plan as aligned columns, then setup steps and unplaced tenants."""
    header = ("NODE", "GPU", "PROFILE", "GiB", "ISOLATION", "TENANTS", "LORAS", "KV TOKENS",
              "CUDA_VISIBLE_DEVICES", "RESOURCE")
    rows = [header]
    for w in data["workers"]:
        ((resource, count),) = w["resources"].items()
        rows.append((
            w["node"], str(w["gpu"]), w["mig_profile"] or "-", f"{w['memory_gb']:.2f}",
            w["isolation"], ",".join(w["tenants"]), str(w["max_loras"]),
            str(w["kv_cache_tokens"]), w["env"]["CUDA_VISIBLE_DEVICES"], f"{resource}={count}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
             .rstrip() for row in rows]
    if len(rows) == 1:
        lines.append("(no workers)")
    steps = list(dict.fromkeys(w["setup"] for w in data["workers"] if w["setup"]))
    if steps:
        lines += ["", "setup:"] + [f"  {step}" for step in steps]
    if data["unplaced"]:
        lines += ["", "unplaced:"] + [f"  {u['tenant']}: {u['reason']}" for u in data["unplaced"]]
    return "\n".join(lines)
