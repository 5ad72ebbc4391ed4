"""How `loraplex bench serve` shows its figures: a table per rate, one line per rate
for the sweep, and a plot of latency and goodput against the offered rate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from bench.serve.stats import SLO, RateSummary, rate_label


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1000:.1f}"


def _opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def rate_table(summary: RateSummary, slo: SLO) -> str:
    """The figures of one rate, one per line."""
    s, server = summary, summary.server
    rows = [
        ("offered rate (req/s)", s.rate_label),
        ("requests sent / completed / errors",
         f"{s.num_requests} / {s.num_completed} / {s.num_errors}"),
        ("duration (s)", f"{s.duration_s:.2f}"),
        ("achieved request rate (req/s)", f"{s.request_throughput:.3f}"),
        ("output tokens/s", f"{s.output_throughput:.1f}"),
        ("TTFT p50 / p99 (ms)", f"{_ms(s.ttft_s.p50)} / {_ms(s.ttft_s.p99)}"),
        ("TPOT p50 / p99 (ms)", f"{_ms(s.tpot_s.p50)} / {_ms(s.tpot_s.p99)}"),
        ("ITL p50 / p99 (ms)", f"{_ms(s.itl_s.p50)} / {_ms(s.itl_s.p99)}"),
        ("e2e p50 / p99 (ms)", f"{_ms(s.e2e_s.p50)} / {_ms(s.e2e_s.p99)}"),
        (f"goodput (TTFT<={slo.ttft_s:g}s, TPOT<={slo.tpot_s:g}s)",
         f"{s.goodput:.3f} req/s ({s.goodput_fraction:.0%})"),
        ("client send lag max (ms)", _ms(s.send_lag_max_s)),
    ]
    if server is not None:
        rows += [
            ("KV cache usage mean / max",
             f"{_opt(server.kv_usage_mean, '.1%')} / {_opt(server.kv_usage_max, '.1%')}"),
            ("running / waiting max",
             f"{_opt(server.running_max, '.0f')} / {_opt(server.waiting_max, '.0f')}"),
            ("prefix cache hit rate", _opt(server.prefix_cache_hit_rate, ".1%")),
            ("KV blocks filled mean / min",
             f"{_opt(server.kv_filled_mean, '.1%')} / {_opt(server.kv_filled_min, '.1%')}"),
            ("engine step mean (ms)", _ms(server.mean_step_s)),
        ]
        if server.rss_peak_mib is not None:
            rows.append(("server RSS peak / end (MiB)",
                         f"{server.rss_peak_mib:.0f} / {_opt(server.rss_end_mib, '.0f')}"))
        if server.rss_peak_since_start_mib is not None:
            rows.append(("server RSS peak since its start, VmHWM (MiB)",
                         f"{server.rss_peak_since_start_mib:.0f}"))
    rows += [(f"error: {error}", str(n)) for error, n in s.errors.items()]
    width = max(len(label) for label, _ in rows)
    title = f" rate {s.rate_label} req/s "
    lines = [title.center(width + 16, "=")]
    lines += [f"{label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)


_SWEEP_COLUMNS = (
    "rate", "req/s", "tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
    "e2e p50", "e2e p99", "goodput", "good%", "errors", "KV max", "prefix hit",
)


def sweep_table(summaries: Sequence[RateSummary]) -> str:
    """One line per rate; latencies in ms."""
    rows = [list(_SWEEP_COLUMNS)]
    for s in summaries:
        server = s.server
        rows.append([
            s.rate_label, f"{s.request_throughput:.2f}", f"{s.output_throughput:.1f}",
            _ms(s.ttft_s.p50), _ms(s.ttft_s.p99), _ms(s.tpot_s.p50), _ms(s.tpot_s.p99),
            _ms(s.e2e_s.p50), _ms(s.e2e_s.p99), f"{s.goodput:.2f}", f"{s.goodput_fraction:.0%}",
            str(s.num_errors),
            _opt(server.kv_usage_max if server else None, ".0%"),
            _opt(server.prefix_cache_hit_rate if server else None, ".0%"),
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(_SWEEP_COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
                     for row in rows)


def plot_sweep(summaries: Sequence[RateSummary], slo: SLO, path: Path) -> None:
    """TTFT, TPOT (p50 and p99, ms) and goodput against the offered rate, side by side;
    the rates are evenly spaced categories, so that inf has a place too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")
    # Minor ticks of a log axis: 2 and 5 of each decade are labelled, the rest would crowd.
    sparse = FuncFormatter(lambda value, _: f"{value:g}" if f"{value:e}"[0] in "25" else "")

    labels = [rate_label(s.rate) for s in summaries]
    x = list(range(len(summaries)))
    fig, (ttft, tpot, good) = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = ((ttft, "TTFT", "ttft_s", slo.ttft_s), (tpot, "TPOT", "tpot_s", slo.tpot_s))
    for axes, name, field, objective in panels:
        for pct, style in (("p50", "o-"), ("p99", "s--")):
            axes.plot(x, [getattr(getattr(s, field), pct) * 1000 for s in summaries], style,
                      label=f"{name} {pct}")
        axes.axhline(objective * 1000, color="grey", linestyle=":", label="SLO")
        axes.set_title(f"{name} (ms)")
        axes.set_ylabel("ms, log scale")
        axes.set_yscale("log")  # the objective and figures far below it both show
        axes.yaxis.set_major_formatter(plain)
        axes.yaxis.set_minor_formatter(sparse)
    offered = [math.nan if math.isinf(s.rate) else s.rate for s in summaries]
    good.plot(x, offered, "x:", color="grey", label="offered")
    good.plot(x, [s.request_throughput for s in summaries], "o-", label="completed")
    good.plot(x, [s.goodput for s in summaries], "s-", label="within SLO")
    good.set_title("throughput (req/s)")
    good.set_ylabel("req/s")
    for axes in (ttft, tpot, good):
        axes.set_xticks(x, labels)
        axes.set_xlabel("offered rate (req/s)")
        axes.grid(alpha=0.3)
        axes.legend()
    fig.suptitle(f"loraplex bench serve (SLO: TTFT <= {slo.ttft_s:g} s, "
                 f"TPOT <= {slo.tpot_s:g} s)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
