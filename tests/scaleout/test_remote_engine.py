"""RemoteEngine against real workers (the worker app around FakeEngines, over real HTTP
behind TCP proxies that can cut or stall them) and real Redis heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from engine.client import RouteHint
from engine.errors import NoWorkerAvailable, RequestRejected, WorkerLost
from engine.remote.client import RemoteEngine
from engine.remote.heartbeat import HeartbeatPublisher, make_identity, read_heartbeats
from engine.remote.routing import rendezvous_order
from engine.remote.worker_app import create_worker_app
from engine.request import EngineRequest, RequestOutput, SamplingParams, TenantContext
from engine.testing import FakeEngine
from tests.utils.live_server import serve_in_thread
from tests.utils.tcp_proxy import TcpProxy

# A test stuck past the watchdog's limit prints where each of its tasks is waiting.
pytestmark = pytest.mark.usefixtures("event_loop_watchdog")

TOKEN = "worker-token-0123456789abcdef"
MODEL = "fake-model"
INTERVAL_S = 0.1
TTL_S = 0.4


@dataclass
class Worker:
    worker_id: str
    engine: FakeEngine  # strict: like the real one, it serves only adapters added to it
    proxy: TcpProxy
    publisher: HeartbeatPublisher


@dataclass
class Cluster:
    workers: dict[str, Worker]
    data_dir: Path
    redis_url: str
    stack: contextlib.ExitStack

    async def add_worker(
        self, worker_id: str, *, token: str = TOKEN, dedicated: tuple[str, ...] = (),
        preloaded: tuple[str, ...] = (),
    ) -> Worker:
        """preloaded: adapters the worker serves from the start, as `--lora` gives."""
        engine = FakeEngine(model_id=MODEL, max_model_len=4096, token_delay_s=0.01,
                            strict_adapters=True)
        for name in preloaded:
            await engine.add_adapter(name, f"/opt/loras/{name}")
        app = create_worker_app(engine, token=token, data_dir=self.data_dir, keepalive_s=0.1)
        base = self.stack.enter_context(serve_in_thread(app))
        port = int(base.rsplit(":", 1)[1])
        proxy = self.stack.enter_context(TcpProxy("127.0.0.1", port))
        identity = make_identity(worker_id=worker_id, url=f"http://127.0.0.1:{proxy.port}",
                                 device="cpu", mig_profile=None, dedicated_tenants=dedicated,
                                 preloaded_adapters=preloaded)
        publisher = HeartbeatPublisher(aioredis.Redis.from_url(self.redis_url), identity, engine,
                                       interval_s=INTERVAL_S, ttl_s=TTL_S)
        await publisher.start()
        worker = Worker(worker_id, engine, proxy, publisher)
        self.workers[worker_id] = worker
        return worker


def kill(worker: Worker) -> None:
    """As kill -9 would: connections refused, heartbeats stop (the key expires)."""
    worker.proxy.cut()
    stop_beating(worker.publisher)


def stop_beating(publisher: HeartbeatPublisher) -> None:
    """The beats stop, and nothing deletes the key: it expires, as after a crash."""
    task = publisher._task
    assert task is not None
    # NOTE: the flag too: redis-py can absorb a cancellation that lands mid-command, and
    # the beat loop would then go on.
    publisher._withdrawn = True
    task.cancel()


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Path:
    path = tmp_path / "data" / "adapters" / ("c" * 64)
    path.mkdir(parents=True)
    return path


@pytest.fixture
async def cluster(redis_url: str, adapter_dir: Path) -> AsyncIterator[Cluster]:
    with contextlib.ExitStack() as stack:
        c = Cluster({}, adapter_dir.parents[1], redis_url, stack)
        try:
            yield c
        finally:
            for worker in c.workers.values():
                await worker.publisher.stop()
                await worker.publisher.redis.aclose()


@contextlib.asynccontextmanager
async def remote(cluster: Cluster, **options: object) -> AsyncIterator[RemoteEngine]:
    engine = RemoteEngine(
        redis=aioredis.Redis.from_url(cluster.redis_url),
        tokenizer=FakeEngine(model_id=MODEL),
        model_id=MODEL,
        max_model_len=1024,
        max_adapter_bytes=1 << 20,
        data_dir=cluster.data_dir,
        token=TOKEN,
        refresh_interval_s=0.05,
        **options,  # type: ignore[arg-type]
    )
    await engine.start()
    try:
        # The workers added so far are all in rotation before the test goes on: on a busy
        # machine the first heartbeats can arrive after start() returns.
        expected = set(cluster.workers)
        await _wait_for(
            lambda: {w.id for w in engine.workers() if w.in_rotation} >= expected,
            timeout=15,
        )
        yield engine
    finally:
        await engine.shutdown()


async def _wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "condition never held"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def _run(engine: RemoteEngine, request_id: str, *, adapter: str | None = None,
               max_tokens: int = 3) -> list[RequestOutput]:
    outputs = []
    # A stuck call fails with the await it is stuck in, instead of stalling the run.
    async with asyncio.timeout(30):
        request = EngineRequest(request_id, tuple(b"hello"),
                                SamplingParams(max_tokens=max_tokens), adapter=adapter)
        async for out in engine.generate(request):
            outputs.append(out)
    return outputs


def _registered(cluster: Cluster, name: str) -> set[str]:
    return {w.worker_id for w in cluster.workers.values() if name in w.engine.adapters}


async def test_a_workers_own_adapter_is_listed_and_served_there_only(cluster: Cluster) -> None:
    # The adapter's rendezvous order puts its only holder last: unrestricted, routing
    # would send its requests to workers that do not have it.
    *others, holder = rendezvous_order("house", ["w1", "w2", "w3"])
    for worker_id in ("w1", "w2", "w3"):
        await cluster.add_worker(worker_id,
                                 preloaded=("house",) if worker_id == holder else ())
    async with remote(cluster) as engine:
        info = cluster.workers[holder].engine.adapters["house"]
        assert engine.get_adapter("house") == info
        assert [i.name for i in engine.list_adapters()] == ["house"]
        assert engine.pool.preloading("house") == {holder}
        for i in range(4):
            route = engine.route([f"h{i}"], RouteHint("house", "t"))
            assert route.worker_id == holder
            outputs = await _run(engine, f"h{i}", adapter="house")
            assert outputs[-1].finished and route.worker_id == holder
        assert all(not cluster.workers[w].engine.submitted for w in others)
        # Its holder gone, the adapter is no longer served (nor sent elsewhere).
        kill(cluster.workers[holder])
        await _wait_for(lambda: holder not in {w.worker_id for w in engine.pool.all()})
        assert engine.get_adapter("house") is None and engine.list_adapters() == []


async def test_an_adapter_sticks_to_one_worker_and_moves_when_it_dies(
    cluster: Cluster, adapter_dir: Path
) -> None:
    for worker_id in ("w1", "w2", "w3"):
        await cluster.add_worker(worker_id)
    async with remote(cluster) as engine:
        assert engine.is_ready() and len(engine.pool.in_rotation()) == 3
        info = await engine.add_adapter("av/x", str(adapter_dir))
        home = rendezvous_order("av/x", ["w1", "w2", "w3"])[0]
        # Validated (and so registered) on its rendezvous worker only, with a relative
        # path into the shared store.
        assert _registered(cluster, "av/x") == {home}
        assert info == cluster.workers[home].engine.adapters["av/x"]
        assert info.path == str(adapter_dir.resolve())
        assert engine.get_adapter("av/x") == info
        for i in range(6):
            route = engine.route([f"r{i}"], RouteHint("av/x", "t"))
            outputs = await _run(engine, f"r{i}", adapter="av/x")
            assert "".join(o.new_text for o in outputs) == "hel"
            assert route.worker_id == home
        assert [s.request_id for s in cluster.workers[home].engine.submitted] == [
            f"r{i}" for i in range(6)
        ]
        # Its worker dies: a request routed there before anyone noticed is retried on the
        # adapter's next rendezvous worker, which registers it on the way.
        kill(cluster.workers[home])
        route = engine.route(["after"], RouteHint("av/x", "t"))
        assert route.worker_id == home
        outputs = await _run(engine, "after", adapter="av/x")
        assert outputs[-1].finished
        second = rendezvous_order("av/x", ["w1", "w2", "w3"])[1]
        assert route.worker_id == second
        assert _registered(cluster, "av/x") == {home, second}
        alive = sorted({"w1", "w2", "w3"} - {home})
        assert [w.worker_id for w in engine.pool.in_rotation()] == alive
        # Removal reaches every worker that has it.
        assert await engine.remove_adapter("av/x") is True
        assert _registered(cluster, "av/x") == {home}  # the dead one cannot be reached
        assert engine.get_adapter("av/x") is None


async def test_a_stream_cut_after_its_first_output_fails_without_retry(cluster: Cluster) -> None:
    w1 = await cluster.add_worker("w1")
    await cluster.add_worker("w2")
    async with remote(cluster) as engine:
        engine.route(["s"], RouteHint(None))
        stream = engine.generate(EngineRequest("s", tuple(b"hello"),
                                               SamplingParams(max_tokens=500)))
        first = await stream.__anext__()
        owner = next(w for w in cluster.workers.values() if "s" in w.engine.active)
        assert first.num_output_tokens == 1
        kill(owner)
        started = time.monotonic()
        with pytest.raises(WorkerLost, match=owner.worker_id):
            async for _ in stream:
                pass
        assert time.monotonic() - started < 2
        other = "w2" if owner is w1 else "w1"
        assert cluster.workers[other].engine.submitted == []  # never repeated elsewhere
        assert [w.worker_id for w in engine.pool.in_rotation()] == [other]


async def test_a_stalled_worker_is_given_up_and_the_request_retried(cluster: Cluster) -> None:
    w1 = await cluster.add_worker("w1")
    w2 = await cluster.add_worker("w2")
    async with remote(cluster, stream_idle_timeout_s=0.5) as engine:
        w1.proxy.stall()  # accepts connections, forwards nothing: a hung machine
        route = engine.route(["r"], RouteHint(None))
        if route.worker_id != "w1":
            route.worker_id = "w1"  # make sure it is tried first
        started = time.monotonic()
        outputs = await _run(engine, "r")
        assert outputs[-1].finished
        assert 0.5 <= time.monotonic() - started < 3
        assert route.worker_id == "w2"
        assert [s.request_id for s in w2.engine.submitted] == ["r"]


async def test_heartbeats_take_workers_in_and_out_of_rotation(cluster: Cluster) -> None:
    w1 = await cluster.add_worker("w1")
    w2 = await cluster.add_worker("w2")
    async with remote(cluster) as engine:
        # A graceful stop deletes the heartbeat: out at the next read.
        await w1.publisher.withdraw()
        took = await _wait_for(lambda: [w.worker_id for w in engine.pool.all()] == ["w2"])
        assert took < 0.5
        assert [b.worker_id for b in await read_heartbeats(w2.publisher.redis)] == ["w2"]
        # A crash stops the beats: out once the key expires.
        stop_beating(w2.publisher)
        stopped = time.monotonic()
        await _wait_for(lambda: not engine.pool.all())
        # The key lives TTL_S from the last beat, which came at most about an interval
        # (and a busy loop's delay) before the cancel.
        assert TTL_S / 2 <= time.monotonic() - stopped < TTL_S + 0.5
        assert not engine.is_ready()
        with pytest.raises(NoWorkerAvailable):
            engine.route(["x"], RouteHint(None))
        with pytest.raises(NoWorkerAvailable):
            await _run(engine, "x")
        # A restarted worker (a new instance) is in at its first beat.
        w3 = await cluster.add_worker("w1")
        await _wait_for(lambda: [w.worker_id for w in engine.pool.in_rotation()] == ["w1"])
        assert engine.pool.get("w1").beat.instance == w3.publisher.identity.instance  # type: ignore[union-attr]


async def test_a_worker_out_after_a_failure_comes_back_after_two_beats(cluster: Cluster) -> None:
    w1 = await cluster.add_worker("w1")
    async with remote(cluster) as engine:
        w1.proxy.cut()
        with pytest.raises(NoWorkerAvailable, match="ConnectError"):
            await _run(engine, "r1")
        assert engine.pool.in_rotation() == []
        w1.proxy.restore()
        await _wait_for(lambda: bool(engine.pool.in_rotation()), timeout=2)
        assert (await _run(engine, "r2"))[-1].finished


async def test_a_wrong_token_takes_the_worker_out(cluster: Cluster) -> None:
    await cluster.add_worker("w1", token="another-token-0123456789abcdef")
    async with remote(cluster) as engine:
        with pytest.raises(NoWorkerAvailable, match="HTTP 401"):
            await _run(engine, "r1")
        assert cluster.workers["w1"].engine.submitted == []


async def test_requests_the_engine_refuses_are_not_retried(cluster: Cluster) -> None:
    await cluster.add_worker("w1")
    await cluster.add_worker("w2")
    async with remote(cluster) as engine:
        with pytest.raises(ValueError, match="at least one token"):
            EngineRequest("r1", (), SamplingParams())  # never reaches a worker
        for worker in cluster.workers.values():
            worker.engine.fail_with = RequestRejected("too long", code="context_length_exceeded",
                                                      param="messages")
        with pytest.raises(RequestRejected) as rejected:
            await _run(engine, "r2")
        assert (rejected.value.code, rejected.value.param) == ("context_length_exceeded",
                                                               "messages")
        submitted = [s.request_id for w in cluster.workers.values() for s in w.engine.submitted]
        assert sorted(submitted) == ["r2"]  # FakeEngine records r1 only once past the check
        assert len(engine.pool.in_rotation()) == 2


async def test_the_request_reaches_the_worker_engine_unchanged(cluster: Cluster) -> None:
    w1 = await cluster.add_worker("w1")
    tenant = TenantContext("t_1", weight=2.0, max_running=3, max_kv_fraction=0.5,
                           max_tokens=50, max_context_tokens=1000)
    sampling = SamplingParams(max_tokens=2, temperature=0.0, stop=["x"], seed=7, logprobs=1)
    async with remote(cluster) as engine:
        outputs = [o async for o in engine.generate(EngineRequest(
            "r1", (104, 105), sampling, salt="t_1", priority=2, tenant=tenant
        ))]
    [submitted] = w1.engine.submitted
    assert (submitted.request_id, submitted.prompt_token_ids, submitted.sampling,
            submitted.salt, submitted.priority, submitted.tenant) == (
        "r1", [104, 105], sampling, "t_1", 2, tenant
    )
    assert [o.new_token_ids for o in outputs] == [[105], [104]]  # seed 7: from offset 1
    assert outputs[0].new_logprobs[0].top == [(105, -0.5)]


async def test_an_adapter_unknown_to_the_gateway_is_not_found(cluster: Cluster) -> None:
    await cluster.add_worker("w1")
    async with remote(cluster) as engine:
        with pytest.raises(RequestRejected) as rejected:
            await _run(engine, "r1", adapter="av/unknown")
        assert rejected.value.code == "model_not_found"
        assert cluster.workers["w1"].engine.adapters == {}


async def test_a_worker_that_lost_an_adapter_gets_it_again(
    cluster: Cluster, adapter_dir: Path
) -> None:
    w1 = await cluster.add_worker("w1")
    async with remote(cluster) as engine:
        await engine.add_adapter("av/x", str(adapter_dir))
        await _wait_for(lambda: engine.pool.get("w1").beat.adapters_registered == ["av/x"])  # type: ignore[union-attr]
        del w1.engine.adapters["av/x"]  # its heartbeat still says it has it
        outputs = await _run(engine, "r1", adapter="av/x")
        assert outputs[-1].finished
        assert "av/x" in w1.engine.adapters


async def test_dedicated_tenants_run_only_on_their_workers(cluster: Cluster) -> None:
    await cluster.add_worker("shared")
    acme = await cluster.add_worker("acme-slice", dedicated=("t_acme",))
    async with remote(cluster) as engine:
        for i in range(3):
            route = engine.route([f"a{i}"], RouteHint(None, "t_acme", dedicated=True))
            assert route.worker_id == "acme-slice"
            await _run(engine, f"a{i}")
            shared = engine.route([f"s{i}"], RouteHint(None, "t_other"))
            assert shared.worker_id == "shared"
            await _run(engine, f"s{i}")
        with pytest.raises(NoWorkerAvailable, match="tenant"):
            engine.route(["x"], RouteHint(None, "t_beta", dedicated=True))
        [status] = [w for w in engine.workers() if w.id == "acme-slice"]
        assert status.dedicated_tenants == ["t_acme"]
        assert [s.request_id for s in acme.engine.submitted] == ["a0", "a1", "a2"]


async def test_synchronous_answers_come_from_the_heartbeats(cluster: Cluster) -> None:
    w1 = await cluster.add_worker("w1")
    w2 = await cluster.add_worker("w2")
    w1.engine.num_waiting = 3
    w2.engine._max_model_len = 2048
    async with remote(cluster) as engine:
        await _wait_for(lambda: engine.stats().num_waiting == 3 and engine.max_model_len < 4096)
        assert engine.max_model_len == 2048  # the smaller worker's
        stats = engine.stats()
        assert (stats.num_total_blocks, stats.num_free_blocks) == (256, 200)
        assert stats.kv_usage == pytest.approx(56 / 256)
        assert engine.max_adapter_bytes() == 64 * 1024 * 1024
        statuses = engine.workers()
        assert [(w.id, w.in_rotation, w.inflight) for w in statuses] == [
            ("w1", True, 0), ("w2", True, 0)
        ]
        assert statuses[0].url == w1.publisher.identity.url
        assert statuses[0].device == "cpu"
        assert (statuses[0].model, statuses[0].ready) == (MODEL, True)
        assert statuses[0].stats.num_waiting == 3 and statuses[1].stats.num_waiting == 0
        assert statuses[0].seconds_since_heartbeat is not None
        assert 0 <= statuses[0].seconds_since_heartbeat < 5


async def test_a_released_route_no_longer_steers_its_requests(cluster: Cluster) -> None:
    w1 = await cluster.add_worker("w1")
    async with remote(cluster) as engine:
        kept = engine.route(["kept"], RouteHint(None))
        dropped = engine.route(["dropped"], RouteHint(None))
        assert kept.worker_id == dropped.worker_id == "w1"
        engine.release(["dropped"])
        kept.worker_id = dropped.worker_id = "gone"  # a worker that no longer exists
        assert (await _run(engine, "kept"))[-1].finished
        assert (await _run(engine, "dropped"))[-1].finished
        assert kept.worker_id == "w1"  # the route followed its request to where it ran
        assert dropped.worker_id == "gone"  # released: routed afresh, the route untouched
        assert [s.request_id for s in w1.engine.submitted] == ["kept", "dropped"]
