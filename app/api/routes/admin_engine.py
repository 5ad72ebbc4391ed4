"""GET /admin/engine: workers, adapter residency, KV usage, queues."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import AdminPrincipal
from app.api.schemas.engine import AdapterCacheView, EngineAdapterView, EngineView, WorkerView
from app.api.state import AppState, AppStateDep
from engine.client import AdapterInfo, AdapterPlacement, EngineStats, WorkerStatus

router = APIRouter(tags=["admin"])


def _adapters(
    state: AppState, infos: list[AdapterInfo], residency: list[AdapterPlacement]
) -> list[EngineAdapterView]:
    refs = {ref.engine_name: ref for ref in state.directory.ready_versions()}
    where_of = {r.name: r for r in residency}
    views = []
    for info in infos:
        ref = refs.get(info.name)
        where = where_of.get(info.name)
        views.append(
            EngineAdapterView(
                engine_name=info.name,
                name=info.name if ref is None else ref.name,
                tenant_id=None if ref is None else ref.tenant_id,
                adapter_id=None if ref is None else ref.adapter_id,
                version=None if ref is None else ref.version,
                rank=info.rank,
                size_bytes=info.size_bytes,
                slot=None if where is None else where.slot,
                on_host=False if where is None else where.on_host,
                loading=False if where is None else where.loading,
                running=0 if where is None else where.pins,
                waiting=0 if where is None else where.reservations,
            )
        )
    return sorted(views, key=lambda v: (v.slot is None, v.tenant_id or "", v.name))


def _cache_view(stats: EngineStats) -> AdapterCacheView | None:
    cache = stats.adapter_cache
    if cache is None:
        return None
    return AdapterCacheView(
        device_slots=cache.device_slots,
        device_used=cache.num_device,
        host_capacity=cache.host_capacity,
        host_used=cache.num_host,
        loading=cache.num_loading,
        queued=cache.num_queued,
        device_hits=cache.device_hits,
        device_misses=cache.device_misses,
        loads=cache.loads,
        load_failures=cache.load_failures,
        device_evictions=cache.device_evictions,
        host_evictions=cache.host_evictions,
    )


def _worker_view(state: AppState, worker: WorkerStatus) -> WorkerView:
    stats = worker.stats
    queries = stats.prefix_cache_queries
    return WorkerView(
        id=worker.id,
        model=worker.model,
        ready=worker.ready,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        kv_usage=stats.kv_usage,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        num_preemptions=stats.num_preemptions,
        prefix_cache_hit_rate=stats.prefix_cache_hits / queries if queries else None,
        adapter_cache=_cache_view(stats),
        adapters=_adapters(state, worker.adapters, worker.residency),
        dtype=stats.dtype or None,
        compute=stats.compute or None,
        quantization=stats.quantization or None,
        weight_bytes=stats.weight_bytes or None,
        url=worker.url,
        device=worker.device,
        mig_profile=worker.mig_profile,
        gpu_uuid=worker.gpu_uuid,
        dedicated_tenants=list(worker.dedicated_tenants),
        in_rotation=worker.in_rotation,
        inflight=worker.inflight,
        seconds_since_heartbeat=worker.seconds_since_heartbeat,
    )


@router.get("/admin/engine", response_model=EngineView)
def engine_view(state: AppStateDep, admin: AdminPrincipal) -> EngineView:
    return EngineView(workers=[_worker_view(state, w) for w in state.engine.workers()])
