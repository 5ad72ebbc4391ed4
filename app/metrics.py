"""Prometheus metrics: one registry per app, so several apps (tests) never share series."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.client import EngineClient, EngineStats
from engine.stats import AdapterCacheStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# Label values of routes; anything else is "other" so that scanners cannot blow up
# the number of series.
KNOWN_ROUTES = frozenset(
    {
        "/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/usage", "/v1/adapters",
        "/health", "/ready", "/metrics", "/admin/tenants", "/admin/adapters", "/admin/usage",
        "/admin/engine", "/admin/keys", "/admin/audit", "/admin/plans", "/admin/invoices",
        "/admin/ui", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    }
)


def route_label(path: str) -> str:
    """The known route a path is, or is under ("/admin/tenants/t1/keys" -> "/admin/tenants");
    "other" for anything else."""
    if path in KNOWN_ROUTES:
        return path
    parts = path.split("/")
    for end in range(len(parts) - 1, 1, -1):
        prefix = "/".join(parts[:end])
        if prefix in KNOWN_ROUTES:
            return prefix
    return "other"


# Gateway overhead: time a request spends outside the engine (auth, quotas, tokenizing,
# rendering); milliseconds matter here.
_OVERHEAD_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 1.0
)
# Label value of requests without a tenant (admin keys, --no-auth).
NO_TENANT = "-"


# An engine adapter name -> the name clients send in `model` for it (None: none).
AdapterNames = Callable[[str], str | None]


class _EngineCollector(Collector):
    """Reads the engine's counters at scrape time instead of mirroring them."""

    def __init__(self, engine: EngineClient, adapter_names: AdapterNames | None) -> None:
        self._engine = engine
        self._adapter_names = adapter_names

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        yield GaugeMetricFamily(
            "loraplex_num_requests_running",
            "Requests the engine is running (holding KV blocks).",
            value=stats.num_running,
        )
        yield GaugeMetricFamily(
            "loraplex_num_requests_waiting",
            "Requests waiting in the engine's queue.",
            value=stats.num_waiting,
        )
        yield GaugeMetricFamily(
            "loraplex_kv_cache_usage_ratio",
            "Fraction of KV cache blocks in use (0..1).",
            value=stats.kv_usage,
        )
        in_use_slots = (stats.num_total_blocks - stats.num_free_blocks) * stats.block_size
        yield GaugeMetricFamily(
            "loraplex_kv_cache_filled_ratio",
            "Of the slots in the KV blocks running requests hold, the fraction assigned to "
            "a token (1 - what paging wastes in each sequence's last block).",
            value=stats.kv_filled_slots / in_use_slots if in_use_slots else 1.0,
        )
        yield GaugeMetricFamily(
            "loraplex_kv_cache_free_blocks", "Free KV cache blocks.", value=stats.num_free_blocks
        )
        yield CounterMetricFamily(
            "loraplex_num_preemptions",
            "Requests preempted for lack of KV blocks.",
            value=stats.num_preemptions,
        )
        yield CounterMetricFamily(
            "loraplex_prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            value=stats.prefix_cache_hits,
        )
        yield CounterMetricFamily(
            "loraplex_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            value=stats.prefix_cache_queries,
        )
        yield from _structured_metrics(stats)
        yield GaugeMetricFamily(
            "loraplex_adapters_registered", "LoRA adapters served.", value=stats.num_adapters
        )
        yield CounterMetricFamily(
            "loraplex_engine_step_failures",
            "Engine steps whose forward or sampling raised (their requests were retried one "
            "by one and only those that failed on their own got a 500).",
            value=stats.num_step_failures,
        )
        yield CounterMetricFamily(
            "loraplex_engine_steps", "Engine steps that ran a batch.", value=stats.num_steps
        )
        yield CounterMetricFamily(
            "loraplex_engine_background_steps_cut",
            "Steps of background requests only (the batch tier, adapter evals) cut short "
            "between layers because a request of a higher tier arrived.",
            value=stats.num_steps_cut,
        )
        yield CounterMetricFamily(
            "loraplex_engine_step_seconds",
            "Time in engine steps that ran a batch (divided by loraplex_engine_steps_total: "
            "the mean step time).",
            value=stats.step_seconds,
        )
        yield GaugeMetricFamily(
            "loraplex_engine_failed",
            "1 once the engine failed for good (the process drains and exits).",
            value=0 if self._engine.failure() is None else 1,
        )
        if stats.weight_bytes:
            # An engine's own (a gateway's sum over workers has none: each worker reports).
            weights = GaugeMetricFamily(
                "loraplex_model_weight_bytes",
                "Bytes of the base model's weights as held (quantized layers at their "
                "size, packed copies included), labelled with the serving dtype and the "
                "quantization scheme.",
                labels=["dtype", "quantization"],
            )
            weights.add_metric([stats.dtype, stats.quantization], stats.weight_bytes)
            yield weights
        yield from _worker_metrics(self._engine)
        cache = stats.adapter_cache
        if cache is None:
            return
        yield from _adapter_cache_metrics(cache)
        yield self._lora_info(cache.device_slots)

    def _lora_info(self, max_lora: int) -> Metric:
        """The LoRA gauge of the Gateway API Inference Extension's model-server protocol
        (vLLM's `vllm:lora_requests_info`), for its endpoint picker's LoRA affinity: the
        adapters in device slots (ready to join a step) and those that waiting requests
        asked for, by the names clients send in `model`; its value, when this was read."""
        running: set[str] = set()
        waiting: set[str] = set()
        for place in self._engine.adapter_residency():
            label = place.name if self._adapter_names is None else self._adapter_names(place.name)
            if label is None:
                continue  # a version no longer served (still finishing requests)
            if place.slot is not None:
                running.add(label)
            if place.reservations:
                waiting.add(label)
        gauge = GaugeMetricFamily(
            "loraplex_lora_requests_info",
            "LoRA adapters in device slots (running_lora_adapters) and asked for by waiting "
            "requests (waiting_lora_adapters), comma separated, and the most the device "
            "holds (max_lora); the value is the time they were read (unix seconds).",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        gauge.add_metric(
            [str(max_lora), ",".join(sorted(running)), ",".join(sorted(waiting))], time.time()
        )
        return gauge


def _structured_metrics(stats: EngineStats) -> Iterator[Metric]:
    yield CounterMetricFamily(
        "loraplex_structured_requests",
        "Requests admitted with a structured output (JSON schema, regex, grammar, choice).",
        value=stats.num_structured_requests,
    )
    yield CounterMetricFamily(
        "loraplex_grammar_compiles",
        "Structured-output grammars compiled (cache misses that started a compile).",
        value=stats.grammar_compiles,
    )
    yield CounterMetricFamily(
        "loraplex_grammar_cache_hits",
        "Structured-output specs found compiled (or refused) in the grammar cache.",
        value=stats.grammar_cache_hits,
    )
    yield CounterMetricFamily(
        "loraplex_grammar_cache_misses",
        "Structured-output specs that waited for a compile (their own or one running).",
        value=stats.grammar_cache_misses,
    )
    yield CounterMetricFamily(
        "loraplex_grammar_refusals",
        "Structured-output specs refused when compiled (invalid, or past a limit).",
        value=stats.grammar_refusals,
    )
    yield CounterMetricFamily(
        "loraplex_grammar_compile_timeouts",
        "Structured-output compiles refused for taking longer than the compile timeout.",
        value=stats.grammar_timeouts,
    )
    yield CounterMetricFamily(
        "loraplex_grammar_compile_seconds",
        "Time spent compiling structured-output grammars.",
        value=stats.grammar_compile_s,
    )


def _worker_metrics(engine: EngineClient) -> Iterator[Metric]:
    """A gateway's engine is a pool of workers: how many take requests right now. (The
    in-process engine's one worker has no rotation: no series.)"""
    reports = [w for w in engine.workers() if w.in_rotation is not None]
    if not reports:
        return
    workers = GaugeMetricFamily(
        "loraplex_workers",
        "Engine workers with a live heartbeat, in rotation or out of it (after a failure).",
        labels=["state"],
    )
    in_rotation = sum(1 for r in reports if r.in_rotation)
    workers.add_metric(["in_rotation"], in_rotation)
    workers.add_metric(["out_of_rotation"], len(reports) - in_rotation)
    yield workers


def _adapter_cache_metrics(cache: AdapterCacheStats) -> Iterator[Metric]:
    residency = GaugeMetricFamily(
        "loraplex_adapters_resident",
        "Adapters resident per cache tier (device slots, host memory).",
        labels=["tier"],
    )
    residency.add_metric(["device"], cache.num_device)
    residency.add_metric(["host"], cache.num_host)
    yield residency
    capacity = GaugeMetricFamily(
        "loraplex_adapter_cache_capacity", "Adapters each cache tier holds.", labels=["tier"]
    )
    capacity.add_metric(["device"], cache.device_slots)
    capacity.add_metric(["host"], cache.host_capacity)
    yield capacity
    lookups = CounterMetricFamily(
        "loraplex_adapter_cache_lookups",
        "Adapter slot lookups when a request starts running: hit (already in a device "
        "slot) or miss (copied in from host memory).",
        labels=["result"],
    )
    lookups.add_metric(["hit"], cache.device_hits)
    lookups.add_metric(["miss"], cache.device_misses)
    yield lookups
    yield CounterMetricFamily(
        "loraplex_adapter_loads", "Adapter loads from disk started.", value=cache.loads
    )
    yield CounterMetricFamily(
        "loraplex_adapter_load_failures", "Adapter loads from disk that failed.",
        value=cache.load_failures,
    )
    evictions = CounterMetricFamily(
        "loraplex_adapter_evictions", "Adapters evicted per cache tier.", labels=["tier"]
    )
    evictions.add_metric(["device"], cache.device_evictions)
    evictions.add_metric(["host"], cache.host_evictions)
    yield evictions
    yield GaugeMetricFamily(
        "loraplex_adapter_loads_in_progress",
        "Adapter loads from disk running or queued.",
        value=cache.num_loading + cache.num_queued,
    )
    buckets = [
        ("+Inf" if bound == float("inf") else repr(float(bound)), count)
        for bound, count in zip(
            cache.load_latency.bounds, cache.load_latency.cumulative_counts, strict=True
        )
    ]
    yield HistogramMetricFamily(
        "loraplex_adapter_load_seconds",
        "Time from disk to host memory of adapter loads (read and validation).",
        buckets=buckets,
        sum_value=cache.load_latency.sum,
    )


class ServiceProbe(Protocol):
    @property
    def num_pending(self) -> int: ...


class DirectoryProbe(Protocol):
    def seconds_since_refresh(self) -> float: ...


class _ServiceCollector(Collector):
    def __init__(self, usage: ServiceProbe, directory: DirectoryProbe) -> None:
        self._usage = usage
        self._directory = directory

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "loraplex_usage_records_pending",
            "Usage records not yet in the database (in memory or in the local spool).",
            value=self._usage.num_pending,
        )
        yield GaugeMetricFamily(
            "loraplex_directory_staleness_seconds",
            "Seconds since keys, tenants and adapters were last refreshed from the database.",
            value=self._directory.seconds_since_refresh(),
        )


class Metrics:
    """adapter_names: the engine's adapter names as clients name them (a gateway's
    registry versions); None: the engine's own names (a worker's)."""

    def __init__(self, engine: EngineClient, adapter_names: AdapterNames | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, adapter_names))
        self.tenant_requests = Counter(
            "loraplex_tenant_requests",
            "API generation requests by tenant, model (base or adapter name) and status "
            "(ok, aborted, error).",
            ["tenant", "model", "status"],
            registry=self.registry,
        )
        self.tenant_tokens = Counter(
            "loraplex_tenant_tokens",
            "Billed tokens by tenant, model and kind (prompt, completion).",
            ["tenant", "model", "kind"],
            registry=self.registry,
        )
        self.rejections = Counter(
            "loraplex_rejections",
            "Generation requests refused before they ran, by tenant and reason (rpm, tpm, "
            "concurrency, monthly_tokens, max_tokens_exceeded, model_not_found, ...).",
            ["tenant", "reason"],
            registry=self.registry,
        )
        self.gateway_overhead = Histogram(
            "loraplex_gateway_overhead_seconds",
            "Time a generation request spends outside the engine, by tenant.",
            ["tenant"],
            buckets=_OVERHEAD_BUCKETS,
            registry=self.registry,
        )
        self.quota_fail_open = Counter(
            "loraplex_quota_fail_open",
            "Admissions decided by the per-process limiter because Redis was unavailable.",
            registry=self.registry,
        )
        self.usage_db_errors = Counter(
            "loraplex_usage_db_errors",
            "Failed attempts to write usage records to the database (they stay spooled).",
            registry=self.registry,
        )
        self.http_requests = Counter(
            "loraplex_http_requests",
            "HTTP requests by route and status code.",
            ["route", "status"],
            registry=self.registry,
        )
        self.requests_finished = Counter(
            "loraplex_requests_finished",
            "Engine requests (one per choice) by finish reason.",
            ["finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "loraplex_prompt_tokens", "Prompt tokens of engine requests.", registry=self.registry
        )
        self.generation_tokens = Counter(
            "loraplex_generation_tokens", "Generated tokens.", registry=self.registry
        )
        # Per model (the base model id or an adapter name): requests and tokens.
        self.model_requests = Counter(
            "loraplex_model_requests",
            "Engine requests (one per choice) finished, by model or adapter.",
            ["model"],
            registry=self.registry,
        )
        self.model_prompt_tokens = Counter(
            "loraplex_model_prompt_tokens",
            "Prompt tokens by model or adapter.",
            ["model"],
            registry=self.registry,
        )
        self.model_generation_tokens = Counter(
            "loraplex_model_generation_tokens",
            "Generated tokens by model or adapter.",
            ["model"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "loraplex_time_to_first_token_seconds",
            "Time from the request's arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "loraplex_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.",
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "loraplex_e2e_request_latency_seconds",
            "Time from the request's arrival to its last token.",
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )

    def watch_services(self, usage: ServiceProbe, directory: DirectoryProbe) -> None:
        self.registry.register(_ServiceCollector(usage, directory))

    def observe_tenant_request(
        self,
        *,
        tenant: str | None,
        model: str,
        status: str,
        prompt_tokens: int,
        completion_tokens: int,
        gateway_overhead_s: float,
    ) -> None:
        tenant = tenant or NO_TENANT
        self.tenant_requests.labels(tenant=tenant, model=model, status=status).inc()
        self.tenant_tokens.labels(tenant=tenant, model=model, kind="prompt").inc(prompt_tokens)
        self.tenant_tokens.labels(tenant=tenant, model=model, kind="completion").inc(
            completion_tokens
        )
        self.gateway_overhead.labels(tenant=tenant).observe(gateway_overhead_s)

    def observe_rejection(self, *, tenant: str | None, reason: str) -> None:
        self.rejections.labels(tenant=tenant or NO_TENANT, reason=reason).inc()

    def observe_quota_fail_open(self, reason: str = "") -> None:
        self.quota_fail_open.inc()

    def observe_usage_db_error(self, exc: BaseException | None = None) -> None:
        self.usage_db_errors.inc()

    def observe_http(self, path: str, status: int) -> None:
        self.http_requests.labels(route=route_label(path), status=str(status)).inc()

    def observe_request(
        self,
        *,
        arrival: float,
        first_token: float | None,
        finished: float,
        num_prompt_tokens: int,
        num_output_tokens: int,
        finish_reason: str,
        model: str | None = None,
    ) -> None:
        """One engine request (one choice) is over; times are `time.monotonic()` values.
        `model`: the base model id or adapter name it ran on."""
        self.requests_finished.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        if model is not None:
            self.model_requests.labels(model=model).inc()
            self.model_prompt_tokens.labels(model=model).inc(num_prompt_tokens)
            self.model_generation_tokens.labels(model=model).inc(num_output_tokens)
        if first_token is None:
            return
        self.time_to_first_token.observe(first_token - arrival)
        self.e2e_latency.observe(finished - arrival)
        if num_output_tokens > 1:
            self.time_per_output_token.observe((finished - first_token) / (num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
