"""The figures of one rate of `loraplex bench serve`: throughput, latency percentiles
and goodput against service-level objectives."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass

from bench.harness.workload import percentile
from bench.serve.client import RequestRecord
from bench.serve.monitor import MonitorSummary


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.2

    def met_by(self, record: RequestRecord) -> bool:
        """A request that succeeded with both its TTFT and its TPOT within the objectives
        (a request of one token has no TPOT: its TTFT decides)."""
        if not record.ok or record.ttft_s is None or record.ttft_s > self.ttft_s:
            return False
        tpot = record.tpot_s
        return tpot is None or tpot <= self.tpot_s


@dataclass(frozen=True, slots=True)
class Distribution:
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
        if not values:
            return cls(*[math.nan] * 5)
        ordered = sorted(values)
        p50, p90, p99 = (percentile(ordered, p) for p in (50, 90, 99))
        return cls(statistics.fmean(ordered), p50, p90, p99, ordered[-1])

    def to_json(self) -> dict[str, float | None]:
        return {k: _finite(v) for k, v in asdict(self).items()}


# How many decimals a report keeps of each figure.
_DIGITS = {"duration_s": 3, "request_throughput": 4, "output_throughput": 2, "goodput": 4,
           "goodput_fraction": 4, "send_lag_max_s": 4}


@dataclass(slots=True)
class RateSummary:
    rate: float  # requests/s offered; inf: all at once
    num_requests: int
    num_completed: int
    num_errors: int
    errors: dict[str, int]  # error -> how many requests got it
    duration_s: float
    request_throughput: float  # completed requests/s
    output_throughput: float  # output tokens/s of completed requests
    total_output_tokens: int
    total_prompt_tokens: int
    goodput: float  # requests/s within both objectives
    goodput_fraction: float  # of all requests sent
    send_lag_max_s: float  # the client's worst delay past a scheduled arrival
    ttft_s: Distribution
    tpot_s: Distribution
    itl_s: Distribution
    e2e_s: Distribution
    server: MonitorSummary | None = None

    @property
    def rate_label(self) -> str:
        return rate_label(self.rate)

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["rate"] = self.rate_label if math.isinf(self.rate) else self.rate
        for name, digits in _DIGITS.items():
            out[name] = round(out[name], digits)
        for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            out[name] = getattr(self, name).to_json()
        return out


def summarize(rate: float, records: list[RequestRecord], duration_s: float, slo: SLO,
              server: MonitorSummary | None = None) -> RateSummary:
    ok = [r for r in records if r.ok]
    errors = Counter(r.error for r in records if r.error is not None)
    met = sum(1 for r in records if slo.met_by(r))
    output_tokens = sum(r.output_tokens for r in ok)
    return RateSummary(
        rate=rate, num_requests=len(records), num_completed=len(ok),
        num_errors=len(records) - len(ok), errors=dict(errors.most_common(10)),
        duration_s=duration_s,
        request_throughput=_per_s(len(ok), duration_s),
        output_throughput=_per_s(output_tokens, duration_s),
        total_output_tokens=output_tokens,
        total_prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
        ttft_s=Distribution.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_s=Distribution.of([t for r in ok if (t := r.tpot_s) is not None]),
        itl_s=Distribution.of([gap for r in ok for gap in r.itl_s]),
        e2e_s=Distribution.of([r.e2e_s for r in ok if r.e2e_s is not None]),
        goodput=_per_s(met, duration_s),
        goodput_fraction=met / len(records) if records else 0.0,
        send_lag_max_s=max((r.sent_s - r.scheduled_s for r in records), default=0.0),
        server=server,
    )


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _per_s(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 5)
