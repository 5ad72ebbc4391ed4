"""End to end on this machine: real Redis, three `loraplex worker` processes (a tiny
random model on the CPU) and one `loraplex gateway` process, through the HTTP API.

An adapter keeps landing on the worker that has it; after `kill -9` of that worker a new
request (routed to it before anyone noticed) is retried on the other one, well within
10 s; a stream in flight on a killed worker ends with an error event; with no shared
worker left, requests get 503 with Retry-After; SIGTERM takes a worker out of Redis at
once and exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from engine.remote.heartbeat import WORKERS_SET, worker_key
from engine.remote.protocol import WORKER_HEADER
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.saas import (
    ADMIN_KEY,
    SECRET_KEY,
    bearer,
    create_key,
    create_tenant,
    upload_adapter,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKEN = "e2e-worker-token-0123456789abcdef"
_CLI = "from app.cli import main; main()"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def _process(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", _CLI, *args], cwd=REPO_ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def _wait(condition: Callable[[], bool], timeout: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout} s\n" + "\n".join(_tail(p) for p in logs))
        time.sleep(0.1)


def _chat(client: httpx.Client, key: str, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say something"}],
            "max_tokens": 4, "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body, headers=bearer(key))


def test_gateway_routes_to_workers_and_survives_a_killed_worker(
    tiny_model_factory: Callable[[str], Path], redis_url: str, sqlite_url: str, tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama_gqa")
    adapter_dir = make_peft_adapter(model_dir, tmp_path / "adapter", r=4, alpha=8, seed=3)
    env = {
        **os.environ,
        "LORAPLEX_DATA_DIR": str(tmp_path / "data"),  # shared: the adapter store
        "REDIS_URL": redis_url,
        "DATABASE_URL": sqlite_url,
        "LORAPLEX_WORKER_TOKEN": TOKEN,
        "LORAPLEX_ADMIN_KEY": ADMIN_KEY,
        "LORAPLEX_SECRET_KEY": SECRET_KEY,
        "LORAPLEX_HEARTBEAT_INTERVAL_S": "0.5",
        "LORAPLEX_HEARTBEAT_TTL_S": "2",
        "OMP_NUM_THREADS": "1",
    }
    engine_flags = ["--model", str(model_dir), "--device", "cpu", "--kv-cache-tokens", "4096",
                    "--max-num-seqs", "8", "--max-loras", "2", "--max-lora-rank", "8"]
    ports = {name: _free_port() for name in ("w1", "w2", "w3", "gateway")}
    logs = {name: tmp_path / f"{name}.log" for name in ports}
    rds = redis.Redis.from_url(redis_url)
    with ExitStack() as stack:
        procs = {
            name: stack.enter_context(_process(
                ["worker", "--port", str(ports[name]), "--worker-id", name, *engine_flags,
                 *(["--dedicated-tenant", "t_dedicated"] if name == "w3" else [])],
                env, logs[name],
            ))
            for name in ("w1", "w2", "w3")
        }
        procs["gateway"] = stack.enter_context(_process(
            ["gateway", "--port", str(ports["gateway"]), "--model", str(model_dir)],
            env, logs["gateway"],
        ))
        all_logs = list(logs.values())
        client = stack.enter_context(
            httpx.Client(base_url=f"http://127.0.0.1:{ports['gateway']}", timeout=30)
        )

        def in_rotation() -> list[str]:
            view = client.get("/admin/engine", headers=bearer(ADMIN_KEY))
            if view.status_code != 200:
                return []
            return [w["id"] for w in view.json()["workers"] if w["in_rotation"]]

        _wait(lambda: in_rotation() == ["w1", "w2", "w3"], 120, "three workers in rotation",
              all_logs)
        view = client.get("/admin/engine", headers=bearer(ADMIN_KEY)).json()["workers"]
        assert [(w["url"], w["device"], w["dedicated_tenants"]) for w in view] == [
            (f"http://127.0.0.1:{ports[n]}", "cpu", ["t_dedicated"] if n == "w3" else [])
            for n in ("w1", "w2", "w3")
        ]
        assert client.get("/ready").status_code == 200
        worker_base = f"http://127.0.0.1:{ports['w1']}"
        assert httpx.post(f"{worker_base}/internal/generate", json={}).status_code == 401
        assert "loraplex_kv_cache_usage_ratio" in httpx.get(f"{worker_base}/metrics").text

        tenant = create_tenant(client, "acme")
        key = create_key(client, tenant["id"])["key"]
        uploaded = upload_adapter(client, ADMIN_KEY, "tiny-lora", adapter_dir,
                                  path="/admin/adapters")
        assert uploaded.status_code == 201, uploaded.text
        assert uploaded.json()["status"] == "ready"

        # The adapter keeps landing on one worker, never on the dedicated one.
        answers = [_chat(client, key, "tiny-lora") for _ in range(6)]
        assert [r.status_code for r in answers] == [200] * 6, answers[0].text
        homes = {r.headers[WORKER_HEADER] for r in answers}
        assert len(homes) == 1 and homes <= {"w1", "w2"}
        [home] = homes
        other = "w2" if home == "w1" else "w1"
        text = answers[0].json()["choices"][0]["message"]["content"]
        assert {r.json()["choices"][0]["message"]["content"] for r in answers} == {text}
        base = _chat(client, key, model_dir.name)
        assert base.status_code == 200 and base.headers[WORKER_HEADER] in {"w1", "w2"}

        # kill -9 its worker; the very next request is routed there (the gateway has not
        # noticed yet), refused, and retried on the other worker.
        os.kill(procs[home].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        procs[home].wait(10)
        retried = _chat(client, key, "tiny-lora")
        recovered_s = time.monotonic() - killed_at
        assert retried.status_code == 200, retried.text
        assert retried.headers[WORKER_HEADER] == other
        assert retried.json()["choices"][0]["message"]["content"] == text  # same adapter
        assert recovered_s < 10, f"took {recovered_s:.1f} s"
        print(f"\nkill -9 of {home} -> a request served by {other} after {recovered_s:.2f} s")
        assert _chat(client, key, "tiny-lora").headers[WORKER_HEADER] == other
        _wait(lambda: in_rotation() == sorted({other, "w3"}), 5, "the dead worker gone",
              all_logs)
        metrics = client.get("/metrics").text
        assert 'loraplex_workers{state="in_rotation"} 2.0' in metrics

        # A stream in flight on a worker that dies ends with an error event, not a hang.
        with client.stream(
            "POST", "/v1/chat/completions", headers=bearer(key),
            json={"model": "tiny-lora", "messages": [{"role": "user", "content": "Go on"}],
                  "max_tokens": 200, "ignore_eos": True, "stream": True},
        ) as stream:
            assert stream.status_code == 200
            assert stream.headers[WORKER_HEADER] == other
            lines = stream.iter_lines()
            while '"content":"' not in (line := next(lines)) or '"content":""' in line:
                pass  # up to the first generated text
            os.kill(procs[other].pid, signal.SIGKILL)
            cut_at = time.monotonic()
            rest = [line for line in lines if line]
        assert time.monotonic() - cut_at < 5
        assert rest, "the stream ended without a word"
        assert "[DONE]" not in rest[-1]
        error = json.loads(rest[-1].removeprefix("data: "))["error"]
        assert (error["code"], error["type"]) == ("worker_lost", "server_error")

        # No shared worker left: 503 with Retry-After (the dedicated one stays its tenant's).
        refused = _chat(client, key, "tiny-lora")
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "overloaded"
        assert refused.headers["retry-after"] == "2"

        # SIGTERM: out of Redis at once, then a clean exit.
        assert rds.exists(worker_key("w3"))
        procs["w3"].send_signal(signal.SIGTERM)
        _wait(lambda: not rds.exists(worker_key("w3")), 2, "the heartbeat deleted", all_logs)
        assert procs["w3"].wait(15) == 0, _tail(logs["w3"])
        assert rds.smembers(WORKERS_SET) <= {home.encode(), other.encode()}
        _wait(lambda: client.get("/ready").status_code == 503, 5, "the gateway unready",
              all_logs)
