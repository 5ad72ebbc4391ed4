"""Faults injected under a real `loraplex serve` / `loraplex worker` (LORAPLEX_FAULTS,
raised inside the model's forward).

One tenant's poisoned request fails alone with a 500 while another tenant's streams, in
the same steps, finish with the right text; every response keeps its usage row. A device
that breaks: the requests it was running get a 500, then the engine declares itself
failed, `/health` turns 503 with the reason (what a liveness probe restarts on), and the
process drains and exits 1; a worker leaves the gateway's rotation at once, and the
gateway serves on with the healthy worker."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from engine.client import WORKER_HEADER
from engine.core.faults import FAULTS_ENV
from tests.chaos.load import usage_rows
from tests.utils.processes import (
    cli_process,
    free_port,
    log_tail,
    scaleout_env,
    serve_process,
    wait_until,
)
from tests.utils.saas import ADMIN_KEY, SECRET_KEY, bearer, create_key, create_tenant
from tests.utils.tiny_models import random_prompt

TOKEN = "chaos-worker-token-0123456789abcdef"
POISON = [7, 8, 9]
STREAM_TOKENS = 120


def _complete(client: httpx.Client, model: str) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": "Hello",
                                                "max_tokens": 4, "temperature": 0})


def _stream_events(base_url: str, key: str, body: dict[str, object],
                   started: concurrent.futures.Future[None]) -> list[object]:
    """Every event of one streamed completion (its JSON, or the text [DONE])."""
    events: list[object] = []
    with httpx.stream("POST", f"{base_url}/v1/completions", headers=bearer(key),
                      json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                if not started.done():
                    started.set_result(None)
    return events


def _stream(base_url: str, key: str, body: dict[str, object],
            started: concurrent.futures.Future[None]) -> tuple[str | None, str, bool]:
    """(response id, text, ended with [DONE]) of one streamed completion."""
    events = _stream_events(base_url, key, body, started)
    chunks = [e for e in events if isinstance(e, dict)]
    text = "".join(c["text"] for chunk in chunks for c in chunk["choices"])
    return (chunks[-1]["id"] if chunks else None), text, events[-1:] == ["[DONE]"]


def test_a_poisoned_request_fails_alone_while_other_tenants_stream(
    tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama_gqa")
    data_dir = tmp_path / "data"
    env = {"LORAPLEX_DATA_DIR": str(data_dir), "LORAPLEX_ADMIN_KEY": ADMIN_KEY,
           "LORAPLEX_SECRET_KEY": SECRET_KEY, FAULTS_ENV: "poison=7.8.9",
           "OMP_NUM_THREADS": "1"}
    with serve_process(["--model", str(model_dir), "--device", "cpu", "--kv-cache-tokens",
                        "4096"], env, tmp_path / "serve.log") as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as client:
        tenants = {who: create_tenant(client, f"tenant-{who}", rpm=10_000)["id"]
                   for who in ("a", "b")}
        keys = {who: create_key(client, tid)["key"] for who, tid in tenants.items()}
        bodies = [{"model": model_dir.name, "prompt": random_prompt(20 + 9 * i, seed=60 + i),
                   "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True}
                  for i in range(3)]
        alone = [client.post("/v1/completions", json=b, headers=bearer(keys["b"])).json()
                 for b in bodies]

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            started = [concurrent.futures.Future[None]() for _ in bodies]
            streams = [pool.submit(_stream, server.base_url, keys["b"], b, s)
                       for b, s in zip(bodies, started, strict=True)]
            concurrent.futures.wait(started, timeout=30)
            poisoned = client.post("/v1/completions", headers=bearer(keys["a"]), json={
                "model": model_dir.name, "prompt": [1, *POISON, 2], "max_tokens": 8})
            results = [s.result(timeout=60) for s in streams]

        assert poisoned.status_code == 500, poisoned.text
        assert poisoned.json()["error"]["type"] == "server_error"
        assert [(text, done) for _, text, done in results] == [
            (a["choices"][0]["text"], True) for a in alone
        ]
        metrics = client.get("/metrics").text
        assert "loraplex_engine_step_failures_total 0.0" not in metrics
        assert client.get("/health").json() == {"status": "ok"}
        served_ids = {a["id"] for a in alone} | {rid for rid, _, _ in results}

        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.tail()

    rows = usage_rows(f"sqlite:///{data_dir / 'loraplex.db'}")
    by_tenant = {who: [r for r in rows.values() if r.tenant_id == tid]
                 for who, tid in tenants.items()}
    assert {r.request_id for r in by_tenant["b"]} == served_ids
    assert all(r.status == "ok" and r.completion_tokens == STREAM_TOKENS for r in by_tenant["b"])
    assert [(r.status, r.prompt_tokens, r.completion_tokens) for r in by_tenant["a"]] == [
        ("error", 5, 0)
    ]


@pytest.mark.parametrize("engine_where", ["--no-engine-process", "--engine-process"])
def test_a_broken_device_makes_serve_report_and_exit_1(
    tiny_model_factory: Callable[[str], Path], tmp_path: Path, engine_where: str
) -> None:
    model_dir = tiny_model_factory("llama_gqa")
    env = {"LORAPLEX_DATA_DIR": str(tmp_path / "data"), FAULTS_ENV: "broken-after=0",
           "OMP_NUM_THREADS": "1"}
    with serve_process(["--no-auth", "--model", str(model_dir), "--device", "cpu",
                        "--kv-cache-tokens", "2048", engine_where], env,
                       tmp_path / "serve.log") as server, \
            httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert client.get("/health").json() == {"status": "ok"}
        statuses = [_complete(client, model_dir.name) for _ in range(3)]
        assert [r.status_code for r in statuses] == [500] * 3, statuses[-1].text
        assert statuses[0].json()["error"]["type"] == "server_error"

        health = client.get("/health")  # reported for a second before the socket closes
        assert health.status_code == 503, health.text
        assert "3 engine steps in a row failed" in health.json()["reason"]
        assert "device is broken" in health.json()["reason"]
        assert client.get("/ready").json()["status"] == "failed"
        refused = _complete(client, model_dir.name)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert "failed" in refused.json()["error"]["message"]
        assert "loraplex_engine_failed 1.0" in client.get("/metrics").text

        exit_code = server.proc.wait(30)
        assert exit_code == 1, server.tail()
        assert "the engine failed" in server.tail()


def _children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def test_a_killed_engine_process_fails_its_streams_and_serve_exits_1(
    tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama_long")
    data_dir = tmp_path / "data"
    env = {"LORAPLEX_DATA_DIR": str(data_dir), "LORAPLEX_ADMIN_KEY": ADMIN_KEY,
           "LORAPLEX_SECRET_KEY": SECRET_KEY, "OMP_NUM_THREADS": "1"}
    with serve_process(["--model", str(model_dir), "--device", "cpu", "--kv-cache-tokens",
                        "4096", "--engine-process"], env, tmp_path / "serve.log") as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as client:
        tenant = create_tenant(client, "tenant-a", rpm=10_000)["id"]
        key = create_key(client, tenant)["key"]
        [engine_pid] = [pid for pid in _children(server.proc.pid)
                        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        body = {"model": model_dir.name, "prompt": "Count:", "max_tokens": 2000,
                "temperature": 0, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started = concurrent.futures.Future[None]()
            stream = pool.submit(_stream_events, server.base_url, key, body, started)
            started.result(timeout=30)
            os.kill(engine_pid, signal.SIGKILL)
            *chunks, last = stream.result(timeout=60)
        # The stream ends with an error event, not [DONE].
        assert isinstance(last, dict) and last["error"]["type"] == "server_error", last
        response_id = chunks[0]["id"]  # type: ignore[index]

        health = client.get("/health")
        assert health.status_code == 503, health.text
        assert "the engine process exited (exit code -9)" in health.json()["reason"]
        exit_code = server.proc.wait(30)
        assert exit_code == 1, server.tail()

    [row] = usage_rows(f"sqlite:///{data_dir / 'loraplex.db'}").values()
    assert (row.request_id, row.status) == (response_id, "error")
    assert row.completion_tokens > 0  # what it streamed before the engine died is metered


def test_a_broken_worker_leaves_rotation_and_exits_1(
    tiny_model_factory: Callable[[str], Path], redis_url: str, sqlite_url: str, tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama_gqa")
    env = scaleout_env(tmp_path / "data", redis_url, sqlite_url, TOKEN)
    env.pop(FAULTS_ENV, None)
    flags = ["--model", str(model_dir), "--device", "cpu", "--kv-cache-tokens", "2048"]
    ports = {name: free_port() for name in ("healthy", "broken", "gateway")}
    logs = {name: tmp_path / f"{name}.log" for name in ports}
    with ExitStack() as stack:
        workers = {
            name: stack.enter_context(cli_process(
                ["worker", "--port", str(ports[name]), "--worker-id", name, *flags],
                {**env, **({FAULTS_ENV: "broken-after=0"} if name == "broken" else {})},
                logs[name],
            ))
            for name in ("healthy", "broken")
        }
        stack.enter_context(cli_process(
            ["gateway", "--no-auth", "--port", str(ports["gateway"]), "--model", str(model_dir)],
            env, logs["gateway"],
        ))
        client = stack.enter_context(
            httpx.Client(base_url=f"http://127.0.0.1:{ports['gateway']}", timeout=30)
        )
        all_logs = list(logs.values())

        def in_rotation() -> list[str]:
            view = client.get("/admin/engine")
            return [w["id"] for w in view.json()["workers"] if w["in_rotation"]]

        wait_until(lambda: in_rotation() == ["broken", "healthy"], 120, "both workers in rotation",
              all_logs)
        # The gateway suspends a worker whose request failed and tries it again a second
        # later: the broken worker sees a request now and then, fails it, and gives up.
        answers: list[httpx.Response] = []
        deadline = time.monotonic() + 60
        while workers["broken"].poll() is None and time.monotonic() < deadline:
            answers.append(_complete(client, model_dir.name))
            time.sleep(0.05)
        exit_code = workers["broken"].wait(30)
        assert exit_code == 1, log_tail(logs["broken"])
        assert "the engine failed" in log_tail(logs["broken"])
        # Out of rotation at once (its heartbeat withdrawn), not only once the TTL ran out.
        wait_until(lambda: in_rotation() == ["healthy"], 2, "the broken worker out of rotation",
              all_logs)
        served = [r for r in answers if r.status_code == 200]
        assert served and all(r.headers[WORKER_HEADER] == "healthy" for r in served)
        assert all(r.status_code in (200, 500) for r in answers), [r.text for r in answers]
        after = [_complete(client, model_dir.name) for _ in range(3)]
        assert [(r.status_code, r.headers.get(WORKER_HEADER)) for r in after] == [
            (200, "healthy")
        ] * 3
