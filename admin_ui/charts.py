"""Bar charts as geometry for an inline SVG (templates/macros.html draws them): drawn on
the server, so that they need no script, print as they look and read in a screen reader
through their table and labels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, timedelta

WIDTH = 640
HEIGHT = 200
_TOP = 12
_BOTTOM = 36  # room for the labels
_LEFT = 56  # room for the scale
_RIGHT = 8
_GAP = 0.2  # of each bar's slot


@dataclass(frozen=True, slots=True)
class Bar:
    label: str
    value: int
    x: float
    y: float
    width: float
    height: float
    show_label: bool  # only every few labels fit under many bars


@dataclass(frozen=True, slots=True)
class Tick:
    value: int
    y: float


@dataclass(frozen=True, slots=True)
class BarChart:
    title: str
    unit: str
    bars: tuple[Bar, ...]
    ticks: tuple[Tick, ...]
    width: int = WIDTH
    height: int = HEIGHT
    left: int = _LEFT
    baseline: float = HEIGHT - _BOTTOM

    @property
    def total(self) -> int:
        return sum(bar.value for bar in self.bars)

    @property
    def summary(self) -> str:
        """What the chart shows, in words (its accessible description)."""
        if not self.bars:
            return f"No {self.unit} in this range."
        peak = max(self.bars, key=lambda b: b.value)
        return (
            f"{self.total:,} {self.unit} over {len(self.bars)} bars; "
            f"the most, {peak.value:,}, at {peak.label}."
        )


def _nice_ceiling(value: int) -> int:
    """The smallest 1, 2 or 5 times a power of ten that is at least `value`."""
    if value <= 1:
        return 1
    magnitude = 1
    while True:
        for step in (1, 2, 5):
            if step * magnitude >= value:
                return step * magnitude
        magnitude *= 10


def bar_chart(title: str, unit: str, points: Sequence[tuple[str, int]]) -> BarChart:
    """One bar per (label, value), scaled to the largest value, with a 0/half/top scale."""
    plot_w = WIDTH - _LEFT - _RIGHT
    plot_h = HEIGHT - _TOP - _BOTTOM
    top = _nice_ceiling(max((v for _, v in points), default=0))
    slot = plot_w / max(1, len(points))
    # About 12 labels fit along the axis.
    label_every = max(1, -(-len(points) // 12))
    bars = []
    for i, (label, value) in enumerate(points):
        height = plot_h * value / top
        bars.append(Bar(
            label=label,
            value=value,
            x=round(_LEFT + i * slot + slot * _GAP / 2, 2),
            y=round(_TOP + plot_h - height, 2),
            width=round(slot * (1 - _GAP), 2),
            height=round(height, 2),
            show_label=i % label_every == 0,
        ))
    ticks = tuple(
        Tick(value=v, y=round(_TOP + plot_h - plot_h * v / top, 2))
        for v in sorted({0, top // 2, top})
    )
    return BarChart(title=title, unit=unit, bars=tuple(bars), ticks=ticks)


def days(start: date, end: date) -> list[date]:
    """Every day from `start` up to, not including, `end`."""
    return [start + timedelta(days=i) for i in range((end - start).days)]
