"""What the server reports while `loraplex bench serve` loads it: loraplex's `/metrics`
gauges and prefix-cache counters, and the resident memory of a server process the
benchmark started, sampled in the background."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.server import tree_memory_bytes

KV_USAGE = "loraplex_kv_cache_usage_ratio"
RUNNING = "loraplex_num_requests_running"
WAITING = "loraplex_num_requests_waiting"
PREFIX_HITS = "loraplex_prefix_cache_hits_total"  # prompt tokens served from the cache
PREFIX_QUERIES = "loraplex_prefix_cache_queries_total"  # prompt tokens looked up
# Of the slots in the blocks running requests hold, the fraction holding their KV.
KV_FILLED = "loraplex_kv_cache_filled_ratio"
STEPS = "loraplex_engine_steps_total"
STEP_SECONDS = "loraplex_engine_step_seconds_total"
_SERIES = (KV_USAGE, RUNNING, WAITING, PREFIX_HITS, PREFIX_QUERIES, KV_FILLED, STEPS,
           STEP_SECONDS)


@dataclass(slots=True)
class Sample:
    t_s: float  # from the monitor's start
    metrics: dict[str, float] = field(default_factory=dict)  # only the series above
    rss_bytes: int | None = None
    hwm_bytes: int | None = None  # VmHWM: the server's peak RSS since it started


@dataclass(slots=True)
class MonitorSummary:
    num_samples: int
    kv_usage_mean: float | None = None
    kv_usage_max: float | None = None
    running_mean: float | None = None
    running_max: float | None = None
    waiting_mean: float | None = None
    waiting_max: float | None = None
    prefix_cache_hit_rate: float | None = None  # hit tokens / looked-up tokens in the run
    prefix_cache_queried_tokens: int | None = None
    # Slots holding KV / slots of the blocks held, while requests ran (KV in use at all).
    kv_filled_mean: float | None = None
    kv_filled_min: float | None = None
    mean_step_s: float | None = None  # the engine's steps over the run
    rss_peak_mib: float | None = None
    rss_end_mib: float | None = None
    # The peak since the server started (its load included), not only in the run.
    rss_peak_since_start_mib: float | None = None


def parse_metrics(text: str) -> dict[str, float]:
    """The unlabelled samples of the series this benchmark follows."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _SERIES and not sample.labels:
                values[sample.name] = float(sample.value)
    return values


def read_memory_bytes(pid: int) -> dict[str, int] | None:
    """VmRSS and VmHWM (the peak so far) of a live process and the processes below it
    (Linux), None once it is gone."""
    try:
        return tree_memory_bytes(pid)
    except OSError:
        return None


class ServerMonitor:
    """`async with ServerMonitor(...) as monitor:` samples every `interval_s` until the
    block ends, and once more at its end; `summary()` then describes the run."""

    def __init__(self, client: httpx.AsyncClient, *, pid: int | None,
                 interval_s: float = 0.5) -> None:
        self._client = client
        self._pid = pid
        self._interval_s = interval_s
        self._scrape = True
        self._start = time.perf_counter()
        self._task: asyncio.Task[None] | None = None
        self.samples: list[Sample] = []

    async def __aenter__(self) -> ServerMonitor:
        self._start = time.perf_counter()
        await self._sample()  # the counters' values before the run
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._sample()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self._sample()

    async def _sample(self) -> None:
        sample = Sample(t_s=time.perf_counter() - self._start)
        if self._scrape:
            sample.metrics = await self._metrics()
            # A server without loraplex's series (another product): RSS only from now on.
            self._scrape = KV_USAGE in sample.metrics
        if self._pid is not None:
            memory = read_memory_bytes(self._pid) or {}
            sample.rss_bytes, sample.hwm_bytes = memory.get("VmRSS"), memory.get("VmHWM")
        self.samples.append(sample)

    async def _metrics(self) -> dict[str, float]:
        try:
            response = await self._client.get("/metrics", timeout=10)
            return parse_metrics(response.text) if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):  # ValueError: not Prometheus text
            return {}

    @property
    def has_data(self) -> bool:
        """Whether the server told anything: loraplex metrics, or its RSS."""
        return any(s.metrics or s.rss_bytes is not None for s in self.samples)

    def summary(self) -> MonitorSummary:
        return summarize_samples(self.samples)


def summarize_samples(samples: list[Sample]) -> MonitorSummary:
    summary = MonitorSummary(num_samples=len(samples))
    # The first and last samples are taken before and after the load: gauges skip them.
    during = samples[1:-1] or samples
    summary.kv_usage_mean, summary.kv_usage_max = _mean_max(during, KV_USAGE)
    summary.running_mean, summary.running_max = _mean_max(during, RUNNING)
    summary.waiting_mean, summary.waiting_max = _mean_max(during, WAITING)
    with_counters = [s.metrics for s in samples if PREFIX_QUERIES in s.metrics
                     and PREFIX_HITS in s.metrics]
    if len(with_counters) >= 2:
        queries = with_counters[-1][PREFIX_QUERIES] - with_counters[0][PREFIX_QUERIES]
        hits = with_counters[-1][PREFIX_HITS] - with_counters[0][PREFIX_HITS]
        summary.prefix_cache_queried_tokens = int(queries)
        summary.prefix_cache_hit_rate = round(hits / queries, 4) if queries > 0 else None
    filled = [s.metrics[KV_FILLED] for s in during
              if KV_FILLED in s.metrics and s.metrics.get(KV_USAGE, 0.0) > 0]
    if filled:
        summary.kv_filled_mean = round(statistics.fmean(filled), 4)
        summary.kv_filled_min = round(min(filled), 4)
    with_steps = [s.metrics for s in samples if STEPS in s.metrics and STEP_SECONDS in s.metrics]
    if len(with_steps) >= 2:
        steps = with_steps[-1][STEPS] - with_steps[0][STEPS]
        seconds = with_steps[-1][STEP_SECONDS] - with_steps[0][STEP_SECONDS]
        summary.mean_step_s = round(seconds / steps, 5) if steps > 0 else None
    rss = [s.rss_bytes for s in samples if s.rss_bytes is not None]
    if rss:
        summary.rss_peak_mib = round(max(rss) / 2**20, 1)
        summary.rss_end_mib = round(rss[-1] / 2**20, 1)
    hwm = [s.hwm_bytes for s in samples if s.hwm_bytes is not None]
    if hwm:
        summary.rss_peak_since_start_mib = round(max(hwm) / 2**20, 1)
    return summary


def _mean_max(samples: list[Sample], name: str) -> tuple[float | None, float | None]:
    values = [s.metrics[name] for s in samples if name in s.metrics]
    if not values:
        return None, None
    return round(statistics.fmean(values), 4), round(max(values), 4)
