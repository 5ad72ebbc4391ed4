"""`loraplex bench gateway`: what the gateway adds to a request, against an instant engine.

Two servers run in subprocesses (their own interpreters, so the load generator does
not share their GIL), each `create_app(FakeEngine.instant_engine(), Settings(...))`
behind uvicorn as `loraplex serve` runs it: one with API keys, Redis quotas and metering
("keys"), one with `no_auth` (no key lookup, no quotas; metering still on). Scenarios,
alternating:

- `health`: open-loop `GET /health`, the HTTP + client floor of this machine;
- `chat`: open-loop `POST /v1/chat/completions` with a tenant key (auth, Redis
  admission and settle, tokenizing, rendering, a usage row through the outbox);
- `chat-no-auth`: the same on the no-auth server;
- `chat-sustained`: closed loop, `concurrency` workers back to back on the keys server.

Added latency = a chat scenario's p50 (p99) minus the baseline's p50 (p99). Each run
also reports the CPU time per request of the server process (from /proc) and of the
load generator, and the server's own mean `loraplex_gateway_overhead_seconds`. After
the run the servers get SIGTERM (the usage outbox flushes) and the usage rows are
counted against the 200 responses.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.engine import make_url

from bench.gateway.load import Probe, Samples, closed_loop, make_client, open_loop
from bench.gateway.server import Server, UsageCheck, check_usage, running_servers
from bench.harness.options import internal, opt
from bench.harness.report import ReportHead, machine_description, options_json, save_report
from bench.harness.server import prepare_stores
from bench.harness.workload import percentile

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/13"
SCENARIOS = ("health", "chat", "chat-no-auth", "chat-sustained")
AIM_ADDED_P50_MS = 5.0
_CHAT_MESSAGES = [{"role": "user", "content": "Say hello to the gateway benchmark."}]


@dataclass(slots=True)
class GatewayOptions:
    rate: float = opt(200.0, "open-loop requests/s")
    duration_s: float = opt(10.0, "seconds per measured run")
    warmup_s: float = opt(1.0, "seconds of the same load before each run")
    concurrency: int = opt(32, "closed-loop workers")
    repeats: int = opt(3, "alternating rounds")
    max_tokens: int = 16
    client: str = opt(
        "raw", "the load generator's HTTP client (raw: minimal keep-alive HTTP/1.1)",
        choices=("raw", "httpx"))
    # None: a fresh SQLite file per server; else this (migrated here) database for both.
    database_url: str | None = opt(
        None, "a fresh database both servers share (migrated first)",
        shown="SQLite files in a temporary directory")
    redis_url: str = opt(
        DEFAULT_REDIS_URL, "the quota store; this Redis database is FLUSHED before the run")
    output: Path | None = opt(None, "JSON report", shown="bench/results/gateway-<timestamp>.json")
    quiet: bool = internal(False)


@dataclass(slots=True)
class ScenarioRun:
    scenario: str
    repeat: int
    mode: str  # "open" (fixed schedule) | "closed" (workers back to back)
    target_rate: float | None
    concurrency: int | None
    num_sent: int
    num_ok: int
    num_errors: int
    achieved_rate: float  # successful (HTTP 200) responses per second of the run
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    server_cpu_ms_per_request: float | None  # the server process's CPU time / requests
    client_cpu_ms_per_request: float  # this (load generator) process's CPU time / requests
    server_overhead_mean_ms: float | None  # loraplex_gateway_overhead_seconds sum / count
    errors: list[str] = field(default_factory=list)  # the first few


@dataclass(slots=True)
class ScenarioSummary:
    scenario: str
    best: ScenarioRun  # the run with the lowest p50
    median_p50_ms: float
    median_p99_ms: float
    median_rate: float
    median_server_cpu_ms: float | None
    median_overhead_ms: float | None


@dataclass(slots=True)
class AddedLatency:
    """A chat scenario minus the `health` baseline."""

    scenario: str
    best_p50_ms: float  # best run minus best baseline run
    best_p99_ms: float
    median_p50_ms: float  # median of runs minus median of baseline runs
    median_p99_ms: float


@dataclass(slots=True)
class GatewayReport(ReportHead):
    runs: list[ScenarioRun]
    summaries: list[ScenarioSummary]
    added: list[AddedLatency]
    checks: list[UsageCheck]
    aim_met: bool  # median added p50 of `chat` under AIM_ADDED_P50_MS at the target rate

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "checks": [{**asdict(c), "ok": c.ok} for c in self.checks]}


# ------------------------------------------------------------------- measuring


async def scrape_overhead(base_url: str) -> tuple[float, float]:
    """(sum, count) of loraplex_gateway_overhead_seconds over every tenant."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        text = (await client.get("/metrics")).text
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "loraplex_gateway_overhead_seconds":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
    return total, count


async def measure(scenario: str, repeat: int, server: Server, probe: Probe,
                  opts: GatewayOptions) -> ScenarioRun:
    """Warm up, then one measured run (a fresh client: its connections open in the warm-up)."""
    closed = scenario == "chat-sustained"
    client = make_client(opts.client, server.base_url,
                         max_connections=max(opts.concurrency, 256))

    async def load(duration_s: float) -> Samples:
        if closed:
            return await closed_loop(client, probe, opts.concurrency, duration_s)
        return await open_loop(client, probe, opts.rate, duration_s)

    try:
        await load(opts.warmup_s)
        overhead_before = await scrape_overhead(server.base_url)
        cpu_before = server.cpu_seconds()
        client_before = time.process_time()
        samples = await load(opts.duration_s)
        client_cpu_s = time.process_time() - client_before
        cpu_after = server.cpu_seconds()
        overhead_after = await scrape_overhead(server.base_url)
    finally:
        await client.aclose()
    num_ok = len(samples.latencies_s)
    num_sent = num_ok + samples.num_errors
    ms = sorted(x * 1000 for x in samples.latencies_s)
    overhead_count = overhead_after[1] - overhead_before[1]
    return ScenarioRun(
        scenario=scenario, repeat=repeat, mode="closed" if closed else "open",
        target_rate=None if closed else opts.rate,
        concurrency=opts.concurrency if closed else None,
        num_sent=num_sent, num_ok=num_ok, num_errors=samples.num_errors,
        achieved_rate=num_ok / samples.wall_s if samples.wall_s > 0 else 0.0,
        p50_ms=percentile(ms, 50), p90_ms=percentile(ms, 90), p99_ms=percentile(ms, 99),
        max_ms=ms[-1] if ms else float("nan"),
        server_cpu_ms_per_request=(
            None if cpu_before is None or cpu_after is None or not num_sent
            else (cpu_after - cpu_before) * 1000 / num_sent
        ),
        client_cpu_ms_per_request=client_cpu_s * 1000 / max(num_sent, 1),
        server_overhead_mean_ms=(
            (overhead_after[0] - overhead_before[0]) * 1000 / overhead_count
            if overhead_count else None
        ),
        errors=samples.errors,
    )


def probes(keys: Server, no_auth: Server, max_tokens: int) -> dict[str, tuple[Server, Probe]]:
    body = {"model": "instant", "messages": _CHAT_MESSAGES, "max_tokens": max_tokens}
    chat = Probe("POST", "/v1/chat/completions", body, keys.headers, keys.ok_ids)
    return {
        "health": (keys, Probe("GET", "/health", None, {})),
        "chat": (keys, chat),
        "chat-no-auth": (no_auth, Probe("POST", chat.path, body, {}, no_auth.ok_ids)),
        "chat-sustained": (keys, chat),
    }


async def measure_all(keys: Server, no_auth: Server, opts: GatewayOptions) -> list[ScenarioRun]:
    """Every scenario once per repeat, the order rotated each repeat so that no scenario
    always runs first (or right after another) on the shared machine."""
    by_name = probes(keys, no_auth, opts.max_tokens)
    runs: list[ScenarioRun] = []
    for repeat in range(opts.repeats):
        for i in range(len(SCENARIOS)):
            scenario = SCENARIOS[(i + repeat) % len(SCENARIOS)]
            server, probe = by_name[scenario]
            run = await measure(scenario, repeat, server, probe, opts)
            runs.append(run)
            if not opts.quiet:
                print(_row(run), flush=True)
    return runs


def summarize(runs: list[ScenarioRun]) -> list[ScenarioSummary]:
    summaries = []
    for scenario in SCENARIOS:
        mine = [r for r in runs if r.scenario == scenario]
        if not mine:
            continue
        cpu = [r.server_cpu_ms_per_request for r in mine if r.server_cpu_ms_per_request is not None]
        overhead = [r.server_overhead_mean_ms for r in mine
                    if r.server_overhead_mean_ms is not None]
        summaries.append(ScenarioSummary(
            scenario=scenario,
            best=min(mine, key=lambda r: r.p50_ms),
            median_p50_ms=statistics.median(r.p50_ms for r in mine),
            median_p99_ms=statistics.median(r.p99_ms for r in mine),
            median_rate=statistics.median(r.achieved_rate for r in mine),
            median_server_cpu_ms=statistics.median(cpu) if cpu else None,
            median_overhead_ms=statistics.median(overhead) if overhead else None,
        ))
    return summaries


def added_latency(summaries: list[ScenarioSummary]) -> list[AddedLatency]:
    by_name = {s.scenario: s for s in summaries}
    base = by_name["health"]
    return [
        AddedLatency(
            scenario=name,
            best_p50_ms=s.best.p50_ms - base.best.p50_ms,
            best_p99_ms=s.best.p99_ms - base.best.p99_ms,
            median_p50_ms=s.median_p50_ms - base.median_p50_ms,
            median_p99_ms=s.median_p99_ms - base.median_p99_ms,
        )
        for name in ("chat", "chat-no-auth")
        if (s := by_name.get(name)) is not None
    ]


def run_gateway(opts: GatewayOptions) -> GatewayReport:
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S")
    prepare_stores(opts.database_url, opts.redis_url)
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-gateway-") as tmp:
        with running_servers(Path(tmp), database_url=opts.database_url,
                             redis_url=opts.redis_url) as (keys, no_auth):
            if not opts.quiet:
                print(_HEADER, flush=True)
            runs = asyncio.run(measure_all(keys, no_auth, opts))
        checks = [check_usage(s, opts.max_tokens) for s in (keys, no_auth)]
    summaries = summarize(runs)
    added = added_latency(summaries)
    chat = next(s for s in summaries if s.scenario == "chat")
    options = options_json(opts, exclude=("output", "quiet"))
    if opts.database_url is not None:
        options["database_url"] = make_url(opts.database_url).render_as_string()  # no password
    report = GatewayReport(
        options=options, machine=machine_description(), started_at=started_at, runs=runs,
        summaries=summaries, added=added, checks=checks,
        aim_met=(
            next(a for a in added if a.scenario == "chat").median_p50_ms < AIM_ADDED_P50_MS
            and chat.median_rate >= 0.95 * opts.rate
            and all(r.num_errors == 0 for r in runs if r.scenario == "chat")
        ),
    )
    if not opts.quiet:
        print_report(report)
    save_report(report.to_json(), "gateway", opts.output)
    return report


# ------------------------------------------------------------------- output


_HEADER = (f"{'scenario':<15} {'#':>2} {'mode':<6} {'req/s':>7} {'p50 ms':>7} {'p90 ms':>7} "
           f"{'p99 ms':>7} {'max ms':>7} {'ok':>6} {'err':>4} {'srv cpu':>8} {'cli cpu':>8} "
           f"{'srv ovh':>8}")


def _opt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _row(run: ScenarioRun) -> str:
    return (f"{run.scenario:<15} {run.repeat:>2} {run.mode:<6} {run.achieved_rate:>7.1f} "
            f"{run.p50_ms:>7.2f} {run.p90_ms:>7.2f} {run.p99_ms:>7.2f} {run.max_ms:>7.1f} "
            f"{run.num_ok:>6} {run.num_errors:>4} {_opt(run.server_cpu_ms_per_request):>8} "
            f"{run.client_cpu_ms_per_request:>8.2f} {_opt(run.server_overhead_mean_ms):>8}")


def print_report(report: GatewayReport) -> None:
    print("\n(srv cpu / cli cpu: CPU ms per request of the server / of this load generator;"
          " srv ovh: mean gateway overhead the server measured, ms)\n")
    print("best run (lowest p50) and median of runs:")
    for s in report.summaries:
        print(f"  {s.scenario:<15} best p50 {s.best.p50_ms:6.2f} p99 {s.best.p99_ms:6.2f} | "
              f"median p50 {s.median_p50_ms:6.2f} p99 {s.median_p99_ms:6.2f} "
              f"rate {s.median_rate:7.1f}/s srv cpu {_opt(s.median_server_cpu_ms)} ms")
    print("added latency (scenario minus `health`, ms):")
    for a in report.added:
        print(f"  {a.scenario:<15} best p50 {a.best_p50_ms:+6.2f} p99 {a.best_p99_ms:+6.2f} | "
              f"median p50 {a.median_p50_ms:+6.2f} p99 {a.median_p99_ms:+6.2f}")
    for c in report.checks:
        print(f"usage rows, {c.server}: {c.rows} rows, {c.rows_matching} matching, "
              f"{c.responses_ok} responses, {c.completion_tokens} completion tokens "
              f"(expected {c.expected_completion_tokens}): {'ok' if c.ok else 'MISMATCH'}")
    verdict = "met" if report.aim_met else "NOT met"
    print(f"aim (median added p50 < {AIM_ADDED_P50_MS:g} ms at the target rate): {verdict}")

