"""`loraplex bench lora-cold-ttft` against a real S3-compatible server (moto's, on
loopback): every row measured, on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

from bench.lora import LoRABenchOptions, run_cold_ttft
from tests.utils.s3_server import aws_environment, moto_server, s3_client


def test_cold_ttft_times_each_source_and_a_burst(tiny_model_factory, tmp_path: Path) -> None:
    with moto_server(tmp_path) as url, aws_environment(url):
        s3_client(url).create_bucket(Bucket="bench")
        report = run_cold_ttft(LoRABenchOptions(
            model=str(tiny_model_factory("llama_gqa")), rank=4, loads=2,
            store="s3://bench/adapters", store_burst=3, output=tmp_path / "r.json",
        ))
    for row in ("base_s", "warm_s", "disk_s", "store_s"):
        assert report[row]["n"] == 2, row
        assert 0 < report[row]["p50"] <= report[row]["p99"], row
    assert report["burst_s"]["n"] == 3
    assert report["burst_s"]["wall"] >= report["burst_s"]["p99"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["benchmark"] == "lora_cold_ttft"
