"""Prometheus alert rules, the scrape config and the Grafana dashboard: they parse, and
every series and label they name is one the service exports (read from the source)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.deploy.support import (
    DEPLOY,
    grafana_query_problems,
    load_yaml,
    metric_defs,
    promql_problems,
    promql_selectors,
    series_catalog,
)

ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "loraplex.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    groups = load_yaml(ALERTS)["groups"]
    return [rule for group in groups for rule in group["rules"]]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def _expressions(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]


# ---------------------------------------------------------------- the metric catalog


def test_the_catalog_reads_the_metrics_module() -> None:
    names = {m.name: m for m in metric_defs()}
    http = names["loraplex_http_requests"]
    assert (http.kind, http.labels) == ("counter", frozenset({"route", "status"}))
    assert http.source.startswith("app/metrics.py:")
    assert names["loraplex_kv_cache_usage_ratio"].kind == "gauge"
    assert names["loraplex_adapters_resident"].labels == frozenset({"tier"})
    assert names["loraplex_time_to_first_token_seconds"].kind == "histogram"
    catalog = series_catalog()
    assert "loraplex_http_requests_total" in catalog  # counters: _total
    assert "loraplex_http_requests" not in catalog
    assert "loraplex_num_preemptions_total" in catalog  # a CounterMetricFamily too
    assert "le" in catalog["loraplex_gateway_overhead_seconds_bucket"]
    assert "le" not in catalog["loraplex_gateway_overhead_seconds_sum"]


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        ("rate(loraplx_http_requests_total[5m])", "unknown metric 'loraplx_http_requests_total'"),
        ("rate(loraplex_http_requests[5m])", "unknown metric 'loraplex_http_requests'"),
        ("loraplex_kv_cache_usage", "unknown metric 'loraplex_kv_cache_usage'"),
        ('sum(rate(loraplex_http_requests_total{code=~"5.."}[5m]))', "has no label 'code'"),
        ('loraplex_gateway_overhead_seconds_sum{le="0.1"}', "has no label 'le'"),
        ('{__name__="up"}', "without a metric name"),
    ],
)
def test_the_checker_catches_wrong_names(expr: str, problem: str) -> None:
    problems = promql_problems(expr)
    assert len(problems) == 1 and problem in problems[0], problems


def test_the_checker_reads_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, tenant) (rate('
        'loraplex_gateway_overhead_seconds_bucket{job=~"$job", tenant=~"$tenant"}'
        '[$__rate_interval]))) > bool 0.05 and on (instance) up offset 5m'
    )
    selectors = [(s.metric, s.labels) for s in promql_selectors(expr)]
    assert selectors == [
        ("loraplex_gateway_overhead_seconds_bucket", ["job", "tenant"]),
        ("up", []),
    ]
    assert promql_problems(expr) == []


# ----------------------------------------------------------------------- alert rules


def test_alert_rules_are_complete(rules: list[dict[str, Any]]) -> None:
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)) >= 10
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]


def test_alert_rules_name_only_exported_series(rules: list[dict[str, Any]]) -> None:
    problems = [p for rule in rules for p in promql_problems(rule["expr"])]
    assert problems == []


def test_alerts_cover_what_operators_watch(rules: list[dict[str, Any]]) -> None:
    named = {s.metric for rule in rules for s in promql_selectors(rule["expr"])}
    assert {
        "up", "loraplex_http_requests_total", "loraplex_num_requests_waiting",
        "loraplex_kv_cache_usage_ratio", "loraplex_rejections_total",
        "loraplex_usage_records_pending", "loraplex_directory_staleness_seconds",
        "loraplex_quota_fail_open_total", "loraplex_time_to_first_token_seconds_bucket",
        "loraplex_gateway_overhead_seconds_bucket", "loraplex_engine_failed",
        "loraplex_engine_step_failures_total",
    } <= named


def test_alert_jobs_are_the_scrape_jobs(rules: list[dict[str, Any]]) -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert {"loraplex-gateway", "loraplex-worker"} <= jobs
    for rule in rules:
        for value in re.findall(r'job=~?"([^"]+)"', rule["expr"]):
            matched = {job for job in jobs if re.fullmatch(value, job)}
            assert matched, f"{rule['alert']}: job {value!r} matches no scrape job"
            assert matched <= {"loraplex-gateway", "loraplex-worker"}


# ------------------------------------------------------------------------ dashboard


def test_dashboard_panels_query_the_provisioned_datasource(dashboard: dict[str, Any]) -> None:
    (datasource,) = load_yaml(DATASOURCES)["datasources"]
    assert datasource["type"] == "prometheus"
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": datasource["uid"]}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasource["uid"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"]["uid"] == datasource["uid"]


def test_dashboard_queries_name_only_exported_series(dashboard: dict[str, Any]) -> None:
    problems = [p for expr in _expressions(dashboard) for p in promql_problems(expr)]
    for variable in dashboard["templating"]["list"]:
        problems += grafana_query_problems(variable["query"]["query"])
        assert variable["definition"] == variable["query"]["query"]
    assert problems == []


def test_dashboard_uses_variables_it_defines(dashboard: dict[str, Any]) -> None:
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    used = {
        name for expr in _expressions(dashboard)
        for name in re.findall(r"\$(\w+)", expr) if not name.startswith("__")
    }
    assert used == defined == {"job", "tenant"}


def test_dashboard_shows_what_the_service_is_judged_by(dashboard: dict[str, Any]) -> None:
    text = "\n".join(_expressions(dashboard))
    for needle in (
        "sum by (tenant, status) (rate(loraplex_tenant_requests_total",
        "histogram_quantile(0.95, sum by (le) (rate(loraplex_time_to_first_token_seconds_bucket",
        "histogram_quantile(0.99, sum by (le) (rate(loraplex_gateway_overhead_seconds_bucket",
        "loraplex_kv_cache_usage_ratio",
        "loraplex_num_requests_waiting",
        "loraplex_adapters_resident",
        'loraplex_adapter_cache_lookups_total{job=~"$job", result="hit"}',
        "sum by (reason) (rate(loraplex_rejections_total",
        "loraplex_usage_records_pending",
    ):
        assert needle in text, needle
    assert dashboard["uid"] == "loraplex-overview"


def test_alert_rules_fire_as_their_promtool_tests_expect() -> None:
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    # `make test` installs it; a missing promtool fails rather than skips.
    assert promtool is not None, "promtool is not installed (Debian: apt-get install prometheus)"
    tests = DEPLOY / "prometheus" / "alerts.test.yaml"
    assert load_yaml(tests)["rule_files"] == ["alerts.yaml"]
    result = subprocess.run(
        [promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
