"""`loraplex bench soak`: a long open-loop load of every kind of traffic, then a look for
anything the server kept that it should have given back.

One `loraplex serve` with API keys (a fresh SQLite database in a temporary data directory,
or `--database-url`; Redis quotas with `--redis-url`). A tenant with limits (so every request
goes through admission, leases and settlement) sends a mix: plain completions, chat streams
read to [DONE], streams the client cuts after a few chunks, completions on an adapter the
tenant uploaded, and bad requests that must get a 4xx; during the load the tenant uploads a
new version of its adapter through `POST /v1/adapters` every `--upload-interval` seconds.

First the mix runs closed-loop (`--capacity-concurrency` clients) to measure capacity in
requests/s; then it runs open-loop (Poisson arrivals) at `--load-fraction` of that for the
soak's duration. Before the load and after it (once the engine is idle) the process's RSS,
open file descriptors, threads, KV blocks in use, pinned adapters, database connections and
Redis keys are compared (bench/soak/probes.py); after SIGTERM the usage rows must be exactly
the successful responses. A leak or an unexpected answer fails the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.harness import loops
from bench.harness.adapters import write_random_adapter
from bench.harness.options import internal, opt
from bench.harness.report import ReportHead, machine_description, options_json, save_report
from bench.harness.server import prepare_stores, serve_with_keys
from bench.harness.tenants import create_tenant
from bench.harness.workload import median, percentile
from bench.soak.probes import Check, Snapshot, leak_checks, open_fds, query, rss_bytes, snapshot
from bench.soak.traffic import TENANT_MAX_TOKENS, Outcome, Traffic, TrafficShape
from engine.config import default_data_dir
from engine.models.loader import load_model_config, resolve_model_dir

DEFAULT_KV_CACHE_TOKENS = 8192
# The tenant's limits: none of them reached.
TENANT_QUOTAS = {"rpm": 1_000_000, "tpm": 1_000_000_000, "max_concurrency": 1024,
                 "max_tokens": TENANT_MAX_TOKENS}


@dataclass(slots=True)
class SoakOptions:
    model: str = "default"
    minutes: float = opt(2.0, "length of the open-loop load")
    seconds: float | None = opt(None, "length in seconds (overrides --minutes)")
    load_fraction: float = opt(
        0.7, "open-loop rate as a fraction of the capacity measured first")
    capacity_s: float = opt(20.0, "seconds of the closed loop that measures capacity")
    capacity_concurrency: int = 8
    max_tokens: int = opt(16, "of plain requests and of streams read to the end")
    cut_max_tokens: int = opt(64, "of the streams the client cuts after 2-4 chunks")
    upload_interval_s: float = opt(15.0, "seconds between adapter uploads during the load")
    adapter_rank: int = internal(4)
    # NOTE: the engine keeps its peak step footprint in the heap (engine/runtime/host_memory.py)
    # and the allocator fragments: on SmolLM2 on the CPU RSS rises ~300 MiB in the first
    # minutes of this load, more slowly all the time; a leak keeps rising, which the
    # second-half check catches.
    rss_slack_mib: int = opt(512, "RSS growth over the baseline still taken for no leak")
    max_in_flight: int = internal(256)  # the open loop skips arrivals past this (fails)
    seed: int = 0
    database_url: str | None = opt(
        None, "a fresh database (migrated first)", shown="SQLite in a temporary directory")
    redis_url: str | None = opt(
        None, "Redis quotas; this Redis database is FLUSHED before the run",
        shown="per-process quotas")
    serve_args: list[str] = opt([], "extra flag for `serve`", flag="--serve-arg")
    output: Path | None = None

    @property
    def duration_s(self) -> float:
        return self.seconds if self.seconds is not None else self.minutes * 60


@dataclass(slots=True)
class SoakReport(ReportHead):
    capacity_rps: float
    rate_rps: float
    counts: dict[str, int]  # "<phase> <kind> <status>" -> requests
    latency: dict[str, float]  # load phase, seconds
    rss_samples: list[tuple[float, int]]  # during the load: (seconds into it, bytes)
    unexpected: list[str]
    skipped_arrivals: int
    baseline: Snapshot
    after: Snapshot
    checks: list[Check]
    exit_code: int
    ok: bool


@dataclass(slots=True)
class SoakServer:
    proc: subprocess.Popen[bytes]
    base_url: str
    admin_key: str
    database_url: str


async def open_loop(
    traffic: Traffic, rate: float, opts: SoakOptions, adapter_dirs: Iterator[Path]
) -> int:
    """Poisson arrivals at `rate` for the soak's duration, uploads meanwhile; returns the
    arrivals skipped because `max_in_flight` requests were still running."""
    rng = random.Random(opts.seed + 1)
    in_flight: set[asyncio.Task[Outcome]] = set()
    skipped = 0
    started = time.perf_counter()
    next_upload = 0.0
    at = rng.expovariate(rate)
    next_sample = 0.0
    while at < opts.duration_s:
        if at >= next_sample:
            next_sample += opts.duration_s / 10
            traffic.rss_samples.append((round(at, 1), rss_bytes(traffic.pid)))
        if at >= next_upload:
            next_upload += opts.upload_interval_s
            task = asyncio.create_task(traffic.upload(next(adapter_dirs), "load"))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        if len(in_flight) >= opts.max_in_flight:
            skipped += 1
        else:
            task = asyncio.create_task(traffic.one("load"))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        at += rng.expovariate(rate)
    if in_flight:
        await asyncio.wait_for(asyncio.gather(*in_flight), 300)
    traffic.rss_samples.append((round(time.perf_counter() - started, 1), rss_bytes(traffic.pid)))
    return skipped


def _adapter_dirs(model_dir: Path, root: Path, rank: int) -> Iterator[Path]:
    """A new random adapter (one more version of the tenant's) each time."""
    config = load_model_config(model_dir)
    for seed in itertools.count():
        yield write_random_adapter(root / f"v{seed}", config, rank=rank, alpha=2 * rank,
                                   targets=("q_proj", "v_proj"), seed=seed)


@contextlib.contextmanager
def soak_server(opts: SoakOptions, data_dir: Path, timeout_s: float = 300.0
                ) -> Iterator[SoakServer]:
    database_url = opts.database_url or f"sqlite:///{data_dir / 'loraplex.db'}"
    prepare_stores(opts.database_url, opts.redis_url)
    stores = {"DATABASE_URL": database_url}
    if opts.redis_url:
        stores["REDIS_URL"] = opts.redis_url
    serve_args = list(opts.serve_args)
    if "--kv-cache-tokens" not in serve_args:
        # NOTE: the KV cache is paged in lazily, block by block as requests first use
        # them: a cache small enough for the capacity phase to use all of it is in the
        # baseline's RSS, instead of growing into the load's as a false leak.
        serve_args += ["--kv-cache-tokens", str(DEFAULT_KV_CACHE_TOKENS)]
    # The run stops the server itself (SIGTERM, and reads its exit code); a run that
    # failed before that leaves it to be killed here.
    with serve_with_keys(["--model", opts.model, *serve_args], data_dir, timeout_s=timeout_s,
                         stopper=_kill, **stores) as (launched, admin_key):
        yield SoakServer(launched.proc, launched.base_url, admin_key, database_url)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def _wait_idle(server: SoakServer, timeout_s: float = 60.0) -> None:
    """Until the engine runs nothing; then a moment for settles and the usage writer."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {server.admin_key}"}
    while time.monotonic() < deadline:
        workers = httpx.get(f"{server.base_url}/admin/engine", headers=headers,
                            timeout=30).json()["workers"]
        if all(w["num_running"] == 0 and w["num_waiting"] == 0 for w in workers):
            break
        time.sleep(0.2)
    time.sleep(1.5)
    _wait_fds_settled(server.proc.pid)


def _wait_fds_settled(pid: int, timeout_s: float = 30.0, quiet_s: float = 1.5) -> None:
    """Until the server's open file descriptors stop changing for quiet_s (or timeout_s).

    NOTE: the client's closed connections reach the server's event loop a little later;
    on a busy 2-core machine some were still open 1.5 s after the load, and the fd check
    read them as a leak. A leak stays open, so it still shows once the count is steady.
    """
    deadline = time.monotonic() + timeout_s
    count, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = open_fds(pid)
        if now != count:
            count, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.25)


async def _drive(server: SoakServer, key: str, opts: SoakOptions, adapter_dirs: Iterator[Path]
                 ) -> tuple[Traffic, float, float, int, Snapshot]:
    limits = httpx.Limits(max_connections=opts.max_in_flight + 8)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600, limits=limits,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        shape = TrafficShape(opts.seed, opts.max_tokens, opts.cut_max_tokens)
        traffic = Traffic(client, model, shape, server.proc.pid)
        await traffic.upload(next(adapter_dirs), "capacity")
        done, wall_s = await loops.closed_loop(lambda: traffic.one("capacity"),
                                               opts.capacity_concurrency, opts.capacity_s)
        capacity = done / wall_s
        rate = capacity * opts.load_fraction
        print(f"capacity {capacity:.2f} req/s (closed loop, {opts.capacity_concurrency} "
              f"clients); open loop at {rate:.2f} req/s for {opts.duration_s:.0f} s", flush=True)
        await asyncio.to_thread(_wait_idle, server)
        baseline = await asyncio.to_thread(
            snapshot, server.proc.pid, server.base_url, server.admin_key,
            server.database_url, opts.redis_url,
        )
        skipped = await open_loop(traffic, rate, opts, adapter_dirs)
    return traffic, capacity, rate, skipped, baseline


def run_soak(opts: SoakOptions) -> SoakReport:
    model_dir = resolve_model_dir(opts.model, default_data_dir())
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="loraplex-soak-") as tmp:
        data_dir = Path(tmp)
        adapter_dirs = _adapter_dirs(model_dir, data_dir / "adapters-src", opts.adapter_rank)
        with soak_server(opts, data_dir) as server:
            key = create_tenant(server.base_url, server.admin_key, "soak", quotas=TENANT_QUOTAS,
                                scopes=["inference", "adapters:write"]).key
            traffic, capacity, rate, skipped, baseline = asyncio.run(
                _drive(server, key, opts, adapter_dirs)
            )
            _wait_idle(server)
            after = snapshot(server.proc.pid, server.base_url, server.admin_key,
                             server.database_url, opts.redis_url)
            server.proc.terminate()
            exit_code = server.proc.wait(120)
        rows = [row[0] for row in query(server.database_url,
                                        "SELECT request_id FROM usage_records")]
    served = [o.response_id for o in traffic.outcomes if o.response_id and o.status == 200]
    checks = leak_checks(baseline, after, num_tenants=1, rss_slack_mib=opts.rss_slack_mib,
                         rss_samples=traffic.rss_samples)
    checks.append(Check("usage_rows", len(served), len(rows), len(served), exact=True))
    checks.append(Check("usage_rows_matching", len(served), len(set(rows) & set(served)),
                        len(served), exact=True))
    unexpected = [f"{o.phase} {o.kind} {o.status}: {o.detail}"
                  for o in traffic.outcomes if not o.expected]
    load = [o for o in traffic.outcomes if o.phase == "load" and o.expected]
    latency: dict[str, float] = {}
    for kind in ("plain", "stream"):
        times = sorted(o.latency_s for o in load if o.kind == kind)
        if times:
            latency[f"{kind}_p50_s"] = round(median(times), 3)
            latency[f"{kind}_p99_s"] = round(percentile(times, 99), 3)
    report = SoakReport(
        options=options_json(opts), machine=machine_description(), started_at=started_at,
        capacity_rps=round(capacity, 3), rate_rps=round(rate, 3),
        counts=dict(sorted(Counter(f"{o.phase} {o.kind} {o.status}"
                                   for o in traffic.outcomes).items())),
        latency=latency, rss_samples=traffic.rss_samples, unexpected=unexpected,
        skipped_arrivals=skipped,
        baseline=baseline, after=after, checks=checks, exit_code=exit_code,
        ok=all(c.ok for c in checks) and not unexpected and skipped == 0 and exit_code == 0,
    )
    _print_report(report)
    written = asdict(report)
    written["checks"] = [{**asdict(c), "ok": c.ok} for c in checks]
    save_report(written, "soak", opts.output)
    return report


def _print_report(report: SoakReport) -> None:
    for name, count in report.counts.items():
        print(f"{name:>28}: {count}")
    print(f"{'load latency':>28}: {json.dumps(report.latency)}")
    trace = ", ".join(f"{t:.0f}s {b / 2**20:.0f}" for t, b in report.rss_samples)
    print(f"{'RSS during the load (MiB)':>28}: {trace}")
    for check in report.checks:
        print(check.row())
    for line in report.unexpected[:20]:
        print(f"unexpected: {line}")
    print(f"skipped arrivals: {report.skipped_arrivals}; server exit code: {report.exit_code}")
    print("soak: OK" if report.ok else "soak: FAILED", flush=True)
