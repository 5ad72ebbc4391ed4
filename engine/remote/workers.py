"""A gateway's view of the workers: the latest heartbeats, who is in rotation, and what
this gateway knows that the heartbeats do not say yet (its own requests in flight, the
adapters it registered since the last beat)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from engine.client import AdapterInfo
from engine.remote.heartbeat import Heartbeat
from engine.remote.routing import Candidate

log = logging.getLogger("loraplex.gateway")

# A worker taken out of rotation after a failed call comes back once it has beaten this
# many times since: a killed worker's last beat lives until its key expires, and must
# not bring it back.
RECOVERY_BEATS = 2


@dataclass(slots=True)
class KnownWorker:
    beat: Heartbeat
    # Adapters this gateway registered on this instance that no beat has listed yet.
    registered: set[str] = field(default_factory=set)
    # The seq of the beat current when a call failed; None: not suspended.
    suspended_at: int | None = None

    @property
    def worker_id(self) -> str:
        return self.beat.worker_id

    @property
    def url(self) -> str:
        return self.beat.url

    @property
    def in_rotation(self) -> bool:
        return self.beat.ready and not self.beat.draining and self.suspended_at is None

    def has_adapter(self, name: str) -> bool:
        return name in self.registered or name in self.beat.adapters_registered


class WorkerPool:
    def __init__(self, model_id: str, *, recovery_beats: int = RECOVERY_BEATS) -> None:
        self.model_id = model_id
        self.recovery_beats = recovery_beats
        self._workers: dict[str, KnownWorker] = {}
        self.inflight: Counter[str] = Counter()  # worker id -> this gateway's open requests
        self._warned_models: set[tuple[str, str]] = set()
        # Workers' own adapters (`--lora`): name -> info (the first worker's, by id), and
        # name -> the workers that have it.
        self._preloaded: dict[str, AdapterInfo] = {}
        self._preloaded_by: dict[str, frozenset[str]] = {}

    def update(self, beats: list[Heartbeat]) -> None:
        """The alive workers are exactly those with a heartbeat in `beats`."""
        workers: dict[str, KnownWorker] = {}
        for beat in beats:
            if beat.model_id != self.model_id:
                if (beat.worker_id, beat.model_id) not in self._warned_models:
                    self._warned_models.add((beat.worker_id, beat.model_id))
                    log.warning("worker %s serves %s, not %s: left out of rotation",
                                beat.worker_id, beat.model_id, self.model_id)
                continue
            known = self._workers.get(beat.worker_id)
            if known is None or known.beat.instance != beat.instance:
                if known is None:
                    log.info("worker %s joined (%s)", beat.worker_id, beat.url)
                else:
                    log.info("worker %s restarted", beat.worker_id)
                workers[beat.worker_id] = KnownWorker(beat)
                continue
            if beat.seq > known.beat.seq:
                known.beat = beat
                known.registered -= set(beat.adapters_registered)
            if (
                known.suspended_at is not None
                and known.beat.seq >= known.suspended_at + self.recovery_beats
            ):
                log.info("worker %s back in rotation", beat.worker_id)
                known.suspended_at = None
            workers[beat.worker_id] = known
        for worker_id in self._workers.keys() - workers.keys():
            log.info("worker %s left (no heartbeat)", worker_id)
        self._workers = workers
        infos: dict[str, AdapterInfo] = {}
        holders: dict[str, set[str]] = {}
        for worker_id in sorted(workers):
            for info in workers[worker_id].beat.adapters_preloaded:
                infos.setdefault(info.name, info)
                holders.setdefault(info.name, set()).add(worker_id)
        # NOTE: replaced whole, not mutated: admin routes read these from worker threads.
        self._preloaded = infos
        self._preloaded_by = {name: frozenset(ids) for name, ids in holders.items()}

    def suspend(self, worker_id: str, reason: str) -> None:
        """Out of rotation until it beats `recovery_beats` more times (or restarts)."""
        known = self._workers.get(worker_id)
        if known is not None and known.suspended_at is None:
            log.warning("worker %s out of rotation: %s", worker_id, reason)
            known.suspended_at = known.beat.seq

    def preloaded(self) -> dict[str, AdapterInfo]:
        """The adapters workers were started with (`--lora`), by name."""
        return self._preloaded

    def preloading(self, name: str) -> frozenset[str]:
        """The ids of the workers started with adapter `name` (`--lora`)."""
        return self._preloaded_by.get(name, frozenset())

    def get(self, worker_id: str) -> KnownWorker | None:
        return self._workers.get(worker_id)

    def all(self) -> list[KnownWorker]:
        return [self._workers[w] for w in sorted(self._workers)]

    def in_rotation(self) -> list[KnownWorker]:
        return [w for w in self.all() if w.in_rotation]

    def candidates(self) -> list[Candidate]:
        return [
            Candidate(
                worker_id=w.worker_id,
                # NOTE: the beat is up to an interval old; this gateway's own requests
                # since then are known exactly.
                load=max(w.beat.load, self.inflight[w.worker_id]),
                adapters_device=frozenset(w.beat.adapters_device),
                adapters_host=frozenset(w.beat.adapters_host),
                dedicated_tenants=frozenset(w.beat.dedicated_tenants),
            )
            for w in self.in_rotation()
        ]
