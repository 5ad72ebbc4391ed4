"""What the deploy tests share: the files under deploy/, the metric catalog read from
the source, a PromQL reference checker, and the `loraplex` command line as click sees it."""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import click
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CHART = DEPLOY / "helm" / "loraplex"
K8S_MANIFESTS = DEPLOY / "k8s" / "loraplex.yaml"
COMPOSE = DEPLOY / "compose.yaml"

GATEWAY_PORT = 8000
WORKER_PORT = 8100

# MIG profiles (nvidia.com/mig-<profile> under the device plugin's "mixed" strategy).
MIG_PROFILES = {
    "A100-40GB": ("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    "A100-80GB": ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H100-80GB": ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H200-141GB": ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
}
KNOWN_MIG_PROFILES = frozenset(p for profiles in MIG_PROFILES.values() for p in profiles)
_GPU_RESOURCE = re.compile(r"nvidia\.com/(gpu|mig-(?P<profile>\d+g\.\d+gb))")


def gpu_resource_problem(name: str) -> str | None:
    """None for `nvidia.com/gpu` or `nvidia.com/mig-<known profile>`, else why not."""
    match = _GPU_RESOURCE.fullmatch(name)
    if match is None:
        return f"{name!r} is neither nvidia.com/gpu nor nvidia.com/mig-<profile>"
    profile = match.group("profile")
    if profile is not None and profile not in KNOWN_MIG_PROFILES:
        return f"{name!r}: {profile} is not a MIG profile of {', '.join(MIG_PROFILES)}"
    return None


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_yaml_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def load_deploy_script(name: str) -> Any:
    """A Python script of deploy/ (not a package) as a module."""
    import importlib.util
    import sys

    module_name = f"deploy_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, DEPLOY / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def pyproject() -> dict[str, Any]:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())


def project_image() -> str:
    """The tag every deployment runs: loraplex:<version of pyproject>."""
    return f"loraplex:{pyproject()['project']['version']}"


# ------------------------------------------------------------------------- Dockerfile


@dataclass(slots=True)
class Instruction:
    keyword: str  # upper case
    args: str  # continuation lines joined
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        joined = " ".join(p for p in pending if p)
        keyword, _, args = joined.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
        pending = []
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return instructions


def exec_form(args: str) -> list[str]:
    """The JSON (exec) form of CMD / ENTRYPOINT / HEALTHCHECK CMD; shell form is refused."""
    import json

    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


# --------------------------------------------------------------------------- metrics

_WRAPPERS = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram",
             "Summary": "summary", "Info": "info", "Enum": "stateset"}
_FAMILIES = {"CounterMetricFamily": "counter", "GaugeMetricFamily": "gauge",
             "HistogramMetricFamily": "histogram", "SummaryMetricFamily": "summary",
             "InfoMetricFamily": "info"}
# Labels every scraped series gets from Prometheus.
TARGET_LABELS = frozenset({"job", "instance"})
BUILTIN_SERIES: dict[str, frozenset[str]] = {
    "up": frozenset(), "scrape_duration_seconds": frozenset(),
}


@dataclass(frozen=True, slots=True)
class MetricDef:
    name: str  # as declared (counters without `_total`)
    kind: str
    labels: frozenset[str]
    source: str  # path:line


def _str_list(node: ast.AST | None) -> list[str] | None:
    if isinstance(node, ast.List | ast.Tuple) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return [e.value for e in node.elts]  # type: ignore[attr-defined]
    return None


def _metric_defs_in(path: Path) -> Iterator[MetricDef]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        kind = _WRAPPERS.get(name or "") or _FAMILIES.get(name or "")
        first = node.args[0]
        if kind is None or not isinstance(first, ast.Constant) or not isinstance(
            first.value, str
        ):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        if name in _WRAPPERS:
            labels = _str_list(keywords.get("labelnames")) or (
                _str_list(node.args[2]) if len(node.args) > 2 else None
            )
        else:
            labels = _str_list(keywords.get("labels"))
        yield MetricDef(
            name=first.value,
            kind=kind,
            labels=frozenset(labels or ()),
            source=f"{path.relative_to(REPO)}:{node.lineno}",
        )


@cache
def metric_defs() -> tuple[MetricDef, ...]:
    """Every metric the service declares (app/ and engine/), read from the source."""
    defs: list[MetricDef] = []
    for package in ("app", "engine"):
        for path in sorted((REPO / package).rglob("*.py")):
            defs.extend(_metric_defs_in(path))
    return tuple(defs)


@cache
def series_catalog() -> dict[str, frozenset[str]]:
    """Exposed series name -> its labels (target labels and `le` included)."""
    catalog: dict[str, frozenset[str]] = {
        name: labels | TARGET_LABELS for name, labels in BUILTIN_SERIES.items()
    }
    for metric in metric_defs():
        labels = metric.labels | TARGET_LABELS
        if metric.kind == "counter":
            base = metric.name.removesuffix("_total")
            catalog[base + "_total"] = labels
            catalog[base + "_created"] = labels
        elif metric.kind == "histogram":
            catalog[metric.name + "_bucket"] = labels | {"le"}
            catalog[metric.name + "_sum"] = labels
            catalog[metric.name + "_count"] = labels
        elif metric.kind == "summary":
            catalog[metric.name] = labels | {"quantile"}
            catalog[metric.name + "_sum"] = labels
            catalog[metric.name + "_count"] = labels
        elif metric.kind == "info":
            catalog[metric.name + "_info"] = labels
        else:
            catalog[metric.name] = labels
    return catalog


# ---------------------------------------------------------------------------- PromQL

_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right",
                       "and", "or", "unless", "bool", "offset", "inf", "nan"})
_AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
                           "count_values", "bottomk", "topk", "quantile", "limitk",
                           "limit_ratio"})
_CLAUSES = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_GRAFANA_VARS = re.compile(r"\$__(rate_interval|interval|range)|\$\{__\w+\}")
_MATCHER = re.compile(r'\s*([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*')


@dataclass(slots=True)
class Selector:
    metric: str
    labels: list[str] = field(default_factory=list)


def _matchers(body: str) -> list[str]:
    labels: list[str] = []
    for part in _split_matchers(body):
        match = _MATCHER.fullmatch(part)
        if match is None:
            raise ValueError(f"cannot read label matcher {part!r}")
        labels.append(match.group(1))
    return labels


def _split_matchers(body: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for char in body:
        if quoted:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                quoted = False
        elif char == '"':
            quoted = True
        elif char == ",":
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return [p for p in parts if p.strip()]


def promql_selectors(expr: str) -> list[Selector]:
    """The series selectors of a PromQL expression (Grafana variables allowed)."""
    text = _GRAFANA_VARS.sub("5m", expr)
    selectors: list[Selector] = []
    i = 0
    n = len(text)
    skip_parens = False
    while i < n:
        char = text[i]
        if char.isspace() or char in ",+-*/%^=!<>)":
            i += 1
            continue
        if char == '"' or char == "'":
            end = i + 1
            while end < n and text[end] != char:
                end += 2 if text[end] == "\\" else 1
            i = end + 1
            continue
        if char == "[":
            i = text.index("]", i) + 1
            continue
        if char == "(":
            if skip_parens:  # the label list of by / without / on / ignoring / group_*
                i = text.index(")", i) + 1
                skip_parens = False
            else:
                i += 1
            continue
        if char == "{":  # a selector without a metric name
            end = text.index("}", i)
            selectors.append(Selector("", _matchers(text[i + 1:end])))
            i = end + 1
            continue
        if char.isdigit() or char == ".":
            match = re.match(r"[0-9.]+(e[+-]?\d+)?[smhdwy]?", text[i:])
            assert match is not None
            i += max(match.end(), 1)
            continue
        match = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text[i:])
        if match is None:
            raise ValueError(f"cannot read {text[i:]!r} in {expr!r}")
        word = match.group(0)
        i += match.end()
        rest = text[i:].lstrip()
        if word in _CLAUSES:
            skip_parens = rest.startswith("(")
            continue
        if word in _KEYWORDS:
            continue
        if rest.startswith("(") or (
            word in _AGGREGATIONS and re.match(r"(by|without)\s*\(", rest)
        ):
            continue  # a function or an aggregation
        selector = Selector(word)
        if rest.startswith("{"):
            start = text.index("{", i)
            end = text.index("}", start)
            selector.labels = _matchers(text[start + 1:end])
            i = end + 1
        selectors.append(selector)
    return selectors


def promql_problems(expr: str, catalog: dict[str, frozenset[str]] | None = None) -> list[str]:
    """What in `expr` names a series or a label that the service does not export."""
    catalog = series_catalog() if catalog is None else catalog
    problems: list[str] = []
    try:
        selectors = promql_selectors(expr)
    except ValueError as exc:
        return [str(exc)]
    if not selectors:
        problems.append(f"no series in {expr!r}")
    for selector in selectors:
        if not selector.metric:
            problems.append(f"a selector without a metric name in {expr!r}")
            continue
        labels = catalog.get(selector.metric)
        if labels is None:
            problems.append(f"unknown metric {selector.metric!r} in {expr!r}")
            continue
        for label in selector.labels:
            if label not in labels and label != "__name__":
                problems.append(
                    f"{selector.metric} has no label {label!r} "
                    f"(it has {sorted(labels)}) in {expr!r}"
                )
    return problems


_LABEL_VALUES = re.compile(r"label_values\((?:(?P<expr>.+),\s*)?(?P<label>[a-zA-Z_]\w*)\)")


def grafana_query_problems(query: str) -> list[str]:
    """A template variable's query: `label_values(SELECTOR, label)` or plain PromQL."""
    match = _LABEL_VALUES.fullmatch(query.strip())
    if match is None:
        return promql_problems(query)
    if match.group("expr") is None:
        return [f"label_values without a metric in {query!r}: it scans every series"]
    problems = promql_problems(match.group("expr"))
    label = match.group("label")
    for selector in promql_selectors(match.group("expr")):
        labels = series_catalog().get(selector.metric)
        if labels is not None and label not in labels:
            problems.append(f"{selector.metric} has no label {label!r} in {query!r}")
    return problems


# ------------------------------------------------------------------------- the CLI


@dataclass(slots=True)
class CliCheck:
    args: list[str]
    command_path: list[str]  # e.g. ["db", "upgrade"]
    missing: str | None = None  # the first subcommand the CLI does not have
    error: str | None = None  # a usage error click raised on the arguments


def check_cli(args: list[str]) -> CliCheck:
    """Resolve `loraplex ARGS` against the click app and parse its options the way click
    would when it runs (types, choices, callbacks), without running the command."""
    from app.cli import main

    command: click.Command = main
    rest = list(args)
    path: list[str] = []
    while isinstance(command, click.Group):
        if not rest or rest[0].startswith("-"):
            return CliCheck(args, path, error=f"`loraplex {' '.join(path)}` needs a subcommand")
        name = rest.pop(0)
        sub = command.commands.get(name)
        if sub is None:
            return CliCheck(args, [*path, name], missing=" ".join([*path, name]))
        command = sub
        path.append(name)
    try:
        with command.make_context(f"loraplex {' '.join(path)}", rest):
            pass
    except click.ClickException as exc:
        return CliCheck(args, path, error=exc.format_message())
    return CliCheck(args, path)


def cli_problems(invocations: list[list[str]]) -> list[str]:
    """What is wrong with `loraplex` invocations: unknown subcommands, options, values."""
    problems: list[str] = []
    for args in invocations:
        result = check_cli(args)
        shown = shlex.join(["loraplex", *args])
        if result.missing is not None:
            problems.append(f"{shown}: no such command {result.missing!r}")
        elif result.error is not None:
            problems.append(f"{shown}: {result.error}")
    return problems


def settings_env_names() -> set[str]:
    """Environment variables that the settings of gateways (Settings), workers
    (WorkerSettings) and the engine read."""
    from app.core import config

    names = {"LORAPLEX_DATA_DIR"}  # engine/config.py reads it too
    for cls in (config.Settings, getattr(config, "WorkerSettings", None)):
        if cls is None:
            continue
        for name, info in cls.model_fields.items():
            names.add(f"LORAPLEX_{name.upper()}")
            alias = info.validation_alias
            choices = getattr(alias, "choices", None) or (
                [alias] if isinstance(alias, str) else []
            )
            names.update(str(c).upper() for c in choices)
    return names


def env_problems(env: dict[str, Any], where: str) -> list[str]:
    """LORAPLEX_* / *_URL variables that no settings class reads (a typo)."""
    known = settings_env_names()
    return [
        f"{where}: {name} is not a setting (known: {sorted(known)})"
        for name in env
        if (name.startswith("LORAPLEX_") or name.endswith("_URL")) and name not in known
    ]


async def probe(kind: str, paths: set[str]) -> dict[str, int]:
    """GET each path of the app that `loraplex <kind>` serves (gateway and serve: the API
    app; worker: the internal app), in process, around a FakeEngine: path -> status."""
    import tempfile

    import httpx

    from tests.utils.fake_engine import FakeEngine, asgi_client, make_app

    with tempfile.TemporaryDirectory(prefix="loraplex-deploy-test-") as tmp:
        data_dir = Path(tmp)
        if kind in ("gateway", "serve"):
            app, _ = make_app(data_dir=data_dir)
            client = asgi_client(app)
        elif kind == "worker":
            from engine.remote.worker_app import create_worker_app

            app = create_worker_app(
                FakeEngine(), token="t" * 32, data_dir=data_dir,
                render_metrics=lambda: b"# metrics\n",
            )
            client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://testserver"
            )
        else:
            raise AssertionError(f"no app for {kind!r}")
        async with client:
            return {path: (await client.get(path)).status_code for path in sorted(paths)}
