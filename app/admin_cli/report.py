"""What `adapters push` prints: the validation report and the smoke run, side by side."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Report fields in the order people look for them; anything else follows, sorted.
_REPORT_ORDER = (
    "rank", "alpha", "use_rslora", "target_modules", "size_bytes", "config_bytes",
    "weights_bytes", "memory_bytes",
)
_SIZE_FIELDS = frozenset({"size_bytes", "config_bytes", "weights_bytes", "memory_bytes"})
_LABELS = {
    "use_rslora": "rsLoRA",
    "target_modules": "target modules",
    "size_bytes": "size (unpacked)",
    "config_bytes": "config",
    "weights_bytes": "weights",
    "memory_bytes": "memory (served)",
}


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _value(name: str, value: Any) -> str:
    if name in _SIZE_FIELDS and isinstance(value, int):
        return human_bytes(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) or "-"
    return str(value)


def format_version(version: Mapping[str, Any], owner: str) -> list[str]:
    """The lines of a version's validation report (ready: its shape; failed: the reason)."""
    rows: list[tuple[str, str]] = [
        ("adapter", f"{version['name']} ({owner})"),
        ("status", str(version["status"])),
        ("version", str(version["version"]) + (
            f"  (model: {version['name']}@{version['version']})"
            if version["status"] == "ready" else ""
        )),
        ("id", f"{version['adapter_id']} / version {version['id']}"),
    ]
    report = dict(version.get("report") or {})
    error = report.pop("error", None)
    if error is not None:
        rows.append(("reason", str(error)))
    names = [n for n in _REPORT_ORDER if n in report]
    names += sorted(n for n in report if n not in _REPORT_ORDER)
    rows += [(_LABELS.get(n, n.replace("_", " ")), _value(n, report[n])) for n in names]
    if version.get("sha256"):
        rows.append(("sha256", str(version["sha256"])))
    width = max(len(label) for label, _ in rows)
    return [f"  {label.ljust(width)}  {value}" for label, value in rows]


@dataclass(frozen=True, slots=True)
class SmokeAnswer:
    """One prompt answered greedily by the base model and by the adapter."""

    prompt: str
    base: str
    adapted: str

    @property
    def changed(self) -> bool:
        return self.base.strip() != self.adapted.strip()


def _wrap(text: str, width: int) -> list[str]:
    lines: list[str] = []
    for paragraph in text.strip().splitlines() or [""]:
        lines += textwrap.wrap(paragraph, width) or [""]
    return lines


def format_smoke(
    answers: list[SmokeAnswer], *, base_label: str, adapter_label: str, width: int
) -> list[str]:
    """Each prompt, then the two answers in columns, then whether the adapter changed it."""
    column = max(20, (width - 3) // 2)
    out: list[str] = []
    for i, answer in enumerate(answers, 1):
        out.append(f"[{i}] {answer.prompt}")
        left = [base_label, "-" * min(column, max(len(base_label), 4))]
        right = [adapter_label, "-" * min(column, max(len(adapter_label), 4))]
        left += _wrap(answer.base, column)
        right += _wrap(answer.adapted, column)
        for j in range(max(len(left), len(right))):
            a = left[j] if j < len(left) else ""
            b = right[j] if j < len(right) else ""
            out.append(f"{a.ljust(column)} | {b}".rstrip())
        out.append("    -> changed by the adapter" if answer.changed else "    -> same answer")
        out.append("")
    num_changed = sum(a.changed for a in answers)
    out.append(
        f"Smoke run: the adapter changed {num_changed} of {len(answers)} answers "
        "(greedy, temperature 0)."
    )
    return out
