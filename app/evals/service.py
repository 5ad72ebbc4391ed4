"""Evals of adapter versions: started through the admin API (or `loraplex admin adapters
eval`), run in the background on this replica's engine, their progress and scores kept
with the version in the database.

One eval scores an eval set (app/evals/dataset.py) on the version asked for (default:
the latest ready one), on the promoted version before it (the one plain `name` served
before it), and on the base model. At most one eval runs per adapter, and at most
MAX_RUNNING_PER_OWNER per tenant (shared adapters count as one owner); a stop or a
failed engine request ends it as failed, with the reason.

The promotion gate: an adapter with a gate eval set stages every new version (plain
`name` keeps resolving to the current one, which keeps serving). Once the staged version
is ready, `start_gate` runs the gate set on it; if it scores at least what the current
version scores (and at least the adapter's threshold, where one is set) it is promoted,
else it stays staged (the eval's `gate_outcome` says why). Both versions are loaded by
then, so requests switch to the new one with no gap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.audit import AuditContext
from app.core.errors import Conflict, InvalidInput, NotFound, ServiceError
from app.core.principal import AdapterRef
from app.db import session_scope
from app.evals.dataset import EvalSet, EvalSetError, parse_eval_set
from app.evals.runner import Target, score
from app.registry.service import AdapterRegistry
from app.registry.views import SHARED_OWNER, AdapterView, VersionView
from app.tables import Adapter, AdapterEval, AdapterStatus, EvalStatus, new_id, utcnow
from engine.client import EngineClient

log = logging.getLogger("loraplex.evals")

MAX_RUNNING_PER_OWNER = 2
# A "running" eval this old is taken for one whose server died: it no longer blocks.
STALE_AFTER = timedelta(hours=6)
# Progress reaches the database at most this often (other replicas and the CLI read it).
PROGRESS_INTERVAL_S = 1.0
# A gate eval waits this long at most for another eval of its adapter to end.
GATE_WAIT_S = 600.0
GATE_ACTOR = AuditContext(actor="gate")


@dataclass(frozen=True, slots=True)
class EvalView:
    id: str
    adapter_id: str
    version: int
    previous_version: int | None
    status: EvalStatus
    set_sha256: str
    num_items: int
    done_items: int
    total_items: int  # num_items x the models scored
    scores: dict[str, float | None]
    error: str | None
    created_by: str | None
    created_at: datetime
    finished_at: datetime | None
    gate: bool = False  # run by the promotion gate on a staged version
    gate_outcome: str | None = None  # "promoted", or why the version stays staged

    @classmethod
    def of(cls, row: AdapterEval) -> EvalView:
        models = 2 + (row.previous_version is not None)
        return cls(
            id=row.id, adapter_id=row.adapter_id, version=row.version,
            previous_version=row.previous_version, status=EvalStatus(row.status),
            set_sha256=row.set_sha256, num_items=row.num_items, done_items=row.done_items,
            total_items=row.num_items * models, scores=dict(row.scores or {}),
            error=row.error, created_by=row.created_by, created_at=row.created_at,
            finished_at=row.finished_at, gate=bool(row.gate), gate_outcome=row.gate_outcome,
        )


class EvalService:
    def __init__(
        self,
        db: sessionmaker[Session],
        engine: EngineClient,
        registry: AdapterRegistry,
        ready_ref: Callable[[str], AdapterRef | None],
        on_promoted: Callable[[], None] = lambda: None,
    ) -> None:
        """ready_ref: version id -> the ready version as this replica's directory has it;
        on_promoted: called (in a worker thread) after the gate promoted a version."""
        self.db = db
        self.engine = engine
        self.registry = registry
        self._ready_ref = ready_ref
        self._on_promoted = on_promoted
        self._tasks: dict[str, asyncio.Task[None]] = {}  # eval id -> its run
        self._gates: set[asyncio.Task[None]] = set()  # gates waiting for a running eval

    # -- starting ------------------------------------------------------------------------

    async def start(
        self, adapter_id: str, data: bytes, *, version: int | None, by: AuditContext,
        owner: str | None = None, gate: bool = False,
    ) -> EvalView:
        """Check and record the eval, then run it in the background. owner: a tenant's
        id to restrict to its own adapters (None: any, as admins)."""
        adapter = await asyncio.to_thread(self.registry.get_adapter, adapter_id, owner=owner)
        try:
            eval_set = await asyncio.to_thread(parse_eval_set, data)
        except EvalSetError as e:
            raise InvalidInput(str(e), code="invalid_eval_set") from None
        target, previous = _versions(adapter, version)
        refs = [self._ready_ref(v.id) for v in (target, previous) if v is not None]
        if any(ref is None for ref in refs):
            raise Conflict(f"version {target.version} of '{adapter.name}' is not served on "
                           "this replica yet; retry shortly", code="adapter_unavailable")
        row = await asyncio.to_thread(self._record, adapter, target, previous, eval_set, by,
                                      gate)
        self._tasks[row.id] = asyncio.get_running_loop().create_task(
            self._run(row.id, eval_set, [r for r in refs if r is not None], previous is not None),
            name=f"eval-{row.id}",
        )
        return EvalView.of(row)

    def _record(self, adapter: AdapterView, target: VersionView,
                previous: VersionView | None, eval_set: EvalSet,
                by: AuditContext, gate: bool = False) -> AdapterEval:
        with session_scope(self.db) as s:
            running = []
            for row in s.scalars(select(AdapterEval).join(Adapter).where(
                Adapter.owner == (adapter.tenant_id or SHARED_OWNER),
                AdapterEval.status == EvalStatus.RUNNING.value,
            )):
                if row.created_at < utcnow() - STALE_AFTER:
                    row.status, row.error = EvalStatus.FAILED.value, "abandoned"
                    row.finished_at = utcnow()
                else:
                    running.append(row)
            if any(r.adapter_id == adapter.id for r in running):
                raise Conflict(f"an eval of '{adapter.name}' is already running; wait for it",
                               code="eval_running")
            if len(running) >= MAX_RUNNING_PER_OWNER:
                raise Conflict(f"{MAX_RUNNING_PER_OWNER} evals of this owner's adapters are "
                               "already running; wait for one", code="eval_running")
            row = AdapterEval(
                id=new_id("evl"), adapter_id=adapter.id, version_id=target.id,
                version=target.version,
                previous_version=None if previous is None else previous.version,
                status=EvalStatus.RUNNING.value, set_sha256=eval_set.sha256,
                num_items=len(eval_set.items), done_items=0, scores={},
                created_by=by.actor, gate=gate,
            )
            s.add(row)
            s.flush()
            s.expunge(row)
            return row

    # -- running -------------------------------------------------------------------------

    async def _run(self, eval_id: str, eval_set: EvalSet, refs: list[AdapterRef],
                   has_previous: bool) -> None:
        targets = [Target("version", refs[0].engine_name)]
        if has_previous:
            targets.append(Target("previous", refs[1].engine_name))
        targets.append(Target("base", None))
        done = 0
        last_write = 0.0
        # NOTE: the progress is written on a worker thread, one write at a time: a database
        # commit on the event loop held every other tenant's request that the loop was
        # serving meanwhile (an SQLite commit syncs to disk).
        writing: asyncio.Future[None] | None = None

        def on_item() -> None:
            nonlocal done, last_write, writing
            done += 1
            if (time.monotonic() - last_write >= PROGRESS_INTERVAL_S
                    and (writing is None or writing.done())):
                last_write = time.monotonic()
                writing = asyncio.ensure_future(
                    asyncio.to_thread(self._write, eval_id, done_items=done))

        async def written() -> None:  # before the final write, which must land last
            if writing is not None:
                await asyncio.shield(writing)

        scores: dict[str, float | None] = {"version": None, "previous": None, "base": None}
        try:
            for target in targets:
                if target.adapter is not None:
                    reason = await self.registry.engine_sync.ensure_loaded(
                        refs[0] if target.label == "version" else refs[1])
                    if reason is not None:
                        raise RuntimeError(f"{target.label}: {reason}")
                scores[target.label] = round(
                    await score(self.engine, eval_set.items, target, on_item=on_item), 6)
        except asyncio.CancelledError:
            await written()
            await asyncio.to_thread(self._finish, eval_id, scores, done,
                                    "the server stopped while the eval ran")
            raise
        except Exception as e:
            log.warning("eval %s failed: %s", eval_id, e)
            await written()
            await asyncio.to_thread(self._finish, eval_id, scores, done, str(e)[:1000])
        else:
            await written()
            await asyncio.to_thread(self._finish, eval_id, scores, done, None)
            await asyncio.to_thread(self._decide_gate, eval_id)
        finally:
            self._tasks.pop(eval_id, None)

    # -- the promotion gate ----------------------------------------------------------------

    def start_gate(self, version: VersionView, by: AuditContext) -> None:
        """After an upload made `version` (ready): if it is staged and its adapter has a
        gate set, run the gate eval in the background (once an eval of the adapter that is
        already running ends)."""
        if not version.staged or version.status != AdapterStatus.READY:
            return
        task = asyncio.get_running_loop().create_task(
            self._gate_when_free(version, by), name=f"gate-{version.id}")
        self._gates.add(task)
        task.add_done_callback(self._gates.discard)

    async def _gate_when_free(self, version: VersionView, by: AuditContext) -> None:
        gate_set, _ = await asyncio.to_thread(self.registry.gate_of, version.adapter_id)
        if gate_set is None:
            return  # staged by hand: promoted by hand
        deadline = time.monotonic() + GATE_WAIT_S
        while True:
            try:
                await self.start(version.adapter_id, gate_set, version=version.version, by=by,
                                 gate=True)
                return
            except Conflict as e:
                if e.code not in ("eval_running", "adapter_unavailable") \
                        or time.monotonic() > deadline:
                    log.warning("gate eval of %s v%d not started: %s", version.name,
                                version.version, e)
                    return
            except Exception as e:  # the adapter went, the set no longer parses...
                log.warning("gate eval of %s v%d not started: %s", version.name,
                            version.version, e)
                return
            await asyncio.sleep(1.0)

    def _decide_gate(self, eval_id: str) -> None:
        with session_scope(self.db) as s:
            row = s.get(AdapterEval, eval_id)
            if row is None or not row.gate or row.status != EvalStatus.DONE.value:
                return
            adapter_id, version = row.adapter_id, row.version
            scores = dict(row.scores or {})
        _, threshold = self.registry.gate_of(adapter_id)
        ours, theirs = scores.get("version"), scores.get("previous")
        if ours is None:
            outcome = "kept staged: the version was not scored"
        elif theirs is not None and ours < theirs:
            outcome = f"kept staged: scored {ours:g}, below the current version's {theirs:g}"
        elif threshold is not None and ours < threshold:
            outcome = f"kept staged: scored {ours:g}, below the threshold {threshold:g}"
        else:
            try:
                self.registry.promote(adapter_id, version, by=GATE_ACTOR,
                                      reason=f"gate eval {eval_id}: scored {ours:g}")
            except ServiceError as e:  # deleted, promoted or rolled past meanwhile
                outcome = f"not promoted: {e}"[:256]
            else:
                outcome = "promoted"
                self._on_promoted()
        self._write(eval_id, gate_outcome=outcome)
        log.info("gate of adapter %s v%d: %s", adapter_id, version, outcome)

    def _write(self, eval_id: str, **fields: Any) -> None:
        try:
            with session_scope(self.db) as s:
                row = s.get(AdapterEval, eval_id)
                if row is not None:
                    for name, value in fields.items():
                        setattr(row, name, value)
        except Exception:
            log.warning("eval %s: progress not recorded", eval_id, exc_info=True)

    def _finish(self, eval_id: str, scores: dict[str, float | None], done: int,
                error: str | None) -> None:
        self._write(
            eval_id, scores=scores, done_items=done, error=error, finished_at=utcnow(),
            status=(EvalStatus.FAILED if error else EvalStatus.DONE).value,
        )

    async def stop(self) -> None:
        tasks = [*self._gates, *self._tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def wait(self, eval_id: str) -> None:
        """Until the eval running here ends (tests, the demo)."""
        task = self._tasks.get(eval_id)
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    # -- reading -------------------------------------------------------------------------

    def list_evals(self, adapter_id: str, *, owner: str | None = None) -> list[EvalView]:
        self.registry.get_adapter(adapter_id, owner=owner)  # 404s as the adapter would
        with session_scope(self.db) as s:
            rows = s.scalars(select(AdapterEval).where(AdapterEval.adapter_id == adapter_id)
                             .order_by(AdapterEval.created_at, AdapterEval.id))
            return [EvalView.of(r) for r in rows]

    def get_eval(self, eval_id: str, *, owner: str | None = None) -> EvalView:
        with session_scope(self.db) as s:
            row = s.get(AdapterEval, eval_id)
            view = None if row is None else EvalView.of(row)
        if view is None:
            raise NotFound(f"no eval {eval_id!r}")
        self.registry.get_adapter(view.adapter_id, owner=owner)
        return view


def _versions(adapter: AdapterView, version: int | None
              ) -> tuple[VersionView, VersionView | None]:
    """The version to score (default: the latest ready) and the one to compare it with:
    the newest promoted (not staged) ready version before it, else the ready one before
    it."""
    ready = [v for v in adapter.versions if v.status == AdapterStatus.READY]
    if not ready:
        raise Conflict(f"'{adapter.name}' has no ready version to evaluate",
                       code="no_ready_version")
    if version is None:
        target = ready[-1]
    else:
        found = [v for v in ready if v.version == version]
        if not found:
            raise InvalidInput(f"'{adapter.name}' has no ready version {version}",
                               param="version")
        target = found[0]
    before = [v for v in ready if v.version < target.version]
    promoted = [v for v in before if not v.staged]
    compared = promoted or before
    return target, compared[-1] if compared else None
