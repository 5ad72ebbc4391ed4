"""The options of `loraplex bench serve`, and reading them from the command line."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.options import internal, opt
from bench.harness.report import options_json
from bench.serve.stats import SLO, rate_label
from bench.serve.workload import parse_rates

DEFAULT_NUM_REQUESTS = 64


@dataclass(slots=True)
class ServeOptions:
    base_url: str | None = opt(
        None, "an OpenAI-compatible server to load", shown="start `loraplex serve`")
    model: str | None = opt(
        None, "base model", shown="`default` when started here, else the server's first")
    adapter_models: dict[str, str] = opt(  # lora-i -> the served name
        {}, "what the server at --base-url calls adapter NAME (lora-0, lora-1, ...)",
        flag="--adapter-model", metavar="NAME=SERVED_NAME",
        parse=lambda pairs: dict(_name_pair(pair) for pair in pairs))
    api_key: str | None = opt(None, "sent as a Bearer token")
    vocab_size: int | None = opt(
        None, "for random token prompts", shown="from the local model's config")
    rates: list[float] = opt(
        [1.0], "requests/s, repeatable or a comma list; inf: all at once", flag="--rate",
        shown="1", parse=parse_rates)
    burstiness: float = opt(1.0, "gamma shape of the gaps: 1 Poisson, < 1 burstier")
    num_requests: int | None = opt(
        None, "per rate", shown=f"{DEFAULT_NUM_REQUESTS} unless --duration")
    duration_s: float | None = opt(None, "seconds of arrivals per rate")
    max_concurrency: int | None = opt(None, "cap on streams in flight")
    prompt_len: tuple[int, int] = opt((64, 512), "N or min-max tokens")
    output_len: tuple[int, int] = opt((32, 128), "N or min-max tokens")
    dataset: Path | None = opt(
        None, 'JSONL: {"prompt" or "prompt_len", "output_len"} per line',
        path={"dir_okay": False, "exists": True})
    num_adapters: int = opt(0, "rank-16 adapters lora-0..; 0: base model only")
    adapter_dist: str = opt("uniform", choices=("uniform", "zipf"))
    zipf_alpha: float = 1.0
    shared_prefix_fraction: float = opt(
        0.0, "requests that start with their adapter's system prompt")
    shared_prefix_len: int = opt(256, "tokens")
    slo_ttft_s: float = opt(2.0, "seconds")
    slo_tpot_s: float = opt(0.2, "seconds")
    seed: int = 0
    request_timeout_s: float = 600.0
    metrics_interval_s: float = internal(0.5)
    ignore_eos: bool = True
    serve_args: list[str] = opt([], "extra flag for `serve`", flag="--serve-arg")
    adapters_root: Path = internal(Path("bench/results/adapters"))  # generated once, reused
    output: Path | None = opt(
        None, "JSON report", shown="bench/results/serve-<timestamp>.json")
    plot: Path | None = opt(None, "PNG of the sweep")

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
        out = options_json(self)
        out["rates"] = [rate_label(r) if math.isinf(r) else r for r in self.rates]
        out["api_key"] = None if self.api_key is None else "<set>"  # never in a report
        return out


def _name_pair(pair: str) -> tuple[str, str]:
    name, sep, served = pair.partition("=")
    if not sep or not name or not served:
        raise ValueError(f"--adapter-model takes NAME=SERVED_NAME, not {pair!r}")
    return name, served

