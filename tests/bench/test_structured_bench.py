"""`loraplex bench structured --quick`: one real server on SmolLM2 with random adapters,
both loads, in-process compiles, and every schema and tool-call answer validated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.harness.adapters import write_random_adapter
from bench.structured.cases import SCHEMA_CASES, TOOL_CASES, check_document, check_tool_calls
from bench.structured.run import StructuredOptions, StructuredReport, run_structured
from engine.models.loader import load_model_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> StructuredReport:
    root = tmp_path_factory.mktemp("structured")
    config = load_model_config(smollm2_dir)
    for i in range(2):
        write_random_adapter(root / "adapters" / f"tenant-{i}", config, rank=8, alpha=16,
                             seed=50 + i)
    output = root / "structured.json"
    result = run_structured(StructuredOptions(
        model=str(smollm2_dir), quick=True, adapters_dir=root / "adapters", output=output,
        quiet=True))
    assert json.loads(output.read_text()) == json.loads(json.dumps(result.to_json()))
    return result


def test_both_loads_measured_per_token(report: StructuredReport) -> None:
    assert [(r.load, r.round) for r in report.runs] == [("constrained", 0), ("free", 0)]
    for run in report.runs:
        s = run.summary
        assert s.requests == 8
        assert 0 < s.tpot_p50_s <= s.tpot_p90_s and s.ttft_p50_s > 0
        assert 0 < s.mean_output_tokens <= 16
    free = report.runs[1]
    assert free.summary.output_tokens == 8 * 16  # ignore_eos: every token generated
    assert free.structured_requests == 0 and free.constrained_rows is None
    mixed = report.runs[0]
    # Half of the constrained load is constrained: exactly those reach the engine as such.
    assert mixed.structured_requests == 4
    assert mixed.constrained_rows is not None and mixed.constrained_rows.requests == 4
    assert mixed.free_rows is not None and mixed.free_rows.requests == 4
    assert mixed.free_rows.output_tokens == 4 * 16
    assert report.tpot_ratio_best > 0 and report.tpot_ratio_median > 0
    ratio = round(mixed.summary.tpot_p50_s / free.summary.tpot_p50_s, 3)
    assert report.tpot_ratio_rounds == [ratio] and report.tpot_ratio_paired == ratio
    assert report.load_average_before and report.load_average_after


def test_compiles_cold_and_cached(report: StructuredReport) -> None:
    c = report.compile
    assert c.tokenizer_info_ms > 0
    for stats in (c.cold_ms, c.cold_worker_ms, c.cached_ms):
        assert stats["n"] == 3 and 0 < stats["p50"] <= stats["p99"] <= stats["max"]
    # A cached spec is a dictionary lookup; a cold one builds a grammar.
    assert c.cached_ms["p50"] < c.cold_ms["p50"]


def test_every_answer_valid(report: StructuredReport) -> None:
    v = report.validity
    assert v.adapters_source == "--adapters-dir"
    assert sorted(v.adapters) == ["tenant-0", "tenant-1"]
    assert (v.schema_requests, v.tool_requests) == (len(SCHEMA_CASES), len(TOOL_CASES))
    assert v.failures == [], v.failures
    assert v.schema_valid == v.schema_requests and v.tool_valid == v.tool_requests
    assert v.ok


def test_checks_catch_bad_answers() -> None:
    case = SCHEMA_CASES[2]  # enums
    good = {"category": "billing", "priority": "low", "sentiment": "neutral", "summary": "x"}
    assert check_document(json.dumps(good), case.schema, "stop") is None
    assert "not JSON" in str(check_document('{"category": "bil', case.schema, "length"))
    bad = {**good, "priority": "urgent"}
    assert "not valid" in str(check_document(json.dumps(bad), case.schema, "stop"))
    assert "no content" in str(check_document(None, case.schema, "stop"))

    tools = TOOL_CASES[0]
    call = {"function": {"name": "get_weather",
                         "arguments": json.dumps({"city": "Rome", "unit": "celsius"})}}
    assert check_tool_calls({"tool_calls": [call]}, tools, "tool_calls") is None
    assert "no tool_calls" in str(check_tool_calls({"content": "hi"}, tools, "stop"))
    assert "finish_reason" in str(check_tool_calls({"tool_calls": [call]}, tools, "length"))
    unknown = {"function": {"name": "launch", "arguments": "{}"}}
    assert "unknown function" in str(check_tool_calls({"tool_calls": [unknown]}, tools,
                                                      "tool_calls"))
    wrong = {"function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    assert "not valid" in str(check_tool_calls({"tool_calls": [wrong]}, tools, "tool_calls"))
