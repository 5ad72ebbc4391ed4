"""Bodies of GET /v1/usage and GET /admin/usage."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel

from app.metering.reports import GroupBy, UsageRow, UsageTotals


class UsageReport(BaseModel):
    object: Literal["usage_report"] = "usage_report"
    tenant_id: str | None  # None: every tenant (admin)
    start: datetime  # inclusive, UTC
    end: datetime  # exclusive, UTC
    group_by: GroupBy | None
    data: list[UsageRow]
    totals: UsageTotals  # cost: the rows' costs summed, when all are in one currency
