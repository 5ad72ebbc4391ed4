"""Workers announce themselves in Redis; gateways read who is alive.

Each worker writes `loraplex:workers:<id>` (its `Heartbeat` as JSON) every interval with a
TTL of a few intervals, and keeps its id in the set `loraplex:workers`. A worker that
stops (crash, kill -9, network) disappears when its key expires; one that shuts down
deletes its key first, so gateways stop routing to it before it stops accepting.

NOTE: Redis expires the key, so no clock is compared across machines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict
from redis.exceptions import RedisError

from engine.client import AdapterInfo, AdapterPlacement, EngineClient, EngineStats

log = logging.getLogger("loraplex.worker")

WORKERS_SET = "loraplex:workers"
_WORKER_KEY = "loraplex:workers:"


def worker_key(worker_id: str) -> str:
    return f"{_WORKER_KEY}{worker_id}"


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """What a worker is, fixed for its lifetime."""

    worker_id: str
    url: str  # where gateways reach its internal API
    device: str  # "cpu", "cuda:0", ...
    mig_profile: str | None  # e.g. "3g.71gb"; None: a whole GPU (or unknown)
    gpu_uuid: str | None  # "GPU-..." / "MIG-..." from CUDA_VISIBLE_DEVICES
    dedicated_tenants: tuple[str, ...]  # tenant ids only this worker serves (empty: shared)
    instance: str  # a fresh id per process: a restarted worker is a new instance
    # Adapters the worker was started with (`--lora`), from its own directories: only it
    # can serve them, gateways cannot register them elsewhere.
    preloaded_adapters: tuple[str, ...] = ()


def gpu_uuid_from_env(cuda_visible_devices: str | None) -> str | None:
    """The device UUID when CUDA_VISIBLE_DEVICES names one device by UUID (as a MIG slice
    is always named); None for indices, several devices or nothing."""
    if not cuda_visible_devices:
        return None
    entries = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
    if len(entries) == 1 and entries[0].startswith(("MIG-", "GPU-")):
        return entries[0]
    return None


def make_identity(
    *,
    worker_id: str,
    url: str,
    device: str,
    mig_profile: str | None,
    dedicated_tenants: tuple[str, ...],
    preloaded_adapters: tuple[str, ...] = (),
) -> WorkerIdentity:
    return WorkerIdentity(
        worker_id=worker_id,
        url=url.rstrip("/"),
        device=device,
        mig_profile=mig_profile or None,
        gpu_uuid=gpu_uuid_from_env(os.environ.get("CUDA_VISIBLE_DEVICES")),
        dedicated_tenants=tuple(sorted(set(dedicated_tenants))),
        instance=uuid.uuid4().hex,
        preloaded_adapters=tuple(sorted(set(preloaded_adapters))),
    )


class Heartbeat(BaseModel):
    """One worker's state, as gateways route by it and /admin/engine shows it."""

    # NOTE: newer workers may add fields, here and in the engine values inside (the
    # config reaches them), and older gateways still route by what they know.
    model_config = ConfigDict(extra="ignore")

    worker_id: str
    instance: str
    seq: int  # increases with every beat of this instance
    url: str
    device: str
    mig_profile: str | None
    gpu_uuid: str | None
    dedicated_tenants: list[str]
    model_id: str
    max_model_len: int
    max_adapter_bytes: int
    ready: bool
    draining: bool
    num_running: int
    num_waiting: int
    kv_usage: float
    adapters_device: list[str]  # in a device slot now
    adapters_host: list[str]  # a host-memory copy is loaded
    adapters_registered: list[str]  # every adapter the worker serves
    # Those of them it was started with (`--lora`), which gateways list as served by it.
    adapters_preloaded: list[AdapterInfo] = []
    stats: EngineStats
    residency: list[AdapterPlacement]
    sent_at: float  # unix seconds, for operators (never compared across machines)

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting


def snapshot(
    identity: WorkerIdentity, engine: EngineClient, *, seq: int, draining: bool
) -> Heartbeat:
    """The worker's heartbeat now (cheap reads of the engine's counters)."""
    stats = engine.stats()
    residency = engine.adapter_residency()
    return Heartbeat(
        worker_id=identity.worker_id,
        instance=identity.instance,
        seq=seq,
        url=identity.url,
        device=identity.device,
        mig_profile=identity.mig_profile,
        gpu_uuid=identity.gpu_uuid,
        dedicated_tenants=list(identity.dedicated_tenants),
        model_id=engine.model_id,
        max_model_len=engine.max_model_len,
        max_adapter_bytes=engine.max_adapter_bytes(),
        ready=engine.is_ready() and not draining,
        draining=draining,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        kv_usage=stats.kv_usage,
        adapters_device=sorted(p.name for p in residency if p.slot is not None),
        adapters_host=sorted(p.name for p in residency if p.on_host),
        adapters_registered=sorted(a.name for a in engine.list_adapters()),
        adapters_preloaded=[
            info
            for name in identity.preloaded_adapters
            if (info := engine.get_adapter(name)) is not None
        ],
        stats=stats,
        residency=residency,
        sent_at=time.time(),
    )


class HeartbeatPublisher:
    """Beats every `interval_s` from start() until withdraw() or stop()."""

    def __init__(
        self,
        redis: aioredis.Redis,
        identity: WorkerIdentity,
        engine: EngineClient,
        *,
        interval_s: float,
        ttl_s: float,
        is_draining: Callable[[], bool] = lambda: False,
    ) -> None:
        assert ttl_s > interval_s > 0, "a key must outlive the gap between two beats"
        self.redis = redis
        self.identity = identity
        self.engine = engine
        self.interval_s = interval_s
        self.ttl_ms = int(ttl_s * 1000)
        self._is_draining = is_draining
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self._withdrawn = False
        self._withdrawal: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def key(self) -> str:
        return worker_key(self.identity.worker_id)

    async def beat(self) -> Heartbeat:
        """Write one heartbeat now."""
        self._seq += 1
        beat = snapshot(self.identity, self.engine, seq=self._seq, draining=self._is_draining())
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.key, beat.model_dump_json(), px=self.ttl_ms)
            pipe.sadd(WORKERS_SET, self.identity.worker_id)
            await pipe.execute()
        return beat

    async def start(self) -> None:
        """First beat now, then in the background (a Redis outage is retried)."""
        self._loop = asyncio.get_running_loop()
        try:
            await self.beat()
        except (RedisError, OSError):
            log.error("cannot write the heartbeat to Redis: gateways do not see this "
                      "worker until it gets through", exc_info=True)
        self._task = asyncio.create_task(self._run(), name="worker-heartbeat")

    async def _run(self) -> None:
        failing = False
        while not self._withdrawn:
            await asyncio.sleep(self.interval_s)
            if self._withdrawn:
                return
            try:
                await self.beat()
            except (RedisError, OSError):
                # NOTE: keep serving; gateways take this worker out of rotation when its
                # key expires, and back in with the next beat that gets through.
                log.warning("heartbeat to Redis failed", exc_info=not failing)
                failing = True
            else:
                if failing:
                    log.info("heartbeats to Redis recovered")
                failing = False

    def withdraw_soon(self) -> None:
        """From a signal handler: stop beating and delete the key (on the loop)."""
        self._withdrawn = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_withdrawal)

    def _start_withdrawal(self) -> None:
        if self._withdrawal is None:
            self._withdrawal = asyncio.ensure_future(self.withdraw())

    async def withdraw(self) -> None:
        """Stop beating and delete the key: gateways stop routing here at their next read."""
        self._withdrawn = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(self.key)
                pipe.srem(WORKERS_SET, self.identity.worker_id)
                await pipe.execute()
        except (RedisError, OSError):
            log.warning("could not delete the heartbeat; it expires by itself", exc_info=True)

    async def stop(self) -> None:
        if self._withdrawal is not None:
            await self._withdrawal
        else:
            await self.withdraw()


async def read_heartbeats(redis: aioredis.Redis) -> list[Heartbeat]:
    """Every worker whose heartbeat has not expired, by worker id. Ids whose key expired
    are dropped from the set on the way (a worker that comes back adds itself again)."""
    ids = sorted(
        i.decode() if isinstance(i, bytes) else str(i) for i in await redis.smembers(WORKERS_SET)
    )
    if not ids:
        return []
    values = await redis.mget([worker_key(i) for i in ids])
    beats: list[Heartbeat] = []
    gone: list[str] = []
    for worker_id, value in zip(ids, values, strict=True):
        if value is None:
            gone.append(worker_id)
            continue
        try:
            beats.append(Heartbeat.model_validate_json(value))
        except ValueError:
            log.warning("unreadable heartbeat of worker %s ignored", worker_id)
    if gone:
        await redis.srem(WORKERS_SET, *gone)
    return beats
