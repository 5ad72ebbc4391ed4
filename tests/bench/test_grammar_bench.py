"""`loraplex bench grammar --quick`: both libraries on the real SmolLM2 tokenizer, the shape
of the report, and that the masks it used to pick tokens produced valid documents."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from bench.grammar.cases import CASES, hostile_cases
from bench.grammar.driver import Stats
from bench.grammar.run import LIBRARIES, GrammarOptions, GrammarReport, run_grammar


@pytest.fixture(scope="module")
def report(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> GrammarReport:
    output = tmp_path_factory.mktemp("grammar") / "grammar.json"
    result = run_grammar(GrammarOptions(model=str(smollm2_dir), quick=True, output=output,
                                       quiet=True))
    assert json.loads(output.read_text()) == json.loads(json.dumps(result.to_json()))
    return result


def _ordered(stats: Stats | None) -> None:
    assert stats is not None and stats.n > 0
    assert 0 <= stats.p50_ms <= stats.p99_ms <= stats.max_ms, stats


def test_report_covers_every_library_and_case(report: GrammarReport) -> None:
    assert report.vocab_size == 49_152
    assert [lib.name for lib in report.libraries] == list(LIBRARIES)
    for lib in report.libraries:
        assert lib.version and lib.tokenizer_info_ms > 0

    assert {(c.library, c.case) for c in report.compiles} == {
        (lib, case.name) for lib in LIBRARIES for case in CASES}
    for c in report.compiles:
        assert c.error is None, c
        for stats in (c.cold, c.cached, c.first_mask_cold, c.first_mask_cached):
            _ordered(stats)
            assert stats is not None and stats.n == 2

    mixed = [b for b in report.batches if b.workload == "mixed"]
    assert sorted(b.library for b in mixed) == sorted(LIBRARIES)
    for b in mixed:
        assert b.batch_size == 32 and b.num_steps == 16
        for stats in (b.fill, b.accept, b.apply_torch, b.apply_library, b.fill_serial,
                      b.rollback, b.forced):
            _ordered(stats)
            assert stats is not None and stats.n == 16
        assert b.overlap is not None
        _ordered(b.overlap.wall_overlapped)
        _ordered(b.overlap.matmul_alone)
        assert b.overlap.matmul_shape == "[32, 576] x [576, 49152]"

    names = [h.name for h in hostile_cases(quick=True)]
    for name in LIBRARIES:
        results = {h.case: h for h in report.hostile if h.library == name}
        assert list(results) == names
        assert results["invalid type"].status == "error" and results["invalid type"].error
        assert results["regex (a+)+$"].status == "ok"
        # Whatever a library does with 1,000 levels, the deadline bounds it.
        assert results["nesting-1000"].status in ("ok", "error", "timeout")


def test_masks_pick_valid_documents(report: GrammarReport) -> None:
    """Every document the masks produced, deviated or not, parses and validates against
    its schema (or matches its regex); no mask refused a valid document's token, no
    matcher refused a token its mask allowed, and our bitmask apply agrees with each
    library's own helper."""
    cases = {case.name: case for case in CASES}
    for b in report.batches:
        assert b.num_rejected_reference == 0, b.failures
        assert b.num_rejected_accept == 0, b.failures
        assert b.num_apply_mismatch == 0
        assert b.failures == []
        done = {d.case for d in b.documents}
        assert done == set(cases), f"{b.library}: no document for {set(cases) - done}"
        assert any(d.deviated for d in b.documents if d.kind == "json_schema")
        for doc in b.documents:
            assert doc.finished, doc
            case = cases[doc.case]
            if case.kind == "regex":
                assert case.regex is not None and re.fullmatch(case.regex, doc.text), doc
                continue
            value = json.loads(doc.text)
            if case.kind == "json_object":
                assert isinstance(value, dict), doc
            else:
                jsonschema.validate(value, case.schema)
