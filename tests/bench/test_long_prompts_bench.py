"""`loraplex bench long-prompts`: its arrivals, its arithmetic, and one short real run (a
`loraplex serve` subprocess on the bundled model) for the sanity of what it reports."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from bench.harness.workload import RequestTiming
from bench.long_prompts import LongPromptOptions, arrivals, run_long_prompts, summarize


def test_arrivals_interleave_long_prompts_at_fixed_times_with_poisson_shorts() -> None:
    opts = LongPromptOptions(long_requests=3, long_interval_s=100.0, short_rate=10.0,
                             long_prompt_len=50, short_prompt_len=(5, 9), seed=3)
    schedule = arrivals(opts, vocab_size=49152)
    assert schedule == sorted(schedule, key=lambda a: a.at_s)
    longs = [a for a in schedule if a.kind == "long"]
    shorts = [a for a in schedule if a.kind == "short"]
    assert [a.at_s for a in longs] == [0.0, 100.0, 200.0]
    assert all(len(a.request.prompt_token_ids) == 50 for a in longs)
    assert all(5 <= len(a.request.prompt_token_ids) <= 9 for a in shorts)
    assert all(0 < a.at_s < 300.0 for a in shorts)
    # ~3,000 Poisson arrivals at 10/s over 300 s: the mean gap is 0.1 s within 2% (1 sigma).
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(shorts)]
    assert 2700 < len(shorts) < 3300
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.1)  # exponential: sd = mean
    assert arrivals(opts, vocab_size=49152) == schedule  # seeded


def test_summary_divides_by_the_runs_own_step_time() -> None:
    timings = [("short", RequestTiming(ttft_s=t, e2e_s=t + 3 * t, num_output_tokens=4))
               for t in (0.2, 0.4, 0.6, 3.0)]  # TPOT = TTFT
    timings.append(("long", RequestTiming(ttft_s=10.0, e2e_s=11.0, num_output_tokens=8)))
    before = {"loraplex_engine_steps_total": 5.0, "loraplex_engine_step_seconds_total": 1.0,
              "loraplex_prompt_tokens_total": 100.0, "loraplex_generation_tokens_total": 10.0,
              "loraplex_prefix_cache_hits_total": 0.0, "loraplex_prefix_cache_queries_total": 0}
    after = {**before, "loraplex_engine_steps_total": 105.0,
             "loraplex_engine_step_seconds_total": 21.0, "loraplex_prompt_tokens_total": 2100.0,
             "loraplex_generation_tokens_total": 60.0, "loraplex_prefix_cache_hits_total": 50.0}
    row = summarize("capped", timings, 30.0, before, after)
    assert row["mean_step_s"] == 0.2  # 20 s over 100 steps
    assert row["short_ttft_p50_s"] == 0.5 and row["short_ttft_p50_steps"] == 2.5
    assert row["short_tpot_p50_s"] == 0.5 and row["short_tpot_p99_s"] == 2.928
    assert row["long_ttft_p50_s"] == 10.0
    assert row["steps"] == 100 and row["makespan_s"] == 30.0
    assert row["tokens_per_step_second"] == (2000 - 50 + 50) / 20


@pytest.mark.slow
def test_a_short_run_reports_its_figures(tmp_path: Path) -> None:
    output = tmp_path / "long.json"
    # One setting: each is the same code path with other serve flags.
    report = run_long_prompts(LongPromptOptions(
        long_requests=1, long_prompt_len=600, long_output_len=2, long_interval_s=3.0,
        short_rate=2.0, short_prompt_len=(8, 16), short_output_len=3,
        settings=("capped",),
        serve_args=["--max-num-batched-tokens", "64", "--kv-cache-tokens", "4096"],
        output=output,
    ))
    assert json.loads(output.read_text())["results"] == report["results"]
    rows = {r["setting"]: r for r in report["results"]}  # type: ignore[attr-defined]
    assert set(rows) == {"capped"}
    for row in rows.values():
        assert row["short_requests"] > 0
        # The long prompt alone needs ten 64-token steps.
        assert row["steps"] >= 10 and row["mean_step_s"] > 0
        assert 0 < row["short_ttft_p50_s"] <= row["short_ttft_p99_s"]
        assert row["tokens_per_step_second"] > 0
    assert "ratios" not in report  # a ratio needs both settings
