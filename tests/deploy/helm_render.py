"""A small renderer of the Go-template subset the loraplex chart uses, so that the chart
can be checked without `helm`: it renders `deploy/helm/loraplex` the way
`helm template` does, and refuses (ValueError) anything outside the subset, which
keeps the chart's templates simple.

Supported: `{{ }}` with `{{-` / `-}}` trimming and `/* */` comments; `if` / `else` /
`end`; `range PIPELINE` (rebinds `.`); fields of `.`, `$` and `.Values`, `.Release`,
`.Chart`; string, number and boolean literals; `( )` around a pipeline used as an
argument; pipelines `|` through `quote`, `toYaml`, `toJson`, `nindent`, `indent`,
`default`, `int`, `not`, `and`, `or` (Go's: the deciding argument, evaluated left to
right only as far as needed), `eq`, `ne` (two strings, numbers or booleans; anything else
is refused, where Go would compare or fail), `print` (fmt.Sprint) and Helm's `fail`
(ChartFailure, as `helm template` fails with the message).

NOTE: like Helm, numbers in values are float64 (values pass through JSON): `{{ 1000000 }}`
prints `1e+06`, so templates must pipe numbers that can grow through `int`. A missing
value printed is an error here (Helm prints an empty string), to catch typos.

    python -m tests.deploy.helm_render deploy/helm/loraplex [-f values.yaml] [--name loraplex]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

_ACTION = re.compile(r"\{\{(-?)(.*?)(-?)\}\}", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(\.\d+)?")


# ------------------------------------------------------------------------------- parse


@dataclass(slots=True)
class _Text:
    text: str


@dataclass(slots=True)
class _Print:
    pipeline: str


@dataclass(slots=True)
class _If:
    pipeline: str
    then: list[Any] = field(default_factory=list)
    otherwise: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class _Range:
    pipeline: str
    body: list[Any] = field(default_factory=list)


def _lex(source: str) -> list[_Text | tuple[str, str]]:
    """Text pieces and ("action", body) pairs, with `{{-` / `-}}` trimming applied."""
    pieces: list[_Text | tuple[str, str]] = []
    pos = 0
    trim_next = False
    for match in _ACTION.finditer(source):
        text = source[pos:match.start()]
        if trim_next:
            text = text.lstrip(" \t\r\n")
        if match.group(1):
            text = text.rstrip(" \t\r\n")
        pieces.append(_Text(text))
        body = match.group(2).strip()
        if not (body.startswith("/*") and body.endswith("*/")):
            pieces.append(("action", body))
        trim_next = bool(match.group(3))
        pos = match.end()
    tail = source[pos:]
    pieces.append(_Text(tail.lstrip(" \t\r\n") if trim_next else tail))
    return pieces


def _parse(source: str) -> list[Any]:
    root: list[Any] = []
    stack: list[tuple[Any, list[Any]]] = [(None, root)]
    for piece in _lex(source):
        out = stack[-1][1]
        if isinstance(piece, _Text):
            out.append(piece)
            continue
        body = piece[1]
        keyword, _, rest = body.partition(" ")
        if keyword == "if":
            node = _If(rest.strip())
            out.append(node)
            stack.append((node, node.then))
        elif keyword == "range":
            if ":=" in rest:
                raise ValueError(f"range with variables is outside the subset: {body!r}")
            node_r = _Range(rest.strip())
            out.append(node_r)
            stack.append((node_r, node_r.body))
        elif keyword == "else":
            opened = stack[-1][0]
            if not isinstance(opened, _If) or rest.strip():
                raise ValueError(f"unsupported else: {body!r}")
            stack[-1] = (opened, opened.otherwise)
        elif keyword == "end":
            if len(stack) == 1:
                raise ValueError("{{ end }} without a block")
            stack.pop()
        elif keyword in {"with", "define", "template", "include", "block"} or ":=" in body:
            raise ValueError(f"outside the subset: {{{{ {body} }}}}")
        else:
            out.append(_Print(body))
    if len(stack) != 1:
        raise ValueError("unclosed {{ if }} or {{ range }}")
    return root


# ---------------------------------------------------------------------------- evaluate


def _go_float(value: float) -> str:
    """Go's %v of a float64 (strconv 'g', shortest): 8000 -> 8000, 1e6 -> 1e+06."""
    if math.isinf(value) or math.isnan(value):
        raise ValueError(f"cannot print {value}")
    if value == 0:
        return "0"
    _, digit_tuple, exponent = Decimal(repr(abs(value))).normalize().as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple))
    point = len(digits) + exponent  # value = 0.<digits> * 10**point
    exp10 = point - 1
    prefix = "-" if value < 0 else ""
    if exp10 < -4 or exp10 >= 6:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{prefix}{mantissa}e{'-' if exp10 < 0 else '+'}{abs(exp10):02d}"
    if point <= 0:
        return f"{prefix}0.{'0' * -point}{digits}"
    if point >= len(digits):
        return prefix + digits + "0" * (point - len(digits))
    return f"{prefix}{digits[:point]}.{digits[point:]}"


def _to_text(value: Any) -> str:
    if value is None:
        raise ValueError("a template printed a missing value")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _go_float(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return value
    raise ValueError(f"printing a {type(value).__name__} needs toYaml or toJson")


def _truthy(value: Any) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, int | float | str | list | dict):
        return bool(value)
    return True


def _plain(value: Any) -> Any:
    """Values as JSON would carry them: integral floats print as integers."""
    if isinstance(value, float) and value == int(value) and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _to_yaml(value: Any) -> str:
    return yaml.safe_dump(_plain(value), default_flow_style=False, sort_keys=True).rstrip("\n")


def _indent(width: int | float, text: str) -> str:
    pad = " " * int(width)
    return pad + text.replace("\n", "\n" + pad)


def _default(fallback: Any, value: Any = None) -> Any:
    return value if _truthy(value) else fallback


def _quote(value: Any) -> str:
    return json.dumps(_to_text(value))


class ChartFailure(ValueError):
    """A template called `fail`: the values are wrong in a way the chart explains."""


def _fail(message: Any) -> Any:
    raise ChartFailure(_to_text(message))


def _comparable(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    raise ValueError(f"eq / ne of a {type(value).__name__} is outside the subset")


def _eq(left: Any, right: Any) -> bool:
    if _comparable(left) != _comparable(right):
        raise ValueError(f"eq / ne of {left!r} and {right!r}: incompatible types")
    return bool(left == right)


def _print(*values: Any) -> str:
    """fmt.Sprint: a space between two operands only when neither is a string."""
    out: list[str] = []
    for index, value in enumerate(values):
        if index and not isinstance(value, str) and not isinstance(values[index - 1], str):
            out.append(" ")
        out.append(_to_text(value))
    return "".join(out)


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quote": _quote,
    "toYaml": _to_yaml,
    "toJson": lambda v: json.dumps(_plain(v), separators=(",", ":"), sort_keys=True),
    "nindent": lambda width, text: "\n" + _indent(width, text),
    "indent": _indent,
    "default": _default,
    "int": lambda v: int(float(v)) if v is not None and v != "" else 0,
    "not": lambda v: not _truthy(v),
    "eq": _eq,
    "ne": lambda left, right: not _eq(left, right),
    "print": _print,
    "fail": _fail,
}
# Go evaluates these arguments lazily: `and .a .a.b` never looks at .a.b when .a is empty.
_LAZY = {"and": False, "or": True}  # the truthiness that decides


def _split(text: str, sep: str) -> list[str]:
    """Split on `sep` outside double-quoted strings and parentheses."""
    parts: list[str] = []
    current: list[str] = []
    quoted = False
    escaped = False
    depth = 0
    for char in text:
        if quoted:
            current.append(char)
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                quoted = False
            continue
        if char == '"':
            quoted = True
            current.append(char)
        elif char == "(":
            depth += 1
            current.append(char)
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced parentheses in {text!r}")
            current.append(char)
        elif depth == 0 and ((sep == " " and char.isspace()) or char == sep):
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if quoted:
        raise ValueError(f"unterminated string in {text!r}")
    if depth:
        raise ValueError(f"unbalanced parentheses in {text!r}")
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()] if sep == " " else [p.strip() for p in parts]


def _lookup(base: Any, path: str, where: str) -> Any:
    value = base
    for name in (p for p in path.split(".") if p):
        if value is None:
            raise ValueError(f"{where}: field {name!r} of a missing value")
        if not isinstance(value, dict):
            raise ValueError(f"{where}: field {name!r} of a {type(value).__name__}")
        value = value.get(name)
    return value


@dataclass(slots=True)
class _Scope:
    dot: Any
    root: dict[str, Any]


def _term(token: str, scope: _Scope) -> Any:
    if token.startswith("("):
        if not token.endswith(")"):
            raise ValueError(f"fields of a parenthesized value are outside the subset: {token!r}")
        return _pipeline(token[1:-1], scope)
    if token.startswith('"'):
        return json.loads(token)
    if token in {"true", "false"}:
        return token == "true"
    if token == "nil":
        return None
    if _NUMBER.fullmatch(token):
        return float(token) if "." in token else int(token)
    if token == ".":
        return scope.dot
    if token == "$":
        return scope.root
    if token.startswith("$."):
        return _lookup(scope.root, token[2:], token)
    if token.startswith("."):
        return _lookup(scope.dot, token[1:], token)
    raise ValueError(f"unknown term {token!r}")


def _command(text: str, scope: _Scope, piped: tuple[Any] | tuple[()]) -> Any:
    tokens = _split(text, " ")
    if not tokens:
        raise ValueError("empty command in a pipeline")
    name = tokens[0]
    if name in _LAZY:
        operands = tokens[1:]
        count = len(operands) + len(piped)
        if count < 2:
            raise ValueError(f"{name} needs two arguments or more: {text!r}")
        value: Any = None
        for index in range(count):
            value = _term(operands[index], scope) if index < len(operands) else next(iter(piped))
            if index < count - 1 and _truthy(value) == _LAZY[name]:
                break
        return value
    if name in _FUNCTIONS:
        args = [_term(t, scope) for t in tokens[1:]] + list(piped)
        return _FUNCTIONS[name](*args)
    if name[0].isalpha() and name not in {"true", "false", "nil"}:
        raise ValueError(f"function {name!r} is outside the subset")
    if len(tokens) != 1 or piped:
        raise ValueError(f"cannot apply a value: {text!r}")
    return _term(name, scope)


def _pipeline(text: str, scope: _Scope) -> Any:
    first, *rest = _split(text, "|")
    value = _command(first, scope, ())
    for stage in rest:
        value = _command(stage, scope, (value,))
    return value


def _render(nodes: list[Any], scope: _Scope, out: list[str]) -> None:
    for node in nodes:
        if isinstance(node, _Text):
            out.append(node.text)
        elif isinstance(node, _Print):
            out.append(_to_text(_pipeline(node.pipeline, scope)))
        elif isinstance(node, _If):
            branch = node.then if _truthy(_pipeline(node.pipeline, scope)) else node.otherwise
            _render(branch, scope, out)
        elif isinstance(node, _Range):
            items = _pipeline(node.pipeline, scope)
            if items is None:
                continue
            if not isinstance(items, list):
                raise ValueError("range over anything but a list is outside the subset")
            for item in items:
                _render(node.body, _Scope(item, scope.root), out)


def render_template(source: str, context: dict[str, Any]) -> str:
    out: list[str] = []
    _render(_parse(source), _Scope(context, context), out)
    return "".join(out)


# ------------------------------------------------------------------------------- chart


def _as_helm_values(value: Any) -> Any:
    """Values as Helm holds them: every number a float64."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, dict):
        return {str(k): _as_helm_values(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_helm_values(v) for v in value]
    raise ValueError(f"unsupported value {value!r}")


def merge_values(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing: maps merge key by key, anything else is replaced."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_values(merged[key], value)
        else:
            merged[key] = value
    return merged


@dataclass(slots=True)
class RenderedFile:
    template: str  # path relative to the chart, e.g. templates/gateway-service.yaml
    text: str


def render_chart(
    chart_dir: Path,
    *,
    release: str = "loraplex",
    namespace: str = "default",
    values: dict[str, Any] | None = None,
) -> list[RenderedFile]:
    """Each template of the chart rendered (NOTES.txt included, `_*` partials not)."""
    chart = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    defaults = yaml.safe_load((chart_dir / "values.yaml").read_text()) or {}
    merged = merge_values(defaults, values or {})
    context = {
        "Values": _as_helm_values(merged),
        "Release": {"Name": release, "Namespace": namespace, "Service": "Helm"},
        "Chart": {
            "Name": chart["name"],
            "Version": str(chart["version"]),
            "AppVersion": str(chart.get("appVersion", "")),
        },
    }
    rendered = []
    for path in sorted((chart_dir / "templates").iterdir()):
        if path.name.startswith("_") or not path.is_file():
            continue
        rendered.append(
            RenderedFile(
                template=str(path.relative_to(chart_dir)),
                text=render_template(path.read_text(), context),
            )
        )
    return rendered


def manifests(files: list[RenderedFile]) -> list[dict[str, Any]]:
    """The Kubernetes objects of rendered templates (NOTES.txt and empty documents left out)."""
    docs: list[dict[str, Any]] = []
    for rendered in files:
        if not rendered.template.endswith((".yaml", ".yml")):
            continue
        docs.extend(d for d in yaml.safe_load_all(rendered.text) if d is not None)
    return docs


def to_stream(files: list[RenderedFile], chart_name: str) -> str:
    """The rendered manifests the way `helm template` prints them."""
    chunks = []
    for rendered in files:
        if not rendered.template.endswith((".yaml", ".yml")):
            continue
        for doc in re.split(r"^---[ \t]*$", rendered.text, flags=re.MULTILINE):
            if doc.strip() and yaml.safe_load(doc) is not None:
                chunks.append(f"---\n# Source: {chart_name}/{rendered.template}\n{doc.strip()}\n")
    return "".join(chunks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chart", type=Path)
    parser.add_argument("-f", "--values", type=Path, action="append", default=[])
    parser.add_argument("--name", default="loraplex")
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for path in args.values:
        values = merge_values(values, yaml.safe_load(path.read_text()) or {})
    chart_name = yaml.safe_load((args.chart / "Chart.yaml").read_text())["name"]
    files = render_chart(args.chart, release=args.name, values=values)
    sys.stdout.write(to_stream(files, chart_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
