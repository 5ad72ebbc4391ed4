"""The in-memory directory: authentication without SQL, adapter resolution across
tenants, and changes made by one replica reaching another."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, update
from sqlalchemy.orm import Session, sessionmaker

from app import tenants as crud
from app.api.errors import APIError, service_error
from app.audit import AuditContext
from app.core.errors import ServiceError
from app.core.principal import AdapterRef, Principal, Quotas, TenantInfo
from app.core.security import generate_key
from app.db import make_engine, session_factory, session_scope
from app.directory import Directory
from app.tables import (
    Adapter,
    AdapterStatus,
    AdapterVersion,
    ApiKey,
    Isolation,
    Scope,
    Tier,
    new_id,
    utcnow,
)

SECRET = "directory-test-secret-0123456789abcdef0123"
ADMIN_KEY = "operator chosen bootstrap key 42"
BY = AuditContext(actor="test", request_id="req-1")
ALL = frozenset({"inference", "adapters:write"})


@pytest.fixture
def db_engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def db(db_engine: Engine) -> sessionmaker[Session]:
    return session_factory(db_engine)


def directory(db: sessionmaker[Session], *, interval: float = 0.5, load: bool = True) -> Directory:
    made = Directory(db, secret=SECRET, admin_key=ADMIN_KEY, refresh_interval_s=interval)
    if load:
        made.load()
    return made


def refusal(directory: Directory, header: str | None) -> APIError:
    with pytest.raises(ServiceError) as caught:
        directory.authenticate(header)
    error = service_error(caught.value)
    assert (error.status_code, error.code, error.type) == (
        401, "invalid_api_key", "invalid_request_error"
    )
    assert error.headers == {"WWW-Authenticate": "Bearer"}
    return error


def accepted(directory: Directory, header: str) -> bool:
    try:
        directory.authenticate(header)
    except ServiceError:
        return False
    return True


def make_tenant(db: sessionmaker[Session], name: str = "acme", **fields: Any) -> str:
    with session_scope(db) as session:
        return crud.create_tenant(session, name=name, by=BY, **fields).id


def make_key(db: sessionmaker[Session], tenant_id: str, **fields: Any) -> crud.CreatedKey:
    with session_scope(db) as session:
        return crud.create_tenant_key(
            session, secret=SECRET, tenant_id=tenant_id, name="k", by=BY, **fields
        )


# ----------------------------------------------------------------------- authenticate


def test_tenant_key_gives_its_tenant_and_scopes(db: sessionmaker[Session]) -> None:
    tenant_id = make_tenant(
        db, tier=Tier.PREMIUM, isolation=Isolation.DEDICATED, plan="pro",
        quotas=Quotas(rpm=60, tpm=1000, max_tokens=256),
    )
    created = make_key(db, tenant_id, scopes=[Scope.INFERENCE, Scope.ADAPTERS_WRITE])
    d = directory(db)
    tenant = TenantInfo(
        id=tenant_id, name="acme", tier=Tier.PREMIUM, isolation=Isolation.DEDICATED,
        plan="pro", quotas=Quotas(rpm=60, tpm=1000, max_tokens=256), disabled=False,
    )
    assert d.authenticate(f"Bearer {created.key}") == Principal(
        actor=created.row.id, key_id=created.row.id, tenant=tenant, is_admin=False,
        scopes=frozenset({"inference", "adapters:write"}),
    )
    # The scheme is case-insensitive, surrounding blanks are not part of the key.
    assert d.authenticate(f"bearer   {created.key} ").key_id == created.row.id
    assert d.tenant(tenant_id) == tenant
    assert d.tenant("ten_missing") is None


def test_bootstrap_and_stored_admin_keys(db: sessionmaker[Session]) -> None:
    with session_scope(db) as session:
        admin = crud.create_admin_key(session, secret=SECRET, name="ops", by=BY)
    d = directory(db)
    assert d.authenticate(f"Bearer {ADMIN_KEY}") == Principal(
        actor="bootstrap", key_id=None, tenant=None, is_admin=True, scopes=ALL
    )
    assert admin.key.startswith("lpx_a_")
    assert d.authenticate(f"Bearer {admin.key}") == Principal(
        actor=admin.row.id, key_id=admin.row.id, tenant=None, is_admin=True, scopes=ALL
    )
    # Without a bootstrap key configured, its string is just a malformed key.
    no_bootstrap = Directory(db, secret=SECRET, admin_key=None, refresh_interval_s=1)
    no_bootstrap.load()
    assert "malformed" in refusal(no_bootstrap, f"Bearer {ADMIN_KEY}").message
    # A different secret hashes differently: stored keys stop matching.
    other_secret = Directory(db, secret="x" * 40, admin_key=None, refresh_interval_s=1)
    other_secret.load()
    assert refusal(other_secret, f"Bearer {admin.key}").message.startswith("Incorrect API key")


MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
NOT_BEARER = (
    "The Authorization header must use Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
MALFORMED = (
    "The API key provided is malformed: loraplex keys look like lpx_t_... (tenants) or "
    "lpx_a_... (admins), 45 characters with a checksum. Check that it was copied whole."
)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, MISSING),
        ("", MISSING),
        ("   ", MISSING),
        ("Basic dXNlcjpwYXNz", NOT_BEARER),
        ("Bearer", NOT_BEARER),
        ("Bearer    ", NOT_BEARER),
        ("Bearer sk-not-ours", MALFORMED),
        ("Bearer lpx_t_short_abcdef", MALFORMED),
    ],
)
def test_refusals_say_what_is_wrong(
    db: sessionmaker[Session], header: str | None, message: str
) -> None:
    assert refusal(directory(db), header).message == message


def test_checksum_failure_is_malformed_and_never_echoed(db: sessionmaker[Session]) -> None:
    key = generate_key("t", SECRET).key
    typo = key[:20] + ("A" if key[20] != "A" else "B") + key[21:]
    error = refusal(directory(db), f"Bearer {typo}")
    assert error.message == MALFORMED
    assert typo[6:] not in error.message


def test_unknown_key_is_masked_in_the_message(db: sessionmaker[Session]) -> None:
    key = generate_key("t", SECRET).key
    error = refusal(directory(db), f"Bearer {key}")
    assert error.message == (
        f"Incorrect API key provided: {key[:12]}***{key[-4:]}. Check the key, or ask your "
        "administrator for a new one."
    )
    assert key[12:-4] not in error.message


def test_authentication_runs_no_sql(db: sessionmaker[Session], db_engine: Engine) -> None:
    tenant_id = make_tenant(db)
    created = make_key(db, tenant_id)
    d = directory(db)
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(db_engine, "before_cursor_execute", count)
    try:
        refusal(d, "Bearer lpx_t_0000000000000000000000000000000_000000")
        refusal(d, f"Bearer {generate_key('t', SECRET).key}")
        assert d.authenticate(f"Bearer {created.key}").tenant_id == tenant_id
        assert d.authenticate(f"Bearer {ADMIN_KEY}").actor == "bootstrap"
        assert d.resolve_adapter(tenant_id, "anything") is None
    finally:
        event.remove(db_engine, "before_cursor_execute", count)
    assert statements == []
    # The listener itself works: a refresh is seen.
    event.listen(db_engine, "before_cursor_execute", count)
    d.refresh()
    event.remove(db_engine, "before_cursor_execute", count)
    assert len(statements) == 4


def test_expired_revoked_disabled_and_deleted(db: sessionmaker[Session]) -> None:
    tenant_id = make_tenant(db)
    expiring = make_key(db, tenant_id, expires_at=utcnow() + timedelta(hours=1))
    revoked = make_key(db, tenant_id)
    live = make_key(db, tenant_id)
    d = directory(db)
    assert d.authenticate(f"Bearer {expiring.key}").key_id == expiring.row.id

    past = utcnow() - timedelta(seconds=1)
    with session_scope(db) as session:
        # Time passing, as far as the key is concerned.
        session.execute(update(ApiKey).where(ApiKey.id == expiring.row.id).values(expires_at=past))
        crud.revoke_key(session, key_id=revoked.row.id, by=BY)
    d.refresh()
    assert refusal(d, f"Bearer {expiring.key}").message == (
        f"The API key {expiring.key[:12]}***{expiring.key[-4:]} expired at {past.isoformat()}."
    )
    assert refusal(d, f"Bearer {revoked.key}").message == (
        f"The API key {revoked.key[:12]}***{revoked.key[-4:]} was revoked."
    )

    with session_scope(db) as session:
        patch = crud.TenantPatch(disabled=True)
        crud.update_tenant(session, tenant_id=tenant_id, patch=patch, by=BY)
    d.refresh()
    assert refusal(d, f"Bearer {live.key}").message == "The account of this API key is disabled."
    assert d.tenant(tenant_id) is not None and d.tenant(tenant_id).disabled  # type: ignore[union-attr]
    with session_scope(db) as session:
        patch = crud.TenantPatch(disabled=False)
        crud.update_tenant(session, tenant_id=tenant_id, patch=patch, by=BY)
    d.refresh()
    assert d.authenticate(f"Bearer {live.key}").key_id == live.row.id

    with session_scope(db) as session:
        crud.delete_tenant(session, tenant_id=tenant_id, by=BY)
    d.refresh()
    assert refusal(d, f"Bearer {live.key}").message.endswith("was revoked.")
    assert d.tenant(tenant_id) is None


def test_deleted_tenant_refuses_keys_even_unrevoked(db: sessionmaker[Session]) -> None:
    tenant_id = make_tenant(db)
    created = make_key(db, tenant_id)
    with session_scope(db) as session:
        crud.delete_tenant(session, tenant_id=tenant_id, by=BY)
        # A key whose revocation was undone by hand still finds no tenant to act for.
        session.execute(update(ApiKey).values(revoked_at=None))
    d = directory(db)
    assert refusal(d, f"Bearer {created.key}").message == "The account of this API key was deleted."


# ------------------------------------------------------------------------- replicas


def test_changes_on_one_replica_reach_another(
    db: sessionmaker[Session], database_url: str
) -> None:
    other_engine = make_engine(database_url)
    try:
        writer_db, reader = db, directory(session_factory(other_engine))
        tenant_id = make_tenant(writer_db)
        created = make_key(writer_db, tenant_id)
        refusal(reader, f"Bearer {created.key}")  # not seen yet
        reader.refresh()
        assert reader.authenticate(f"Bearer {created.key}").tenant_id == tenant_id

        with session_scope(writer_db) as session:
            crud.revoke_key(session, key_id=created.row.id, by=BY)
        assert reader.authenticate(f"Bearer {created.key}").tenant_id == tenant_id
        reader.refresh()
        assert refusal(reader, f"Bearer {created.key}").message.endswith("was revoked.")

        with session_scope(writer_db) as session:
            patch = crud.TenantPatch(tier=Tier.BATCH, quotas={"rpm": 5})
            crud.update_tenant(session, tenant_id=tenant_id, patch=patch, by=BY)
        reader.refresh()
        info = reader.tenant(tenant_id)
        assert info is not None and (info.tier, info.quotas.rpm) == (Tier.BATCH, 5)
    finally:
        other_engine.dispose()


def test_refresh_tolerates_skewed_clocks_and_late_commits(db: sessionmaker[Session]) -> None:
    tenant_id = make_tenant(db)
    slow, fast, normal = (make_key(db, tenant_id) for _ in range(3))
    d = directory(db)
    d.refresh()

    def revoke(key_id: str, stamp_offset_s: float) -> None:
        # As a replica whose clock is off (or a transaction that committed late) stamps it.
        stamp = utcnow() + timedelta(seconds=stamp_offset_s)
        with session_scope(db) as session:
            session.execute(
                update(ApiKey).where(ApiKey.id == key_id)
                .values(revoked_at=stamp, updated_at=stamp)
            )

    revoke(slow.row.id, -3.0)
    d.refresh()
    assert not accepted(d, f"Bearer {slow.key}")
    # A clock far ahead must not push the watermark past the others' stamps.
    revoke(fast.row.id, +60.0)
    d.refresh()
    assert not accepted(d, f"Bearer {fast.key}")
    revoke(normal.row.id, 0.0)
    d.refresh()
    assert not accepted(d, f"Bearer {normal.key}")


async def test_background_refresh_sees_a_revocation_within_a_second(
    db: sessionmaker[Session], database_url: str
) -> None:
    other_engine = make_engine(database_url)
    tenant_id = make_tenant(db)
    created = make_key(db, tenant_id)
    interval = 0.5  # the default refresh_interval_s
    reader = directory(session_factory(other_engine), interval=interval, load=False)
    header = f"Bearer {created.key}"

    def still_accepted() -> bool:
        try:
            reader.authenticate(header)
        except ServiceError:
            return False
        return True

    # Every background refresh: when it started and ended, and whether the key still
    # worked after it.
    refreshes: list[tuple[float, float, bool]] = []
    plain_refresh = reader.refresh

    def timed_refresh() -> None:
        started = time.monotonic()
        plain_refresh()
        refreshes.append((started, time.monotonic(), still_accepted()))

    reader.refresh = timed_refresh  # type: ignore[method-assign]
    await reader.start()
    try:
        assert reader.authenticate(header).key_id == created.row.id
        assert reader.last_refresh_ok

        def revoke() -> None:
            with session_scope(db) as session:
                crud.revoke_key(session, key_id=created.row.id, by=BY)

        await asyncio.to_thread(revoke)
        revoked_at = time.monotonic()
        while time.monotonic() - revoked_at < 3.0 and still_accepted():
            await asyncio.sleep(0.01)
        took = time.monotonic() - revoked_at
        assert not still_accepted(), (
            f"the revocation never reached the other replica ({took:.2f} s)")
        after = [r for r in refreshes if r[0] >= revoked_at]
        assert after, f"no refresh started in the {took:.2f} s after the revocation"
        first_start, first_end, accepted_after_first = after[0]
        # The first refresh that began after the commit saw it: nothing waits for a later poll.
        assert not accepted_after_first, refreshes
        # Refreshes start at a fixed rate, so that one began within an interval of the
        # commit however long the queries take (scheduling slack aside): the revocation
        # reaches the replica within the interval plus one query, a second at the default.
        assert first_start - revoked_at < interval + 0.25, (
            f"the next refresh began {first_start - revoked_at:.2f} s after the revocation;"
            f" refreshes (start, duration): "
            f"{[(round(s - revoked_at, 3), round(e - s, 3)) for s, e, _ in refreshes]}"
        )
        assert reader.seconds_since_refresh() < 2 * interval + (first_end - first_start)
    finally:
        await reader.stop()
        other_engine.dispose()


async def test_refresh_failure_keeps_the_last_snapshot(
    db: sessionmaker[Session], db_engine: Engine
) -> None:
    tenant_id = make_tenant(db)
    created = make_key(db, tenant_id)
    d = directory(db, interval=0.05, load=False)
    await d.start()
    unreachable = create_engine(
        "postgresql+psycopg://nobody@127.0.0.1:1/none", connect_args={"connect_timeout": 1}
    )
    try:
        db.configure(bind=unreachable)  # the database goes away
        with pytest.raises(Exception, match=r"(?i)connect"):
            d.refresh()
        assert not d.last_refresh_ok
        await asyncio.sleep(0.2)  # a few background attempts fail and are logged
        assert not d.last_refresh_ok
        assert d._task is not None and not d._task.done()
        assert d.authenticate(f"Bearer {created.key}").key_id == created.row.id

        db.configure(bind=db_engine)  # and comes back
        with sessionmaker(db_engine)() as session, session.begin():
            crud.revoke_key(session, key_id=created.row.id, by=BY)
        deadline = time.monotonic() + 2.0
        while accepted(d, f"Bearer {created.key}") and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert d.last_refresh_ok
        refusal(d, f"Bearer {created.key}")
    finally:
        db.configure(bind=db_engine)
        await d.stop()
        unreachable.dispose()
    assert d._task is None


# --------------------------------------------------------------------------- adapters


def add_adapter(
    session: Session, tenant_id: str | None, name: str, statuses: list[AdapterStatus]
) -> tuple[str, list[str]]:
    """An adapter with versions 1..n in these states; returns its id and version ids."""
    adapter = Adapter(id=new_id("ad"), tenant_id=tenant_id, owner=tenant_id or "shared", name=name)
    session.add(adapter)
    session.flush()
    version_ids = []
    for number, status in enumerate(statuses, start=1):
        version = AdapterVersion(
            id=new_id("adv"), adapter_id=adapter.id, version=number, status=status.value,
            sha256=f"{number:064x}", rank=8,
        )
        session.add(version)
        version_ids.append(version.id)
    session.flush()
    return adapter.id, version_ids


R, F = AdapterStatus.READY, AdapterStatus.FAILED
V, D = AdapterStatus.VALIDATING, AdapterStatus.DELETED


def test_resolve_adapter_own_shared_versions_and_others(db: sessionmaker[Session]) -> None:
    a, b = make_tenant(db, "a"), make_tenant(db, "b")
    with session_scope(db) as session:
        _, a_sum = add_adapter(session, a, "summarizer", [R, R, F, V])
        _, shared_sum = add_adapter(session, None, "summarizer", [R])
        _, shared_tr = add_adapter(session, None, "translator", [R, R, D])
        _, b_secret = add_adapter(session, b, "secret", [R])
        gone_id, gone = add_adapter(session, a, "gone", [R])
        _, pending = add_adapter(session, a, "pending", [V, F])
        session.execute(update(Adapter).where(Adapter.id == gone_id).values(deleted_at=utcnow()))
    d = directory(db)

    def resolved(tenant_id: str | None, model: str) -> str | None:
        ref = d.resolve_adapter(tenant_id, model)
        return None if ref is None else ref.version_id

    assert resolved(a, "summarizer") == a_sum[1]  # own latest ready shadows the shared one
    assert resolved(a, "summarizer@1") == a_sum[0]
    assert resolved(a, "summarizer@2") == a_sum[1]
    assert resolved(a, "summarizer@3") is None  # failed
    assert resolved(a, "summarizer@4") is None  # still validating
    assert resolved(a, "summarizer@9") is None
    assert resolved(a, "summarizer@") is None
    assert resolved(a, "summarizer@x") is None
    assert resolved(a, "translator") == shared_tr[1]
    assert resolved(a, "translator@1") == shared_tr[0]
    assert resolved(a, "translator@3") is None  # deleted version
    assert resolved(a, "secret") is None  # another tenant's
    assert resolved(a, "gone") is None  # deleted adapter
    assert resolved(a, "pending") is None  # no ready version
    assert resolved(b, "summarizer") == shared_sum[0]
    assert resolved(b, "secret") == b_secret[0]
    assert resolved(b, "secret@1") == b_secret[0]
    assert resolved(None, "summarizer") == shared_sum[0]
    assert resolved(None, "secret") is None
    assert resolved("ten_unknown", "translator") == shared_tr[1]

    ref = d.resolve_adapter(b, "secret")
    assert ref is not None
    assert (ref.tenant_id, ref.name, ref.version, ref.sha256) == (b, "secret", 1, f"{1:064x}")
    assert ref.engine_name == f"av/{b_secret[0]}"

    def visible(tenant_id: str | None) -> list[tuple[str | None, str, int]]:
        return [(r.tenant_id, r.name, r.version) for r in d.visible_adapters(tenant_id)]

    assert visible(a) == [(a, "summarizer", 2), (None, "translator", 2)]
    assert visible(b) == [(b, "secret", 1), (None, "summarizer", 1), (None, "translator", 2)]
    assert visible(None) == [(None, "summarizer", 1), (None, "translator", 2)]
    assert {r.version_id for r in d.ready_versions()} == {
        *a_sum[:2], *shared_sum, *shared_tr[:2], *b_secret
    }
    assert gone[0] not in {r.version_id for r in d.ready_versions()}
    assert pending  # none of them ready


def test_listeners_hear_versions_come_and_go(db: sessionmaker[Session]) -> None:
    a = make_tenant(db, "a")
    with session_scope(db) as session:
        _, (v1, v2) = add_adapter(session, a, "x", [R, V])
        shared_id, (s1,) = add_adapter(session, None, "y", [R])
    events: list[tuple[list[str], list[str]]] = []

    def heard(added: list[AdapterRef], removed: list[AdapterRef]) -> None:
        events.append(
            (sorted(r.version_id for r in added), sorted(r.version_id for r in removed))
        )

    d = directory(db, load=False)
    d.add_listener(heard)
    assert events == []  # nothing loaded yet
    d.load()
    assert events == [(sorted([v1, s1]), [])]

    late: list[tuple[list[str], list[str]]] = []
    d.add_listener(lambda added, removed: late.append(
        (sorted(r.version_id for r in added), sorted(r.version_id for r in removed))
    ))
    assert late == [(sorted([v1, s1]), [])]  # told of what is ready when it subscribes

    events.clear()
    d.refresh()
    assert events == []  # nothing changed, nothing said (the overlap re-reads rows)

    with session_scope(db) as session:
        session.get(AdapterVersion, v2).status = R.value  # type: ignore[union-attr]
    d.refresh()
    assert events == [([v2], [])]
    assert d.resolve_adapter(a, "x") is not None and d.resolve_adapter(a, "x").version == 2  # type: ignore[union-attr]

    with session_scope(db) as session:
        session.get(AdapterVersion, v2).status = F.value  # type: ignore[union-attr]
    d.refresh()
    assert events[-1] == ([], [v2])
    assert d.resolve_adapter(a, "x").version == 1  # type: ignore[union-attr]

    with session_scope(db) as session:
        session.get(Adapter, shared_id).deleted_at = utcnow()  # type: ignore[union-attr]
    d.refresh()
    assert events[-1] == ([], [s1])

    with session_scope(db) as session:
        crud.delete_tenant(session, tenant_id=a, by=BY)
    d.refresh()
    assert events[-1] == ([], [v1])
    assert d.ready_versions() == []
    assert len(events) == 4
    assert late[-1] == events[-1]

    # A full reload reports only what differs from what listeners already know.
    d.load()
    assert len(events) == 4


def test_a_failing_listener_does_not_stop_the_others(db: sessionmaker[Session]) -> None:
    with session_scope(db) as session:
        _, (v1,) = add_adapter(session, None, "y", [R])
    heard: list[str] = []

    def broken(added: list[AdapterRef], removed: list[AdapterRef]) -> None:
        raise RuntimeError("registry down")

    d = directory(db, load=False)
    d.add_listener(broken)
    d.add_listener(lambda added, removed: heard.extend(r.version_id for r in added))
    d.load()
    assert heard == [v1]
    assert d.last_refresh_ok
