"""`loraplex bench gateway`, run briefly at a low rate: the whole benchmark (two server
subprocesses, real Redis, SQLite metering) and the sanity of what it reports."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gateway.run import SCENARIOS, GatewayOptions, run_gateway

RATE = 20.0
DURATION_S = 0.5
WARMUP_S = 0.2


def test_gateway_bench_reports_consistent_figures(redis_url: str, tmp_path: Path) -> None:
    output = tmp_path / "gateway.json"
    report = run_gateway(
        GatewayOptions(
            rate=RATE,
            duration_s=DURATION_S,
            warmup_s=WARMUP_S,
            concurrency=2,
            repeats=1,
            redis_url=redis_url,
            output=output,
            quiet=True,
        )
    )

    assert [run.scenario for run in report.runs] == list(SCENARIOS)
    runs = {run.scenario: run for run in report.runs}
    for run in report.runs:
        assert run.errors == [] and run.num_errors == 0, run
        assert run.num_sent == run.num_ok > 0
        assert 0 < run.p50_ms <= run.p90_ms <= run.p99_ms <= run.max_ms, run
        assert run.server_cpu_ms_per_request is not None and run.server_cpu_ms_per_request > 0
    for name in ("health", "chat", "chat-no-auth"):
        assert runs[name].mode == "open"
        assert runs[name].num_sent == round(RATE * DURATION_S)  # the whole schedule was sent
    assert runs["chat-sustained"].mode == "closed" and runs["chat-sustained"].concurrency == 2
    # The server measures its gateway overhead on generation requests only.
    assert runs["health"].server_overhead_mean_ms is None
    for name in ("chat", "chat-no-auth", "chat-sustained"):
        overhead = runs[name].server_overhead_mean_ms
        assert overhead is not None and 0 < overhead < runs[name].max_ms

    # One repeat: best and median are that run; added latency is the difference.
    summaries = {s.scenario: s for s in report.summaries}
    assert set(summaries) == set(SCENARIOS)
    for s in report.summaries:
        assert s.best is runs[s.scenario]
        assert s.median_p50_ms == s.best.p50_ms and s.median_p99_ms == s.best.p99_ms
    added = {a.scenario: a for a in report.added}
    assert set(added) == {"chat", "chat-no-auth"}
    for name, a in added.items():
        assert a.best_p50_ms == runs[name].p50_ms - runs["health"].p50_ms
        assert a.median_p99_ms == runs[name].p99_ms - runs["health"].p99_ms

    # Every 200 has exactly one usage row, flushed on SIGTERM; warm-ups included: the
    # no-auth server got its open-loop warm-up and run and nothing else.
    checks = {c.server: c for c in report.checks}
    warmup = round(RATE * WARMUP_S)
    assert checks["no-auth"].responses_ok == warmup + runs["chat-no-auth"].num_ok
    assert checks["keys"].responses_ok > (
        warmup + runs["chat"].num_ok + runs["chat-sustained"].num_ok
    )
    for check in report.checks:
        assert check.exit_code == 0
        assert check.rows == check.rows_matching == check.responses_ok
        assert check.completion_tokens == 16 * check.responses_ok
        assert check.ok

    written = json.loads(output.read_text())
    assert [r["scenario"] for r in written["runs"]] == list(SCENARIOS)
    assert [c["ok"] for c in written["checks"]] == [True, True]
    assert written["options"]["rate"] == RATE
