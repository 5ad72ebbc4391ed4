"""Routing decisions: pools, device > host > cold (rendezvous) > least loaded, bounded loads."""

from __future__ import annotations

import pytest

from engine.remote.routing import (
    Candidate,
    LoadBound,
    RouteQuery,
    choose_worker,
    pool_for,
    rendezvous_order,
)

WORKERS = [f"w{i}" for i in range(6)]


def _c(worker_id: str, load: int = 0, *, device: tuple[str, ...] = (),
       host: tuple[str, ...] = (), dedicated: tuple[str, ...] = ()) -> Candidate:
    return Candidate(worker_id, load, frozenset(device), frozenset(host), frozenset(dedicated))


def test_base_model_goes_to_the_least_loaded_worker() -> None:
    workers = [_c("a", 5), _c("b", 2), _c("c", 9)]
    assert choose_worker(workers, RouteQuery(adapter=None)) == "b"
    # Ties break by worker id, so that the choice is stable.
    assert choose_worker([_c("b", 1), _c("a", 1)], RouteQuery(adapter=None)) == "a"


def test_device_beats_host_beats_cold() -> None:
    query = RouteQuery(adapter="x")
    on_device = [_c("a", 3, host=("x",)), _c("b", 4, device=("x",)), _c("c", 0)]
    assert choose_worker(on_device, query) == "b"
    on_host = [_c("a", 3, host=("x",)), _c("b", 4), _c("c", 0)]
    assert choose_worker(on_host, query) == "a"
    # Among device holders, the least loaded.
    two = [_c("a", 6, device=("x",)), _c("b", 2, device=("x",)), _c("c", 0)]
    assert choose_worker(two, query) == "b"


def test_cold_adapter_goes_to_its_first_rendezvous_worker_whatever_the_load() -> None:
    workers = [_c(w, load) for w, load in zip(WORKERS, [3, 0, 7, 1, 2, 5], strict=True)]
    for adapter in ("alpha", "beta", "gamma", "av/ver_123"):
        expected = rendezvous_order(adapter, WORKERS)[0]
        assert choose_worker(workers, RouteQuery(adapter=adapter)) == expected


def test_rendezvous_is_stable_when_a_worker_leaves_or_joins() -> None:
    keys = [f"adapter-{i}" for i in range(400)]
    before = {k: rendezvous_order(k, WORKERS)[0] for k in keys}
    # w3 leaves: only its keys move, and they spread over the others.
    after = {k: rendezvous_order(k, [w for w in WORKERS if w != "w3"])[0] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "w3"}
    assert len({after[k] for k in moved}) == 5
    # w6 joins: keys move only to w6, about 1/7 of them.
    joined = {k: rendezvous_order(k, [*WORKERS, "w6"])[0] for k in keys}
    moved = {k for k in keys if before[k] != joined[k]}
    assert {joined[k] for k in moved} == {"w6"}
    assert 30 <= len(moved) <= 90
    # The order does not depend on the order workers are listed in.
    assert rendezvous_order("k", WORKERS) == rendezvous_order("k", list(reversed(WORKERS)))


def test_overloaded_holders_spill_to_the_next_tier() -> None:
    bound = LoadBound(factor=1.0, slack=2)  # limit: mean load + 2
    query = RouteQuery(adapter="x")
    # mean = (20 + 0 + 1) / 3 = 7: the device holder at 20 is past 9.
    workers = [_c("a", 20, device=("x",)), _c("b", 0), _c("c", 1, host=("x",))]
    assert choose_worker(workers, query, bound=bound) == "c"
    # No holder within the bound: the adapter's rendezvous order among those within.
    workers = [_c("a", 20, device=("x",)), _c("b", 0), _c("c", 1)]
    assert choose_worker(workers, query, bound=bound) == rendezvous_order("x", ["b", "c"])[0]


def test_excluded_workers_are_skipped() -> None:
    workers = [_c("a", 0, device=("x",)), _c("b", 5)]
    assert choose_worker(workers, RouteQuery(adapter="x"), exclude=frozenset({"a"})) == "b"
    assert choose_worker(workers, RouteQuery(adapter="x"), exclude=frozenset({"a", "b"})) is None
    assert choose_worker([], RouteQuery(adapter=None)) is None


@pytest.mark.parametrize("adapter", [None, "x"])
def test_dedicated_tenants_get_their_own_workers_only(adapter: str | None) -> None:
    workers = [
        _c("shared-1", 0, device=("x",)),
        _c("shared-2", 0),
        _c("acme-1", 9, dedicated=("acme",)),
        _c("acme-2", 7, dedicated=("acme", "other")),
    ]
    acme = RouteQuery(adapter=adapter, tenant_id="acme", dedicated=True)
    assert [c.worker_id for c in pool_for(workers, acme)] == ["acme-1", "acme-2"]
    assert choose_worker(workers, acme) in {"acme-1", "acme-2"}
    if adapter is None:
        assert choose_worker(workers, acme) == "acme-2"  # the less loaded of its two
    # Everyone else stays off dedicated workers, even when those are idle.
    shared = RouteQuery(adapter=adapter, tenant_id="small-co")
    assert {c.worker_id for c in pool_for(workers, shared)} == {"shared-1", "shared-2"}
    assert choose_worker(
        [_c("shared", 50), _c("acme", 0, dedicated=("acme",))], shared
    ) == "shared"
    # A dedicated tenant whose workers are all gone gets none (the API answers 503)...
    assert choose_worker([w for w in workers if not w.worker_id.startswith("acme")], acme) is None
    # ...while a workload dedicated to a tenant not marked dedicated still goes there.
    other = RouteQuery(adapter=adapter, tenant_id="other")
    assert choose_worker(workers, other) == "acme-2"
    # Workers may name their tenant by id or by (unique) name.
    by_name = [_c("shared", 0), _c("acme-slice", 3, dedicated=("acme-corp",))]
    named = RouteQuery(adapter=adapter, tenant_id="t_123", tenant_name="acme-corp",
                       dedicated=True)
    assert choose_worker(by_name, named) == "acme-slice"
    assert choose_worker(by_name, RouteQuery(adapter=adapter, tenant_name="other")) == "shared"
