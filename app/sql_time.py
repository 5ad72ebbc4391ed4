"""UTC calendar text of a timestamp column ('YYYY-MM-DD' days, 'YYYY-MM' billing months),
the same on SQLite and PostgreSQL, for grouping usage rows in SQL.

NOTE: no bound parameters inside, so that the same text in SELECT and GROUP BY is the
same expression to PostgreSQL.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sqlalchemy import String
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement


class _UtcText(FunctionElement[str]):
    type = String()
    inherit_cache = True
    sqlite_format: ClassVar[str]
    postgresql_format: ClassVar[str]


class utc_day(_UtcText):
    """The UTC date of a timestamp, 'YYYY-MM-DD'."""

    name = "utc_day"
    inherit_cache = True
    sqlite_format = "%Y-%m-%d"
    postgresql_format = "YYYY-MM-DD"


class utc_month(_UtcText):
    """The UTC month of a timestamp, 'YYYY-MM' (a billing period)."""

    name = "utc_month"
    inherit_cache = True
    sqlite_format = "%Y-%m"
    postgresql_format = "YYYY-MM"


def _sqlite(element: _UtcText, compiler: SQLCompiler, **kw: Any) -> str:
    # SQLite keeps naive UTC text ('YYYY-MM-DD HH:MM:SS.ffffff').
    return f"strftime('{element.sqlite_format}', {compiler.process(element.clauses, **kw)})"


def _postgresql(element: _UtcText, compiler: SQLCompiler, **kw: Any) -> str:
    # timestamptz -> UTC wall time first: to_char alone would use the session's time zone.
    column = compiler.process(element.clauses, **kw)
    return f"to_char(({column}) AT TIME ZONE 'UTC', '{element.postgresql_format}')"


for _kind in (utc_day, utc_month):
    compiles(_kind, "sqlite")(_sqlite)
    compiles(_kind, "postgresql")(_postgresql)
