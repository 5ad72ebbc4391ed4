"""`loraplex bench soak` for a few seconds on the tiny model: the whole run (server
subprocess, capacity, open loop, uploads, leak checks, usage rows) and its report."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import redis

from bench.soak.probes import REDIS_POOL_SIZE, Snapshot, connections_to_port, leak_checks
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
    assert {"rss_bytes", "open_fds", "redis_connections", "threads", "kv_blocks_used",
            "pinned_adapters", "db_connections", "redis_keys", "redis_live_leases",
            "usage_rows"} <= names
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


def test_connections_to_redis_are_counted_by_the_peer_port(redis_url: str) -> None:
    port = urlsplit(redis_url).port or 6379
    before = connections_to_port(os.getpid(), port)
    clients = [redis.Redis.from_url(redis_url) for _ in range(3)]
    try:
        for client in clients:
            client.ping()
        assert connections_to_port(os.getpid(), port) == before + 3
        assert connections_to_port(os.getpid(), 1) == 0
    finally:
        for client in clients:
            client.close()
    assert connections_to_port(os.getpid(), port) == before


def _snapshot(open_fds: int, redis_connections: int) -> Snapshot:
    return Snapshot(rss_bytes=1, open_fds=open_fds, redis_connections=redis_connections,
                    threads=10, kv_blocks_used=0, engine_requests=0, pinned_adapters=0,
                    db_connections=1, redis_keys=0, redis_live_leases=0)


def test_a_grown_redis_pool_is_not_a_leak_but_connections_past_its_cap_are() -> None:
    def verdicts(after: Snapshot) -> dict[str, bool]:
        checks = leak_checks(_snapshot(20, 2), after, num_tenants=1, rss_slack_mib=1,
                             rss_samples=[])
        return {c.name: c.ok for c in checks if c.name in ("open_fds", "redis_connections")}

    assert verdicts(_snapshot(20, REDIS_POOL_SIZE)) == {
        "open_fds": True, "redis_connections": True}
    assert verdicts(_snapshot(20, REDIS_POOL_SIZE + 1)) == {
        "open_fds": True, "redis_connections": False}
    assert verdicts(_snapshot(60, 2)) == {"open_fds": False, "redis_connections": True}
