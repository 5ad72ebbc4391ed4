"""`loraplex bench eval-impact` runs small on a tiny model and reports both phases."""

from __future__ import annotations

from pathlib import Path

from bench.evals import EvalImpactOptions, run_eval_impact


def test_eval_impact_measures_both_phases(tiny_model_factory, tmp_path: Path) -> None:
    report = run_eval_impact(EvalImpactOptions(
        model=str(tiny_model_factory("llama_gqa")), eval_items=6, requests=4, rate=50.0,
        output=tmp_path / "r.json",
    ))
    assert report["without_eval_s"]["n"] == report["during_eval_s"]["n"] == 4
    assert report["p99_ratio"] > 0
    assert 0 <= report["eval_done_items_during_phase"] <= 6 * 2
    assert (tmp_path / "r.json").is_file()
