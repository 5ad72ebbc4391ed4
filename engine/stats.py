"""Counters an engine reports about its adapter cache (for /metrics and /admin/engine)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LatencyHistogram:
    """Cumulative histogram, the shape of a Prometheus histogram.

    NOTE: the +Inf bucket is implied rather than stored, so that the value is plain JSON
    (which has no infinity) on the worker wire.
    """

    finite_bounds: tuple[float, ...]  # bucket upper bounds, ascending, all finite
    # Observations <= each bound, then all of them (one more entry than finite_bounds).
    cumulative_counts: tuple[int, ...]
    sum: float  # seconds
    count: int

    def __post_init__(self) -> None:
        if not all(math.isfinite(b) for b in self.finite_bounds):
            raise ValueError(f"bounds must be finite, got {self.finite_bounds}")
        if len(self.cumulative_counts) != len(self.finite_bounds) + 1:
            raise ValueError("cumulative_counts needs one entry per bound and one for +Inf")

    @property
    def bounds(self) -> tuple[float, ...]:
        """Every bucket's upper bound, the last one math.inf."""
        return (*self.finite_bounds, math.inf)


@dataclass(frozen=True, slots=True)
class AdapterCacheStats:
    device_hits: int  # acquire found the adapter in a slot
    device_misses: int  # acquire installed it from its host copy
    loads: int  # disk loads started
    load_failures: int
    device_evictions: int
    host_evictions: int
    num_device: int  # slots holding an adapter
    num_host: int  # adapters in host memory
    num_loading: int  # loads in flight
    num_queued: int  # loads waiting for room on the host tier
    load_latency: LatencyHistogram  # durations of successful loads
    device_slots: int  # max_loras
    host_capacity: int  # max_cpu_loras
