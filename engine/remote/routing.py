"""Which worker serves a request: pure functions over what the heartbeats say.

1. The pool: a tenant that workers are dedicated to goes only to those workers; a tenant
   marked dedicated with none of them alive gets no worker (the caller answers 503);
   everyone else goes to the shared workers (those dedicated to nobody).
2. Base-model requests: the least loaded worker of the pool.
3. Adapter requests: a worker that has the adapter in a device slot, then one with a copy
   in host memory, then (cold) the first worker in the adapter's rendezvous order, so
   that one adapter lands on few workers and keeps landing there as workers come and go.

NOTE: every tier skips workers loaded beyond `LoadBound` (consistent hashing with
bounded loads, Mirrokni et al. 2018): a hot adapter spills to the next worker instead of
queueing behind one; when all are beyond it, the least loaded one takes the request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker in rotation, as routing sees it."""

    worker_id: str
    load: int  # requests running or waiting on it
    adapters_device: frozenset[str] = frozenset()
    adapters_host: frozenset[str] = frozenset()
    dedicated_tenants: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class RouteQuery:
    adapter: str | None  # the engine's adapter name; None: the base model
    tenant_id: str | None = None
    tenant_name: str | None = None  # workers may name their tenants by id or by name
    dedicated: bool = False  # the tenant's isolation is "dedicated"

    @property
    def tenant_keys(self) -> frozenset[str]:
        return frozenset(k for k in (self.tenant_id, self.tenant_name) if k)


@dataclass(frozen=True, slots=True)
class LoadBound:
    """A worker is overloaded above `factor` x the pool's mean load + `slack` requests."""

    factor: float = 1.25
    slack: int = 8

    def limit(self, pool: Sequence[Candidate]) -> float:
        mean = sum(c.load for c in pool) / len(pool)
        return self.factor * mean + self.slack


def rendezvous_score(key: str, worker_id: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, worker_ids: Iterable[str]) -> list[str]:
    """Highest random weight first: removing a worker moves only the keys it ranked
    first; adding one takes from each other worker only the keys it now ranks first."""
    return sorted(worker_ids, key=lambda w: (-rendezvous_score(key, w), w))


def pool_for(candidates: Sequence[Candidate], query: RouteQuery) -> list[Candidate]:
    keys = query.tenant_keys
    own = [c for c in candidates if keys & c.dedicated_tenants]
    if own or query.dedicated:
        return own
    return [c for c in candidates if not c.dedicated_tenants]


def _least_loaded(pool: Iterable[Candidate], order: dict[str, int]) -> Candidate | None:
    return min(pool, key=lambda c: (c.load, order.get(c.worker_id, 0), c.worker_id),
               default=None)


def choose_worker(
    candidates: Sequence[Candidate],
    query: RouteQuery,
    *,
    exclude: frozenset[str] = frozenset(),
    bound: LoadBound = LoadBound(),
) -> str | None:
    """The worker for `query` among `candidates` less `exclude`; None if the pool is empty."""
    pool = [c for c in pool_for(candidates, query) if c.worker_id not in exclude]
    if not pool:
        return None
    if query.adapter is None:
        chosen = _least_loaded(pool, {})
        assert chosen is not None
        return chosen.worker_id
    adapter = query.adapter
    ranks = {w: i for i, w in enumerate(rendezvous_order(adapter, (c.worker_id for c in pool)))}
    limit = bound.limit(pool)
    within = [c for c in pool if c.load <= limit]
    for tier in (
        [c for c in within if adapter in c.adapters_device],
        [c for c in within if adapter in c.adapters_host],
    ):
        chosen = _least_loaded(tier, ranks)
        if chosen is not None:
            return chosen.worker_id
    if within:
        return min(within, key=lambda c: ranks[c.worker_id]).worker_id
    chosen = _least_loaded(pool, ranks)
    assert chosen is not None
    return chosen.worker_id
