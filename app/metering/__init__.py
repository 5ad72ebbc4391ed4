"""Usage metering: one UsageRecord per API request, through a durable batched outbox.

    recorder = UsageRecorder(session_factory(engine), data_dir / "spool" / "usage")
    recorder.start()                      # replays what a previous process left
    recorder.record(UsageEvent(...))      # on the hot path: microseconds, no database
    recorder.close()                      # at shutdown: flush, leave the rest spooled

Reports over the records: `usage_report()` in app.metering.reports.
"""

from app.metering.events import UsageEvent
from app.metering.recorder import UsageRecorder
from app.metering.spool import SpoolBusyError

__all__ = ["SpoolBusyError", "UsageEvent", "UsageRecorder"]
