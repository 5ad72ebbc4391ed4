"""`loraplex bench serve`: the arrival schedules, the request mix and dataset, the figures
on hand-made timings, and whole sweeps over real HTTP against the app on a FakeEngine."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import statistics
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from bench.cli import bench
from bench.harness.options import parse_length_range
from bench.serve.client import RequestRecord
from bench.serve.monitor import (
    KV_FILLED,
    PREFIX_HITS,
    PREFIX_QUERIES,
    STEP_SECONDS,
    STEPS,
    Sample,
    ServerMonitor,
    parse_metrics,
    read_memory_bytes,
    summarize_samples,
)
from bench.serve.options import ServeOptions
from bench.serve.run import ServeReport, run_serve
from bench.serve.stats import SLO, summarize
from bench.serve.target import started_server
from bench.serve.workload import (
    DatasetEntry,
    MixOptions,
    ServeRequest,
    arrival_times,
    build_requests,
    load_dataset,
    parse_rates,
)
from tests.utils.fake_engine import FakeEngine, make_app
from tests.utils.live_server import serve_in_thread

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def _cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


# ---------------------------------------------------------------------------- arrivals


def test_poisson_arrivals_have_the_rate_and_are_seeded() -> None:
    times = arrival_times(4.0, num_requests=20_000, seed=1)
    gaps = _gaps(times)
    assert times[0] == 0.0 and len(times) == 20_000
    assert all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert _cv(gaps) == pytest.approx(1.0, abs=0.05)  # exponential gaps
    assert arrival_times(4.0, num_requests=50, seed=1) == times[:50]
    assert arrival_times(4.0, num_requests=50, seed=2) != times[:50]


def test_burstiness_below_one_spreads_the_gaps() -> None:
    poisson = _gaps(arrival_times(4.0, num_requests=20_000, seed=3))
    bursty = _gaps(arrival_times(4.0, num_requests=20_000, burstiness=0.25, seed=3))
    even = _gaps(arrival_times(4.0, num_requests=20_000, burstiness=4.0, seed=3))
    # Gamma gaps of shape k have CV 1/sqrt(k); the mean stays 1/rate.
    assert statistics.fmean(bursty) == pytest.approx(0.25, rel=0.05)
    assert _cv(bursty) == pytest.approx(2.0, rel=0.1)
    assert _cv(even) == pytest.approx(0.5, rel=0.1)
    assert _cv(bursty) > _cv(poisson) > _cv(even)


def test_rate_inf_sends_everything_at_once() -> None:
    assert arrival_times(math.inf, num_requests=5) == [0.0] * 5
    with pytest.raises(ValueError, match="inf needs"):
        arrival_times(math.inf, num_requests=None, duration_s=3.0)


def test_duration_bounds_the_arrivals() -> None:
    times = arrival_times(10.0, num_requests=None, duration_s=5.0, seed=0)
    assert max(times) < 5.0
    assert 30 <= len(times) <= 70  # Poisson(50), five standard deviations either side
    assert len(arrival_times(10.0, num_requests=7, duration_s=5.0, seed=0)) == 7


def test_rates_and_ranges_parse() -> None:
    assert parse_rates(["1", "2, 4", "inf"]) == [1.0, 2.0, 4.0, math.inf]
    for bad_rates in (["0"], ["-1"], ["fast"], [""]):
        with pytest.raises(ValueError):
            parse_rates(bad_rates)
    assert parse_length_range("64-512", "--prompt-len") == (64, 512)
    assert parse_length_range("32", "--output-len") == (32, 32)
    for bad in ("0", "9-3", "a-b"):
        with pytest.raises(ValueError, match="--prompt-len"):
            parse_length_range(bad, "--prompt-len")


# ---------------------------------------------------------------------------- the mix


def test_rates_share_the_mix_but_not_the_prompts() -> None:
    mix = MixOptions(prompt_len=(20, 40), output_len=(4, 9), adapters=["a", "b", "c"],
                     shared_prefix_fraction=0.5, shared_prefix_len=8)
    first = build_requests(40, mix, vocab_size=5000, seed=7, content_seed=1)
    second = build_requests(40, mix, vocab_size=5000, seed=7, content_seed=2)

    def shape(r: ServeRequest) -> tuple[object, ...]:
        return (r.output_len, r.adapter, r.shared_prefix, r.prompt_len)

    assert [shape(r) for r in first] == [shape(r) for r in second]
    assert all(a.prompt != b.prompt for a, b in zip(first, second, strict=True))
    assert {r.adapter for r in first} == {"a", "b", "c"}
    assert 10 <= sum(r.shared_prefix for r in first) <= 30
    for r in first:
        assert isinstance(r.prompt, list)
        assert 20 <= len(r.prompt) <= 40 and r.prompt_len == len(r.prompt)  # prefix included
        assert all(1000 <= t < 5000 for t in r.prompt)


def test_shared_prefix_is_per_adapter() -> None:
    mix = MixOptions(prompt_len=(30, 30), output_len=(4, 4), adapters=["a", "b"],
                     shared_prefix_fraction=1.0, shared_prefix_len=16)
    requests = build_requests(20, mix, vocab_size=5000, seed=0, content_seed=3)
    prefixes: dict[str | None, set[tuple[int, ...]]] = {}
    for r in requests:
        assert isinstance(r.prompt, list) and r.shared_prefix
        prefixes.setdefault(r.adapter, set()).add(tuple(r.prompt[:16]))
    assert set(prefixes) == {"a", "b"}
    assert all(len(p) == 1 for p in prefixes.values())  # one system prompt per tenant
    assert prefixes["a"] != prefixes["b"]
    # After the prefix, every request has prompt tokens of its own.
    assert len({tuple(r.prompt[16:]) for r in requests}) == 20


def test_zipf_favours_the_first_adapters() -> None:
    names = [f"lora-{i}" for i in range(8)]
    zipf = MixOptions(adapters=names, adapter_dist="zipf", zipf_alpha=1.2)
    counts = Counter(r.adapter for r in build_requests(
        2000, zipf, vocab_size=5000, seed=0, content_seed=0))
    uniform = Counter(r.adapter for r in build_requests(
        2000, MixOptions(adapters=names), vocab_size=5000, seed=0, content_seed=0))
    assert counts["lora-0"] > 3 * counts["lora-7"]
    assert max(uniform.values()) < 1.5 * min(uniform.values())
    base_only = build_requests(5, MixOptions(), vocab_size=5000, seed=0, content_seed=0)
    assert {r.adapter for r in base_only} == {None}


def test_dataset_lines(tmp_path: Path) -> None:
    path = tmp_path / "mix.jsonl"
    path.write_text(
        '{"prompt": "Say hello.", "output_len": 5}\n'
        "\n"
        '{"prompt": [7, 8, 9], "output_len": 3}\n'
        '{"prompt_len": 12, "output_len": 4}\n'
    )
    entries = load_dataset(path)
    assert entries == [
        DatasetEntry(output_len=5, prompt="Say hello."),
        DatasetEntry(output_len=3, prompt=[7, 8, 9]),
        DatasetEntry(output_len=4, prompt_len=12),
    ]
    mix = MixOptions(dataset=entries, shared_prefix_fraction=1.0, shared_prefix_len=6)
    requests = build_requests(6, mix, vocab_size=5000, seed=0, content_seed=0)
    assert sorted(r.output_len for r in requests) == [3, 3, 4, 4, 5, 5]  # each twice
    by_len = {r.output_len: r for r in requests}
    text = by_len[5].prompt
    assert isinstance(text, str) and text.endswith("\n\nSay hello.")
    assert len(text.split("\n\n")[0].split()) == 6 and by_len[5].prompt_len is None
    assert by_len[3].prompt[-3:] == [7, 8, 9] and by_len[3].prompt_len == 9
    assert by_len[4].prompt_len == 12 == len(by_len[4].prompt)
    with pytest.raises(ValueError, match="vocabulary"):
        build_requests(6, mix, vocab_size=None, seed=0, content_seed=0)
    text_only = MixOptions(dataset=entries[:1])
    assert build_requests(2, text_only, vocab_size=None, seed=0, content_seed=0)[0].prompt == (
        "Say hello."
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "hi"}', '"output_len"'),
        ('{"prompt": "hi", "output_len": 0}', '"output_len"'),
        ('{"prompt": "hi", "output_len": true}', '"output_len"'),
        ('{"prompt": "", "output_len": 3}', '"prompt"'),
        ('{"prompt": [1, "x"], "output_len": 3}', '"prompt"'),
        ('{"output_len": 3}', '"prompt_len"'),
        ('["hi", 3]', "JSON object"),
        ("{not json", "Expecting"),
    ],
)
def test_dataset_refuses_bad_lines(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine", "output_len": 2}\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as error:
        load_dataset(path)
    assert f"{path}:2:" in str(error.value)


# ---------------------------------------------------------------------------- figures


def _record(index: int, ttft: float | None, e2e: float, tokens: int,
            error: str | None = None) -> RequestRecord:
    return RequestRecord(index, "m", scheduled_s=0.0, sent_s=0.01 * index, ttft_s=ttft,
                         e2e_s=e2e, itl_s=[0.1] * max(tokens - 1, 0), prompt_tokens=10,
                         output_tokens=tokens, error=error)


def test_percentiles_and_goodput_on_known_timings() -> None:
    records = [
        _record(0, 0.5, 1.5, 11),  # TPOT 0.1: within both objectives
        _record(1, 3.0, 4.0, 11),  # TTFT past 2 s
        _record(2, 0.2, 3.2, 11),  # TPOT 0.3 past 0.2 s
        _record(3, 0.1, 0.2, 3, error="stream error: boom"),  # fast, but failed
        _record(4, 2.0, 2.0, 1),  # TTFT at the objective, no TPOT: counted
    ]
    s = summarize(4.0, records, duration_s=10.0, slo=SLO(ttft_s=2.0, tpot_s=0.2))
    assert (s.num_requests, s.num_completed, s.num_errors) == (5, 4, 1)
    assert s.errors == {"stream error: boom": 1}
    assert s.goodput == pytest.approx(0.2)  # records 0 and 4 over 10 s
    assert s.goodput_fraction == pytest.approx(0.4)
    assert s.request_throughput == pytest.approx(0.4)
    assert s.output_throughput == pytest.approx(3.4)  # failed requests' tokens left out
    assert s.total_output_tokens == 34 and s.total_prompt_tokens == 40
    # TTFTs of the four that succeeded: 0.2, 0.5, 2.0, 3.0 (linear interpolation).
    assert s.ttft_s.p50 == pytest.approx(1.25)
    assert s.ttft_s.p99 == pytest.approx(2.0 + 0.97 * 1.0)
    assert s.ttft_s.max == 3.0 and s.ttft_s.mean == pytest.approx(1.425)
    assert s.tpot_s.p50 == pytest.approx(0.1) and s.tpot_s.max == pytest.approx(0.3)
    assert s.e2e_s.p50 == pytest.approx(2.6)
    assert s.itl_s.p50 == pytest.approx(0.1)
    assert s.send_lag_max_s == pytest.approx(0.04)
    stricter = summarize(4.0, records, duration_s=10.0, slo=SLO(ttft_s=1.0, tpot_s=0.5))
    assert stricter.goodput_fraction == pytest.approx(0.4)  # records 0 and 2 now


def test_figures_of_a_run_where_everything_failed() -> None:
    s = summarize(1.0, [_record(0, None, 0.1, 0, error="HTTP 503: busy")], 1.0, SLO())
    assert (s.num_completed, s.goodput, s.goodput_fraction) == (0, 0.0, 0.0)
    assert math.isnan(s.ttft_s.p50)
    assert s.to_json()["ttft_s"] == {"mean": None, "p50": None, "p90": None, "p99": None,
                                     "max": None}


def test_metrics_and_rss() -> None:
    text = (
        "# TYPE loraplex_kv_cache_usage_ratio gauge\nloraplex_kv_cache_usage_ratio 0.5\n"
        "# TYPE loraplex_prefix_cache_hits counter\nloraplex_prefix_cache_hits_total 30.0\n"
        '# TYPE loraplex_workers gauge\nloraplex_workers{state="in_rotation"} 2.0\n'
    )
    assert parse_metrics(text) == {"loraplex_kv_cache_usage_ratio": 0.5, PREFIX_HITS: 30.0}
    samples = [
        Sample(0.0, {PREFIX_HITS: 10, PREFIX_QUERIES: 100, "loraplex_kv_cache_usage_ratio": 0.0,
                     STEPS: 10, STEP_SECONDS: 1.0, KV_FILLED: 1.0},
               rss_bytes=100 * 2**20, hwm_bytes=400 * 2**20),
        Sample(0.5, {PREFIX_HITS: 40, PREFIX_QUERIES: 150, "loraplex_kv_cache_usage_ratio": 0.6,
                     STEPS: 20, STEP_SECONDS: 2.0, KV_FILLED: 0.9},
               rss_bytes=300 * 2**20, hwm_bytes=400 * 2**20),
        Sample(1.0, {PREFIX_HITS: 60, PREFIX_QUERIES: 200, "loraplex_kv_cache_usage_ratio": 0.2,
                     STEPS: 30, STEP_SECONDS: 4.0, KV_FILLED: 0.96},
               rss_bytes=200 * 2**20, hwm_bytes=420 * 2**20),
        Sample(1.5, {PREFIX_HITS: 60, PREFIX_QUERIES: 200, "loraplex_kv_cache_usage_ratio": 0.0,
                     STEPS: 30, STEP_SECONDS: 4.0, KV_FILLED: 1.0},
               rss_bytes=150 * 2**20),
    ]
    summary = summarize_samples(samples)
    assert summary.prefix_cache_hit_rate == pytest.approx(0.5)  # 50 of 100 tokens
    assert summary.prefix_cache_queried_tokens == 100
    # Gauges leave out the samples before and after the load.
    assert summary.kv_usage_mean == pytest.approx(0.4) and summary.kv_usage_max == 0.6
    assert (summary.rss_peak_mib, summary.rss_end_mib) == (300.0, 150.0)
    # The peak since the server's start (its load's, above any sample's RSS): the last
    # sample that has one.
    assert summary.rss_peak_since_start_mib == 420.0
    # Filled slots only while KV is in use; steps: 20 steps in 3 s.
    assert (summary.kv_filled_mean, summary.kv_filled_min) == (0.93, 0.9)
    assert summary.mean_step_s == 0.15
    memory = read_memory_bytes(os.getpid())
    assert memory is not None
    rss = memory["VmRSS"]
    assert rss > 10 * 2**20
    grown = b"\x01" * (64 * 2**20)  # written: the peak is at least this much above
    after = read_memory_bytes(os.getpid())
    del grown
    assert after is not None and after["VmHWM"] >= rss + 60 * 2**20
    assert read_memory_bytes(2**22 + 12345) is None  # past Linux's pid_max


# ---------------------------------------------------------------------------- over HTTP


@dataclass
class FakeServer:
    base_url: str
    engine: FakeEngine


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    """The real app on a FakeEngine that streams a token every 2 ms, serving two
    adapters under names of its own."""
    engine = FakeEngine(filler=True, token_delay_s=0.002, max_model_len=4096)
    engine.kv_usage = 0.25
    for name in ("tenant-a", "tenant-b"):
        asyncio.run(engine.add_adapter(name, f"/adapters/{name}"))
    app, _ = make_app(engine)
    with serve_in_thread(app) as base_url:
        yield FakeServer(base_url, engine)


@pytest.fixture(scope="module")
def sweep(fake_server: FakeServer, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[ServeReport, Path, Path]:
    root = tmp_path_factory.mktemp("serve")
    output, plot = root / "report.json", root / "sweep.png"
    fake_server.engine.submitted.clear()
    report = run_serve(ServeOptions(
        base_url=fake_server.base_url, vocab_size=256, rates=[25.0, math.inf],
        num_requests=12, prompt_len=(16, 40), output_len=(4, 8), num_adapters=2,
        adapter_models={"lora-0": "tenant-a", "lora-1": "tenant-b"},
        shared_prefix_fraction=0.5, shared_prefix_len=8, seed=5, output=output, plot=plot,
    ))
    return report, output, plot


def test_sweep_sends_the_schedule_and_counts_every_token(
    sweep: tuple[ServeReport, Path, Path], fake_server: FakeServer
) -> None:
    report, _, _ = sweep
    assert [run.summary.rate for run in report.runs] == [25.0, math.inf]
    expected_arrivals = arrival_times(25.0, num_requests=12, seed=5)
    for run in report.runs:
        s = run.summary
        assert (s.num_requests, s.num_completed, s.num_errors) == (12, 12, 0), s.errors
        assert [r.error for r in run.records] == [None] * 12
        # ignore_eos: every requested token came back and was counted from the usage.
        assert s.total_output_tokens == sum(r.requested_output_tokens for r in run.records)
        assert all(r.output_tokens == r.requested_output_tokens for r in run.records)
        assert all(len(r.itl_s) == r.output_tokens - 1 for r in run.records)
        assert 0 < s.ttft_s.p50 <= s.ttft_s.p99 < s.e2e_s.p99
        assert 0 < s.tpot_s.p50 <= s.tpot_s.p99
        assert s.goodput_fraction == 1.0 and s.goodput == pytest.approx(s.request_throughput)
        assert s.server is not None and s.server.kv_usage_max == 0.25
        assert s.server.rss_peak_mib is None  # not a process started here
        assert s.server.rss_peak_since_start_mib is None
        assert {r.model for r in run.records} <= {"fake-model", "tenant-a", "tenant-b"}
    paced, burst = report.runs
    assert [r.scheduled_s for r in paced.records] == expected_arrivals
    assert paced.summary.duration_s >= expected_arrivals[-1]
    assert [r.scheduled_s for r in burst.records] == [0.0] * 12
    assert report.started_server is False and report.model == "fake-model"

    # What the engine was asked: warm-ups (one per model) and 2 x 12 measured requests,
    # greedy, ignore_eos, on the served adapter names.
    submitted = fake_server.engine.submitted
    assert len(submitted) == 3 + 24
    assert all(r.sampling.ignore_eos and r.sampling.temperature == 0 for r in submitted)
    assert {r.adapter_id for r in submitted} == {None, "tenant-a", "tenant-b"}
    # Random prompts never share their first 8 tokens; a shared prefix is its adapter's,
    # the same at both rates (which send the same mix).
    starts = Counter((r.adapter_id, tuple(r.prompt_token_ids[:8])) for r in submitted[3:])
    repeated = sum(n for n in starts.values() if n > 1)
    num_shared = sum(r.shared_prefix for run in report.runs for r in run.records)
    assert 0 < num_shared < 24 and repeated == num_shared


def test_sweep_report_and_plot(sweep: tuple[ServeReport, Path, Path]) -> None:
    report, output, plot = sweep
    written = json.loads(output.read_text())
    assert written == json.loads(json.dumps(report.to_json()))
    assert set(written) == {"benchmark", "machine", "started_at", "options", "target", "rates",
                            "requests"}
    assert written["benchmark"] == "serve" and written["machine"]
    assert written["options"]["rates"] == [25.0, "inf"]
    assert written["options"]["adapter_models"] == {"lora-0": "tenant-a", "lora-1": "tenant-b"}
    assert written["target"]["started_server"] is False
    assert written["options"]["api_key"] is None
    assert [r["rate"] for r in written["rates"]] == [25.0, "inf"]
    for rate in written["rates"]:
        assert {"request_throughput", "output_throughput", "goodput", "goodput_fraction",
                "ttft_s", "tpot_s", "itl_s", "e2e_s", "errors", "server"} <= set(rate)
        assert set(rate["ttft_s"]) == {"mean", "p50", "p90", "p99", "max"}
        assert rate["server"]["kv_usage_mean"] == 0.25
    assert sorted(written["requests"]) == ["25", "inf"]
    assert len(written["requests"]["25"]) == 12
    assert written["requests"]["inf"][0]["ttft_s"] > 0
    assert plot.read_bytes()[:8] == PNG_MAGIC and plot.stat().st_size > 10_000


def test_cli_runs_and_refuses_bad_options(fake_server: FakeServer, tmp_path: Path) -> None:
    runner = CliRunner()
    output = tmp_path / "cli.json"
    result = runner.invoke(bench, [
        "serve", "--base-url", fake_server.base_url, "--vocab-size", "256", "--rate", "inf",
        "--num-requests", "3", "--prompt-len", "8", "--output-len", "2", "--output",
        str(output),
    ])
    assert result.exit_code == 0, result.output
    assert "rate inf req/s" in result.output and "goodput" in result.output
    written = json.loads(output.read_text())
    assert written["rates"][0]["num_completed"] == 3
    assert written["rates"][0]["total_output_tokens"] == 6

    for args, message in (
        (["--rate", "0"], "rate must be > 0"),
        (["--rate", "inf", "--duration", "2"], "inf needs --num-requests"),
        (["--shared-prefix-fraction", "1.5"], "within 0..1"),
        (["--adapter-model", "lora-0"], "NAME=SERVED_NAME"),
        (["--adapter-model", "lora-2=x", "--num-adapters", "2"], "lora-0 .. lora-1"),
        (["--prompt-len", "9-3"], "MIN <= MAX"),
    ):
        result = runner.invoke(bench, ["serve", "--base-url", fake_server.base_url, *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)


def test_a_missing_adapter_fails_before_the_load(fake_server: FakeServer,
                                                 tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"lora-1: HTTP 404.*does not exist"):
        run_serve(ServeOptions(
            base_url=fake_server.base_url, vocab_size=256, num_requests=2, num_adapters=2,
            adapter_models={"lora-0": "tenant-a"}, output=tmp_path / "never.json",
        ))
    assert not (tmp_path / "never.json").exists()


async def test_monitor_samples_metrics_and_rss_in_the_background(
    fake_server: FakeServer,
) -> None:
    async with (
        httpx.AsyncClient(base_url=fake_server.base_url) as client,
        ServerMonitor(client, pid=os.getpid(), interval_s=0.05) as monitor,
    ):
        await asyncio.sleep(0.4)
    assert len(monitor.samples) >= 5  # before, every 50 ms, after
    assert all(s.metrics["loraplex_kv_cache_usage_ratio"] == 0.25 for s in monitor.samples)
    summary = monitor.summary()
    assert summary.kv_usage_mean == 0.25 and summary.running_max == 0
    # The FakeEngine's counters stand still: nothing was looked up during the run.
    assert summary.prefix_cache_queried_tokens == 0 and summary.prefix_cache_hit_rate is None
    peak, end = summary.rss_peak_mib, summary.rss_end_mib
    assert peak is not None and end is not None and peak >= end > 10
    assert summary.rss_peak_since_start_mib is not None
    assert summary.rss_peak_since_start_mib >= peak


def test_a_server_that_fails_to_start_is_quoted() -> None:
    server = started_server(["--no-such-flag"], timeout_s=60)
    with pytest.raises(RuntimeError, match=r"server exited with 2(.|\n)*--no-such-flag"):
        server.__enter__()
