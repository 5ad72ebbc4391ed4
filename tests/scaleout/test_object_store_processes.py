"""A `loraplex gateway` and two `loraplex worker` processes that share no directory, only an
S3-compatible object store (moto's server over HTTP, behind a proxy the test cuts), Redis
and the database: an upload through the gateway is served by either worker, each fetching
it into its own directory; with the store gone, a worker that lacks an adapter fails that
adapter's requests alone, with a clear error, and stays ready."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from app.db import make_engine, session_factory, session_scope
from app.registry.object_store import ObjectStore
from app.tables import UsageRecord
from engine.client import WORKER_HEADER
from tests.scaleout.test_gateway_processes import TOKEN, _ask, _gateway
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.processes import cli_process, free_port, log_tail, scaleout_env, wait_until
from tests.utils.s3_server import aws_environment, moto_server, s3_client, s3_env
from tests.utils.saas import ADMIN_KEY, bearer, upload_adapter
from tests.utils.tcp_proxy import TcpProxy

pytestmark = pytest.mark.usefixtures("event_loop_watchdog")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[str, TcpProxy]]:
    with moto_server(tmp_path) as url, TcpProxy("127.0.0.1", int(url.rsplit(":", 1)[1])) as proxy:
        s3_client(url).create_bucket(Bucket="fleet")
        yield f"http://127.0.0.1:{proxy.port}", proxy


def test_workers_sharing_only_the_store_serve_an_upload_and_survive_its_outage(
    tiny_model_factory: Callable[[str], Path], redis_url: str, sqlite_url: str, tmp_path: Path,
    store: tuple[str, TcpProxy],
) -> None:
    endpoint, proxy = store
    model_dir = tiny_model_factory("llama_gqa")
    adapters = {"first": make_peft_adapter(model_dir, tmp_path / "first", r=4, alpha=8, seed=11)}

    def env(node: str) -> dict[str, str]:
        return scaleout_env(tmp_path / node, redis_url, sqlite_url, TOKEN,
                            LORAPLEX_REFRESH_INTERVAL_S="0.1",
                            LORAPLEX_ADAPTER_STORE="s3://fleet/adapters", **s3_env(endpoint))

    engine_flags = ["--model", str(model_dir), "--device", "cpu", "--kv-cache-tokens", "2048",
                    "--max-num-seqs", "4", "--max-loras", "2", "--max-lora-rank", "8"]
    logs = {name: tmp_path / f"{name}.log" for name in ("w1", "w2", "gateway")}
    with ExitStack() as stack:
        workers = {
            name: stack.enter_context(cli_process(
                ["worker", "--port", str(free_port()), "--worker-id", name, *engine_flags],
                env(name), logs[name],
            ))
            for name in ("w1", "w2")
        }
        client = stack.enter_context(_gateway(model_dir, env("gateway"), logs["gateway"],
                                              "--no-auth"))
        all_logs = list(logs.values())

        def in_rotation() -> list[str]:
            view = client.get("/admin/engine")
            if view.status_code != 200:
                return []
            return sorted(w["id"] for w in view.json()["workers"] if w["in_rotation"])

        wait_until(lambda: in_rotation() == ["w1", "w2"], 120, "two workers", all_logs)
        answers: list[httpx.Response] = []

        def ask(model: str) -> httpx.Response:
            answers.append(_ask(client, model))
            return answers[-1]

        digests = {}
        for name, directory in adapters.items():
            r = upload_adapter(client, ADMIN_KEY, name, directory, path="/admin/adapters")
            assert r.status_code == 201, r.text + log_tail(logs["gateway"])
            digests[name] = r.json()["sha256"]
        with aws_environment(endpoint):
            assert set(ObjectStore("s3://fleet/adapters").digests()) == set(digests.values())

        first = [ask("first") for _ in range(2)]
        assert [r.status_code for r in first] == [200, 200], first[0].text
        served_by = first[0].headers[WORKER_HEADER]
        other = "w2" if served_by == "w1" else "w1"
        # The worker that served it fetched it into its own directory, from the store.
        assert (tmp_path / served_by / "adapters" / digests["first"]).is_dir()
        assert not (tmp_path / other / "adapters" / digests["first"]).exists()

        # An adapter the other worker has never seen: uploads are validated (and so
        # fetched) on one worker each, so upload until one lands on served_by alone.
        for i in range(12):
            name = f"extra-{i}"
            directory = make_peft_adapter(model_dir, tmp_path / name, r=4, alpha=8, seed=20 + i)
            r = upload_adapter(client, ADMIN_KEY, name, directory, path="/admin/adapters")
            assert r.status_code == 201, r.text
            digests[name] = r.json()["sha256"]
            if not (tmp_path / other / "adapters" / digests[name]).exists():
                missing = name
                break
        else:
            raise AssertionError("every upload was validated on the same worker")

        # That worker goes: the other fetches the adapter and answers the same.
        workers[served_by].kill()
        workers[served_by].wait(10)
        wait_until(lambda: in_rotation() == [other], 30, "one worker left", all_logs)
        again = ask("first")
        assert again.status_code == 200, again.text + log_tail(logs[other])
        assert again.headers[WORKER_HEADER] == other
        assert again.json()["choices"][0]["message"] == first[0].json()["choices"][0]["message"]
        assert (tmp_path / other / "adapters" / digests["first"]).is_dir()

        # The store goes: what the worker has keeps serving; what it lacks fails alone.
        proxy.cut()
        refused = ask(missing)
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"]
        error = refused.json()["error"]
        assert error["code"] == "adapter_unavailable", error
        assert error["message"] == (f"The adapter '{missing}' cannot be fetched from the "
                                    "adapter store right now; retry shortly.")
        assert ask("first").status_code == 200
        assert ask(model_dir.name).status_code == 200
        assert client.get("/ready").status_code == 200
        worker_ready = httpx.get(  # the worker itself
            next(w["url"] for w in client.get("/admin/engine", headers=bearer(ADMIN_KEY))
                 .json()["workers"] if w["id"] == other) + "/ready", timeout=5)
        assert worker_ready.status_code == 200

        proxy.restore()
        deadline = time.monotonic() + 30
        while (r := ask(missing)).status_code != 200:
            assert time.monotonic() < deadline, r.text + log_tail(logs[other])
            time.sleep(0.5)
        assert (tmp_path / other / "adapters" / digests[missing]).is_dir()

        # No usage row lost: one for each answer, "ok" for each 200.
        def usage() -> dict[str, int]:
            engine = make_engine(sqlite_url)
            try:
                with session_scope(session_factory(engine)) as s:
                    return dict(s.execute(select(UsageRecord.status, func.count())
                                          .group_by(UsageRecord.status)).all())
            finally:
                engine.dispose()

        oks = sum(r.status_code == 200 for r in answers)
        wait_until(lambda: usage().get("ok") == oks, 15, f"{oks} ok usage rows", all_logs)
        assert sum(usage().values()) == len(answers), (usage(), len(answers))
