"""An invoice as CSV (for spreadsheets and accounting imports) and as a printable HTML page."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime
from html import escape

from app.billing.invoice import InvoiceLine
from app.billing.views import InvoiceView

CSV_COLUMNS = (
    "kind", "description", "adapter_id", "incurred_in", "tokens", "quantity", "unit_price",
    "amount",
)
# Cells a spreadsheet could take for a formula (CSV injection).
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_TEXT_COLUMNS = frozenset({"description", "adapter_id"})


def _cell(column: str, value: object) -> str:
    text = "" if value is None else str(value)
    if column in _TEXT_COLUMNS and text.startswith(_FORMULA_START):
        return "'" + text
    return text


def invoice_csv(view: InvoiceView) -> str:
    """A header, one row per line, then a `total` row whose amount is the invoice's total
    (the sum of the lines' amounts)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(CSV_COLUMNS)
    for line in view.lines:
        values = line.model_dump(mode="json")
        writer.writerow([_cell(column, values[column]) for column in CSV_COLUMNS])
    writer.writerow(["total", f"{view.currency} total, {view.status}", "", view.period,
                     "", "", "", str(view.total)])
    return buffer.getvalue()


def csv_filename(view: InvoiceView) -> str:
    return f"invoice-{view.tenant_id}-{view.period}.csv"


_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; color: #111; margin: 2rem auto; max-width: 58rem; }
h1 { font-size: 1.6rem; margin: 0 0 .25rem; }
.meta { color: #444; margin-bottom: 1.5rem; }
.meta span { margin-right: 1.5rem; }
.draft { color: #a40; font-weight: 600; }
table { border-collapse: collapse; width: 100%; }
th, td { padding: .35rem .5rem; border-bottom: 1px solid #ddd; text-align: left; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tfoot td { border-bottom: none; }
tfoot tr.total td { font-weight: 700; font-size: 1.1rem; border-top: 2px solid #111; }
@media print { body { margin: 0; } .noprint { display: none; } }
"""


def quantity_text(line: InvoiceLine) -> str:
    """What a line counts, in the units a reader checks it in."""
    if line.tokens is not None:
        return f"{line.tokens:,} tokens"
    if line.kind == "hosting":
        return f"{line.quantity} adapter-months"
    return str(line.quantity)


def unit_price_text(line: InvoiceLine) -> str:
    if line.tokens is not None:
        return f"{line.unit_price} per 1M tokens"
    if line.kind == "hosting":
        return f"{line.unit_price} per adapter-month"
    return str(line.unit_price)


def _money(view: InvoiceView, amount: object) -> str:
    return f"{escape(str(amount))} {escape(view.currency)}"


def invoice_html(view: InvoiceView) -> str:
    """A standalone page (no scripts, no external assets) that prints as the invoice."""
    created = datetime.fromtimestamp(view.created_at, UTC).strftime("%Y-%m-%d")
    finalized = (
        datetime.fromtimestamp(view.finalized_at, UTC).strftime("%Y-%m-%d")
        if view.finalized_at is not None
        else None
    )
    status = (
        f"final, {finalized}" if finalized
        else '<span class="draft">DRAFT: may change until finalised</span>'
    )
    rows = "\n".join(
        "<tr>"
        f"<td>{escape(line.description)}</td>"
        f"<td>{escape(line.incurred_in)}</td>"
        f'<td class="num">{escape(quantity_text(line))}</td>'
        f'<td class="num">{escape(unit_price_text(line))}</td>'
        f'<td class="num">{_money(view, line.amount)}</td>'
        "</tr>"
        for line in view.lines
    ) or '<tr><td colspan="5">No charges in this period.</td></tr>'
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Invoice {escape(view.id)} ({escape(view.period)})</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>Invoice {escape(view.id)}</h1>
<div class="meta">
<span>Tenant <strong>{escape(view.tenant_id)}</strong></span>
<span>Period <strong>{escape(view.period)}</strong></span>
<span>Plan <strong>{escape(view.plan)}</strong></span>
<span>Issued {created}</span>
<span>Status {status}</span>
</div>
<table>
<thead><tr><th>Description</th><th>Month</th><th class="num">Quantity</th>
<th class="num">Unit price</th><th class="num">Amount</th></tr></thead>
<tbody>
{rows}
</tbody>
<tfoot>
<tr><td colspan="4">Subtotal (usage and hosting)</td>
<td class="num">{_money(view, view.subtotal)}</td></tr>
<tr><td colspan="4">Monthly minimum top-up</td>
<td class="num">{_money(view, view.minimum_top_up)}</td></tr>
<tr><td colspan="4">Adjustments</td>
<td class="num">{_money(view, view.adjustments)}</td></tr>
<tr class="total"><td colspan="4">Total</td>
<td class="num" id="invoice-total">{_money(view, view.total)}</td></tr>
</tfoot>
</table>
<p class="meta">Each amount is tokens / 1,000,000 (or adapter-months) times the unit
price, rounded half-to-even to the currency's minor unit.</p>
</body>
</html>
"""
