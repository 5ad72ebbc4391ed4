"""GET /admin/engine: workers, adapter residency, KV usage, queues."""

from __future__ import annotations

import time

from fastapi import APIRouter

from app.api.deps import AdminPrincipal
from app.api.schemas.engine import AdapterCacheView, EngineAdapterView, EngineView, WorkerView
from app.api.state import AppState, AppStateDep
from engine.client import AdapterInfo, AdapterPlacement, EngineStats
from engine.remote.client import RemoteEngine
from engine.remote.workers import WorkerReport

router = APIRouter(tags=["admin"])

# The in-process engine's one worker; a gateway lists its workers by their own ids.
LOCAL_WORKER_ID = "local"


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


def _worker_view(
    worker_id: str,
    model: str,
    ready: bool,
    stats: EngineStats,
    adapters: list[EngineAdapterView],
) -> WorkerView:
    queries = stats.prefix_cache_queries
    return WorkerView(
        id=worker_id,
        model=model,
        ready=ready,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        kv_usage=stats.kv_usage,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        num_preemptions=stats.num_preemptions,
        prefix_cache_hit_rate=stats.prefix_cache_hits / queries if queries else None,
        adapter_cache=_cache_view(stats),
        adapters=adapters,
    )


def _remote_view(state: AppState, engine: RemoteEngine, report: WorkerReport) -> WorkerView:
    beat = report.beat
    known = {info.name: info for info in engine.list_adapters()}
    # Adapters this gateway has not validated (another gateway's, not yet synced) have no
    # rank or size here: they show once it has.
    infos = [known[name] for name in beat.adapters_registered if name in known]
    residency = [p.to_placement() for p in beat.residency]
    view = _worker_view(
        beat.worker_id, beat.model_id, beat.ready, beat.stats.to_stats(),
        _adapters(state, infos, residency),
    )
    view.url = beat.url
    view.device = beat.device
    view.mig_profile = beat.mig_profile
    view.gpu_uuid = beat.gpu_uuid
    view.dedicated_tenants = list(beat.dedicated_tenants)
    view.in_rotation = report.in_rotation
    view.inflight = report.inflight
    view.seconds_since_heartbeat = max(0.0, time.time() - beat.sent_at)
    return view


@router.get("/admin/engine", response_model=EngineView)
def engine_view(state: AppStateDep, admin: AdminPrincipal) -> EngineView:
    engine = state.engine
    if isinstance(engine, RemoteEngine):
        return EngineView(workers=[_remote_view(state, engine, r) for r in engine.workers()])
    worker = _worker_view(
        LOCAL_WORKER_ID, engine.model_id, engine.is_ready(), engine.stats(),
        _adapters(state, engine.list_adapters(), engine.adapter_residency()),
    )
    return EngineView(workers=[worker])
