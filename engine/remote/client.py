"""RemoteEngine: the EngineClient of a gateway, serving each request on a worker.

Workers are found through their Redis heartbeats (re-read every `refresh_interval_s`).
Everything the API asks synchronously (stats, adapters, readiness, limits) is answered
from this process's state and the last heartbeats, never by I/O on the event loop.

Adapters: `add_adapter` validates on one worker (the engine's own validation) and
remembers the adapter's path; any other worker gets it registered the first time a
request for it is routed there. Failures: a request that has not yet streamed an output
is retried on another worker (at most `max_attempts` in all); one that has ends with
`WorkerLost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from engine.client import (
    AdapterInfo,
    AdapterPlacement,
    EngineStats,
    Route,
    RouteHint,
    WorkerStatus,
)
from engine.errors import AdapterUnavailable, NoWorkerAvailable, RequestRejected, WorkerLost
from engine.remote.adapters import RemoteAdapters
from engine.remote.calls import AdapterMissing, WorkerFailed, post, stream_generate
from engine.remote.heartbeat import read_heartbeats
from engine.remote.protocol import ABORT_PATH, encode_request
from engine.remote.routing import Candidate, LoadBound, RouteQuery, choose_worker
from engine.remote.tokenizer import Tokenizing, TokenizingClient
from engine.remote.workers import KnownWorker, WorkerPool
from engine.request import EngineRequest, RequestOutput
from engine.structured import StructuredOutput

log = logging.getLogger("loraplex.gateway")

# A route chosen at admission whose request never started (client gone) is dropped after.
_PIN_TTL_S = 60.0
# How long shutdown waits for its background tasks to end after cancelling them.
_SHUTDOWN_WAIT_S = 5.0


@dataclass(slots=True)
class _Pin:
    """A route chosen for an engine request that has not started yet."""

    route: Route  # shared by the API request's engine requests (all its choices)
    query: RouteQuery
    created: float


class RemoteEngine(TokenizingClient):
    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        tokenizer: Tokenizing,
        model_id: str,
        max_model_len: int,
        max_adapter_bytes: int,
        data_dir: Path,
        token: str | None,
        refresh_interval_s: float = 0.5,
        max_attempts: int = 3,
        connect_timeout_s: float = 2.0,
        stream_idle_timeout_s: float = 20.0,
        load_bound: LoadBound | None = None,
    ) -> None:
        """max_model_len / max_adapter_bytes: what to answer until workers report theirs.
        stream_idle_timeout_s: a stream silent this long (workers send keepalives) is
        treated as a lost worker."""
        self._redis = redis
        self._tokenizer = tokenizer
        self._model_id = model_id
        self._default_max_model_len = max_model_len
        self._default_max_adapter_bytes = max_adapter_bytes
        self.refresh_interval_s = refresh_interval_s
        self.max_attempts = max_attempts
        self.load_bound = load_bound or LoadBound()
        self.pool = WorkerPool(model_id)
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(stream_idle_timeout_s, connect=connect_timeout_s),
            # One connection per stream: no pool limit beyond the OS's.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self.adapters = RemoteAdapters(
            self._http, self.pool, data_dir, max_attempts=max_attempts
        )
        self._pins: dict[str, _Pin] = {}  # engine request id -> its route
        self._running: dict[str, str] = {}  # engine request id -> worker id
        self._tasks: set[asyncio.Task[Any]] = set()
        self._refresh_task: asyncio.Task[None] | None = None
        self._started = False

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Read the heartbeats once, then every refresh interval (on this event loop)."""
        try:
            await self.refresh()
        except (RedisError, OSError):
            log.warning("cannot read worker heartbeats from Redis yet", exc_info=True)
        self._refresh_task = asyncio.create_task(self._refresh_loop(), name="worker-refresh")
        self._started = True

    async def refresh(self) -> None:
        self.pool.update(await read_heartbeats(self._redis))
        now = time.monotonic()
        for request_id in [r for r, p in self._pins.items() if now - p.created > _PIN_TTL_S]:
            del self._pins[request_id]

    async def _refresh_loop(self) -> None:
        failing = False
        # NOTE: the flag as well as the cancellation ends the loop: a cancellation that a
        # library absorbs mid-read must not leave shutdown() waiting for ever.
        while self._started:
            await asyncio.sleep(self.refresh_interval_s)
            try:
                await self.refresh()
            except (RedisError, OSError):
                # NOTE: keep the last view: workers that fail a call leave rotation anyway.
                log.warning("reading worker heartbeats failed", exc_info=not failing)
                failing = True
            else:
                failing = False

    async def shutdown(self) -> None:
        self._started = False
        task, self._refresh_task = self._refresh_task, None
        tasks = [t for t in [task, *self._tasks] if t is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=_SHUTDOWN_WAIT_S)
            if pending:
                log.warning("%d background task(s) did not stop within %.0f s of shutdown",
                            len(pending), _SHUTDOWN_WAIT_S)
        await self._http.aclose()
        await self._redis.aclose()

    # -- what the API asks synchronously -------------------------------------------------

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def max_model_len(self) -> int:
        # NOTE: the smallest of the workers': any of them may get the request.
        lens = [w.beat.max_model_len for w in self.pool.in_rotation()]
        return min(lens) if lens else self._default_max_model_len

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.vocab_size

    def check_structured_output(self, spec: StructuredOutput) -> None:
        # NOTE: on this process's own compiler (the tokenizer's): the worker that gets the
        # request compiles the spec again, so a refusal here is never a round trip.
        self._tokenizer.check_structured_output(spec)

    def is_ready(self) -> bool:
        return self._started and bool(self.pool.in_rotation())

    def failure(self) -> str | None:
        # A worker that fails leaves rotation and its supervisor restarts it; the gateway
        # itself keeps serving with the others.
        return None

    def stats(self) -> EngineStats:
        """The sum over the workers in rotation."""
        beats = [w.beat.stats for w in self.pool.in_rotation()]
        total = sum(s.num_total_blocks for s in beats)
        free = sum(s.num_free_blocks for s in beats)
        return EngineStats(
            num_running=sum(s.num_running for s in beats),
            num_waiting=sum(s.num_waiting for s in beats),
            num_free_blocks=free,
            num_total_blocks=total,
            kv_usage=(total - free) / total if total else 0.0,
            num_preemptions=sum(s.num_preemptions for s in beats),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in beats),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in beats),
            num_adapters=len(self.list_adapters()),
            num_step_failures=sum(s.num_step_failures for s in beats),
            num_steps=sum(s.num_steps for s in beats),
            num_steps_cut=sum(s.num_steps_cut for s in beats),
            kv_filled_slots=sum(s.kv_filled_slots for s in beats),
            block_size=beats[0].block_size if beats else 16,
            step_seconds=sum(s.step_seconds for s in beats),
            num_structured_requests=sum(s.num_structured_requests for s in beats),
            grammar_compiles=sum(s.grammar_compiles for s in beats),
            grammar_cache_hits=sum(s.grammar_cache_hits for s in beats),
            grammar_cache_misses=sum(s.grammar_cache_misses for s in beats),
            grammar_refusals=sum(s.grammar_refusals for s in beats),
            grammar_timeouts=sum(s.grammar_timeouts for s in beats),
            grammar_compile_s=sum(s.grammar_compile_s for s in beats),
        )

    def get_adapter(self, name: str) -> AdapterInfo | None:
        info = self.adapters.get(name)
        return info if info is not None else self.pool.preloaded().get(name)

    def list_adapters(self) -> list[AdapterInfo]:
        """The adapters added here (the registry's) and those workers were started with."""
        infos = {i.name: i for i in self.adapters.infos()}
        for name, info in self.pool.preloaded().items():
            infos.setdefault(name, info)
        return [infos[name] for name in sorted(infos)]

    def max_adapter_bytes(self) -> int:
        sizes = [w.beat.max_adapter_bytes for w in self.pool.in_rotation()]
        return max(sizes) if sizes else self._default_max_adapter_bytes

    def adapter_residency(self) -> list[AdapterPlacement]:
        """Merged over the workers: a slot if any worker has one, counts summed."""
        merged: dict[str, AdapterPlacement] = {}
        for worker in self.pool.in_rotation():
            for place in worker.beat.residency:
                old = merged.get(place.name)
                if old is not None:
                    place = AdapterPlacement(
                        name=place.name,
                        slot=old.slot if old.slot is not None else place.slot,
                        on_host=old.on_host or place.on_host,
                        loading=old.loading or place.loading,
                        pins=old.pins + place.pins,
                        reservations=old.reservations + place.reservations,
                    )
                merged[place.name] = place
        return [merged[name] for name in sorted(merged)]

    def workers(self) -> list[WorkerStatus]:
        """Every worker with a live heartbeat, in rotation or not, by id."""
        known = {info.name: info for info in self.list_adapters()}
        now = time.time()
        statuses = []
        for worker in self.pool.all():
            beat = worker.beat
            statuses.append(
                WorkerStatus(
                    id=beat.worker_id,
                    model=beat.model_id,
                    ready=beat.ready,
                    stats=beat.stats,
                    # Adapters this gateway has not validated (another gateway's, not yet
                    # synced) have no rank or size here: they show once it has.
                    adapters=[known[n] for n in beat.adapters_registered if n in known],
                    residency=list(beat.residency),
                    url=beat.url,
                    device=beat.device,
                    mig_profile=beat.mig_profile,
                    gpu_uuid=beat.gpu_uuid,
                    dedicated_tenants=list(beat.dedicated_tenants),
                    in_rotation=worker.in_rotation,
                    inflight=self.pool.inflight[worker.worker_id],
                    seconds_since_heartbeat=max(0.0, now - beat.sent_at),
                )
            )
        return statuses

    # -- routing -------------------------------------------------------------------------

    def route(self, request_ids: Sequence[str], hint: RouteHint) -> Route:
        """Choose the worker for an API request before its response starts (so that the
        response can name it); `generate` of these request ids then starts there.
        Raises NoWorkerAvailable."""
        query = RouteQuery(adapter=hint.adapter, tenant_id=hint.tenant_id,
                           tenant_name=hint.tenant_name, dedicated=hint.dedicated)
        worker_id = choose_worker(self._candidates(query), query, bound=self.load_bound)
        if worker_id is None:
            raise NoWorkerAvailable(_no_worker_reason(query))
        pin = _Pin(route=Route(worker_id=worker_id), query=query, created=time.monotonic())
        for request_id in request_ids:
            self._pins[request_id] = pin
        return pin.route

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget the routes of requests that will not run."""
        for request_id in request_ids:
            self._pins.pop(request_id, None)

    def _pick(
        self, query: RouteQuery, tried: set[str], preferred: str | None
    ) -> KnownWorker | None:
        if preferred is not None:
            known = self.pool.get(preferred)
            if known is not None and known.in_rotation:
                return known
        worker_id = choose_worker(
            self._candidates(query), query, exclude=frozenset(tried), bound=self.load_bound
        )
        return None if worker_id is None else self.pool.get(worker_id)

    def _candidates(self, query: RouteQuery) -> list[Candidate]:
        candidates = self.pool.candidates()
        if query.adapter is None or self.adapters.knows(query.adapter):
            return candidates
        # NOTE: an adapter that only workers' own `--lora` gives cannot be registered
        # anywhere else: its requests go to those workers alone.
        holders = self.pool.preloading(query.adapter)
        if not holders:
            return candidates  # unknown everywhere: a worker answers model_not_found
        return [c for c in candidates if c.worker_id in holders]

    # -- generation ----------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        request_id, adapter = request.request_id, request.adapter
        pin = self._pins.pop(request_id, None)
        route = None if pin is None else pin.route
        if pin is not None:
            query = pin.query
        else:
            tenant_id = None if request.tenant is None else request.tenant.tenant_id
            query = RouteQuery(adapter=adapter, tenant_id=tenant_id)
        body = encode_request(request)
        tried: set[str] = set()
        preferred = None if route is None else route.worker_id
        reasons: list[str] = []
        fetch_failures = 0  # workers that could not fetch the adapter's files
        reregister = False
        for _ in range(self.max_attempts):
            worker = self._pick(query, tried, preferred)
            if worker is None:
                break
            preferred = None
            if route is not None:
                route.worker_id = worker.worker_id
            started = False
            self.pool.inflight[worker.worker_id] += 1
            self._running[request_id] = worker.worker_id
            try:
                if adapter is not None:
                    await self.adapters.ensure_on(worker, adapter, force=reregister)
                reregister = False
                outputs = stream_generate(self._http, worker, body)
                async with contextlib.aclosing(outputs):
                    async for output in outputs:
                        started = True
                        yield output
                return
            except AdapterMissing as exc:
                if adapter is None or not self.adapters.knows(adapter):
                    raise RequestRejected(str(exc), code="model_not_found", param="model") from None
                # The heartbeat said it had it (a restart, a removal since): register it
                # there again, then run there.
                reregister, preferred = True, worker.worker_id
                reasons.append(f"{worker.worker_id}: adapter not registered")
            except WorkerFailed as exc:
                if exc.suspend:
                    self.pool.suspend(worker.worker_id, str(exc))
                if started:
                    raise WorkerLost(
                        f"worker {worker.worker_id} failed while streaming: {exc}"
                    ) from exc
                tried.add(worker.worker_id)
                reasons.append(f"{worker.worker_id}: {exc}")
                if exc.code == AdapterUnavailable.code:
                    fetch_failures += 1
            finally:
                self.pool.inflight[worker.worker_id] -= 1
                if self.pool.inflight[worker.worker_id] <= 0:
                    del self.pool.inflight[worker.worker_id]
                self._running.pop(request_id, None)
        detail = "; ".join(reasons) if reasons else _no_worker_reason(query)
        if fetch_failures and fetch_failures == len(reasons):
            raise AdapterUnavailable(
                f"the adapter '{adapter}' cannot be fetched from the adapter store right now "
                f"({detail})"
            )
        raise NoWorkerAvailable(f"no worker could take the request ({detail})")

    def abort(self, request_id: str) -> None:
        worker_id = self._running.get(request_id)
        known = None if worker_id is None else self.pool.get(worker_id)
        if known is not None:
            self._spawn(post(self._http, known, ABORT_PATH, {"request_id": request_id}))

    # -- adapters ------------------------------------------------------------------------

    async def add_adapter(self, name: str, path: str) -> AdapterInfo:
        return await self.adapters.add(name, path)

    async def remove_adapter(self, name: str) -> bool:
        return await self.adapters.remove(name)

    # -- internals -----------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Best effort: a worker that cannot be told to abort has dropped the stream.
            log.debug("background call to a worker failed: %s", task.exception())


def _no_worker_reason(query: RouteQuery) -> str:
    if query.dedicated:
        return "no worker serving this tenant is in rotation"
    return "no worker is in rotation"
