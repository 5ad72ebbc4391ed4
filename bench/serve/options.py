"""The options of `loraplex bench serve`, and reading them from the command line."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from bench.harness.report import jsonable
from bench.serve.stats import SLO, rate_label
from bench.serve.workload import parse_rates

DEFAULT_NUM_REQUESTS = 64


@dataclass(slots=True)
class ServeOptions:
    base_url: str | None = None  # None: start `loraplex serve` here
    model: str | None = None  # None: "default" when started here, else the server's first
    adapter_models: dict[str, str] = field(default_factory=dict)  # lora-i -> served name
    api_key: str | None = None
    vocab_size: int | None = None  # None: from the local model's config
    rates: list[float] = field(default_factory=lambda: [1.0])
    burstiness: float = 1.0
    num_requests: int | None = None  # per rate; None: DEFAULT_NUM_REQUESTS without duration
    duration_s: float | None = None  # per rate, of arrivals
    max_concurrency: int | None = None
    prompt_len: tuple[int, int] = (64, 512)
    output_len: tuple[int, int] = (32, 128)
    dataset: Path | None = None
    num_adapters: int = 0
    adapter_dist: str = "uniform"
    zipf_alpha: float = 1.0
    shared_prefix_fraction: float = 0.0
    shared_prefix_len: int = 256
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.2
    seed: int = 0
    request_timeout_s: float = 600.0
    metrics_interval_s: float = 0.5
    ignore_eos: bool = True
    serve_args: list[str] = field(default_factory=list)
    adapters_root: Path = Path("bench/results/adapters")  # generated once, then reused
    output: Path | None = None  # None: bench/results/serve-<timestamp>.json
    plot: Path | None = None

    @property
    def slo(self) -> SLO:
        return SLO(ttft_s=self.slo_ttft_s, tpot_s=self.slo_tpot_s)

    @property
    def adapter_names(self) -> list[str]:
        return [f"lora-{i}" for i in range(self.num_adapters)]

    @property
    def requests_per_rate(self) -> int | None:
        """The cap on each rate's requests; None: only the duration bounds a run."""
        if self.num_requests is None and self.duration_s is None:
            return DEFAULT_NUM_REQUESTS
        return self.num_requests

    def validate(self) -> None:
        """ValueError on options no run can use."""
        if not self.rates or not all(rate > 0 for rate in self.rates):
            raise ValueError("request rates must be > 0 (or inf)")
        if math.inf in self.rates and self.requests_per_rate is None:
            raise ValueError("rate inf needs --num-requests")
        if not 0.0 <= self.shared_prefix_fraction <= 1.0:
            raise ValueError("--shared-prefix-fraction must be within 0..1")
        if self.shared_prefix_fraction and self.shared_prefix_len < 1:
            raise ValueError("--shared-prefix-len must be >= 1")
        for name, value in (("--num-requests", self.num_requests),
                            ("--max-concurrency", self.max_concurrency)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_adapters < 0:
            raise ValueError("--num-adapters must be >= 0")
        if self.burstiness <= 0:
            raise ValueError("--burstiness must be > 0")
        if self.base_url is None and self.adapter_models:
            raise ValueError("--adapter-model maps names on another server: give --base-url")
        unknown = sorted(set(self.adapter_models) - set(self.adapter_names))
        if unknown:
            raise ValueError(f"--adapter-model {unknown[0]}: the adapters sent are lora-0 .. "
                             f"lora-{self.num_adapters - 1} (--num-adapters)")
        if self.adapter_dist not in ("uniform", "zipf"):
            raise ValueError(f"unknown adapter distribution {self.adapter_dist!r}")

    def to_json(self) -> dict[str, Any]:
        out = {f.name: jsonable(getattr(self, f.name)) for f in fields(self)}
        out["rates"] = [rate_label(r) if math.isinf(r) else r for r in self.rates]
        out["api_key"] = None if self.api_key is None else "<set>"  # never in a report
        return out


def options_from_cli(
    *, rates: Sequence[str], prompt_len: str, output_len: str, adapter_models: Sequence[str],
    serve_args: Sequence[str], **kwargs: Any,
) -> ServeOptions:
    """ServeOptions from the command line's strings; ValueError names a bad one."""
    return ServeOptions(
        rates=parse_rates(rates),
        prompt_len=parse_length_range(prompt_len, "--prompt-len"),
        output_len=parse_length_range(output_len, "--output-len"),
        adapter_models=dict(_name_pair(pair) for pair in adapter_models),
        serve_args=[a for arg in serve_args for a in arg.split()],
        **kwargs,
    )


def parse_length_range(value: str, option: str) -> tuple[int, int]:
    """"N" or "MIN-MAX" tokens."""
    low, _, high = value.partition("-")
    try:
        pair = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"{option} takes N or MIN-MAX tokens, not {value!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise ValueError(f"{option} needs 1 <= MIN <= MAX, not {value!r}")
    return pair


def _name_pair(pair: str) -> tuple[str, str]:
    name, sep, served = pair.partition("=")
    if not sep or not name or not served:
        raise ValueError(f"--adapter-model takes NAME=SERVED_NAME, not {pair!r}")
    return name, served

