"""`loraplex bench soak` for a few seconds on the tiny model: the whole run (server
subprocess, capacity, open loop, uploads, leak checks, usage rows) and its report."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from bench.soak.run import SoakOptions, run_soak
from bench.soak.traffic import MIX

SECONDS = 4.0


def test_soak_bench_finds_no_leak(
    tiny_model_factory: Callable[[str], Path], redis_url: str, tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama_gqa")
    output = tmp_path / "soak.json"
    report = run_soak(SoakOptions(
        model=str(model_dir), seconds=SECONDS, capacity_s=2.0, capacity_concurrency=4,
        upload_interval_s=2.0, redis_url=redis_url, output=output,
        serve_args=["--device", "cpu", "--kv-cache-tokens", "4096", "--max-num-seqs", "16"],
    ))

    assert report.unexpected == [] and report.skipped_arrivals == 0
    assert report.exit_code == 0
    assert {c.name: c.ok for c in report.checks} == {c.name: True for c in report.checks}
    assert report.ok
    names = {c.name for c in report.checks}
    assert {"rss_bytes", "open_fds", "threads", "kv_blocks_used", "pinned_adapters",
            "db_connections", "redis_keys", "redis_live_leases", "usage_rows"} <= names
    assert 0 < report.rate_rps < report.capacity_rps
    # Every kind of traffic ran in the open loop, uploads included (one at the start,
    # then one every 2 s).
    load_kinds = {name.split()[1] for name in report.counts if name.startswith("load ")}
    assert load_kinds == {*MIX, "upload"}
    uploads = sum(n for name, n in report.counts.items() if name.startswith("load upload 201"))
    assert 1 <= uploads <= 2
    rows = next(c for c in report.checks if c.name == "usage_rows")
    assert rows.after == rows.baseline > 0
    written = json.loads(output.read_text())
    assert written["ok"] is True and written["options"]["seconds"] == SECONDS
