"""GET /admin/engine: what each engine worker holds and runs."""

from __future__ import annotations

from pydantic import BaseModel


class AdapterCacheView(BaseModel):
    device_slots: int
    device_used: int
    host_capacity: int
    host_used: int
    loading: int
    queued: int
    device_hits: int
    device_misses: int
    loads: int
    load_failures: int
    device_evictions: int
    host_evictions: int


class EngineAdapterView(BaseModel):
    engine_name: str  # the engine's name (av/<version id> for registry adapters)
    name: str  # what callers write in `model`
    tenant_id: str | None  # None: shared (or preloaded with --lora)
    adapter_id: str | None
    version: int | None
    rank: int
    size_bytes: int
    slot: int | None = None  # the device slot holding it, if any
    on_host: bool = False
    loading: bool = False
    running: int = 0  # requests running with it (they pin it)
    waiting: int = 0  # requests waiting for it


class WorkerView(BaseModel):
    id: str
    model: str
    ready: bool
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_cache_hit_rate: float | None
    adapter_cache: AdapterCacheView | None
    adapters: list[EngineAdapterView]
    dtype: str | None = None  # what the engine computes in (float32, bfloat16, float16)
    compute: str | None = None  # the CPU and its bf16 units, or the GPU
    quantization: str | None = None  # the base weights' scheme ("none", "int8 (per channel)")
    weight_bytes: int | None = None  # the base model's weights as held
    # Workers of a gateway (None for the in-process engine):
    url: str | None = None
    device: str | None = None
    mig_profile: str | None = None
    gpu_uuid: str | None = None
    dedicated_tenants: list[str] = []
    in_rotation: bool | None = None  # False: left out after a failed call, or draining
    inflight: int | None = None  # this gateway's requests on it
    seconds_since_heartbeat: float | None = None


class EngineView(BaseModel):
    workers: list[WorkerView]
