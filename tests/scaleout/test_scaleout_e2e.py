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
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import redis

from engine.client import WORKER_HEADER
from engine.remote.heartbeat import WORKERS_SET, worker_key
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.processes import cli_process, free_port, log_tail, scaleout_env, wait_until
from tests.utils.saas import (
    ADMIN_KEY,
    bearer,
    create_key,
    create_tenant,
    upload_adapter,
)

TOKEN = "e2e-worker-token-0123456789abcdef"


def _chat(client: httpx.Client, key: str, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say something"}],
            "max_tokens": 4, "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body, headers=bearer(key))


def test_gateway_routes_to_workers_and_survives_a_killed_worker(
    tiny_model_factory: Callable[[str], Path], redis_url: str, sqlite_url: str, tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama_gqa")
    adapter_dir = make_peft_adapter(model_dir, tmp_path / "adapter", r=4, alpha=8, seed=3)
    env = scaleout_env(tmp_path / "data", redis_url, sqlite_url, TOKEN)  # data: the store
    engine_flags = ["--model", str(model_dir), "--device", "cpu", "--kv-cache-tokens", "4096",
                    "--max-num-seqs", "8", "--max-loras", "2", "--max-lora-rank", "8"]
    ports = {name: free_port() for name in ("w1", "w2", "w3", "gateway")}
    logs = {name: tmp_path / f"{name}.log" for name in ports}
    rds = redis.Redis.from_url(redis_url)
    with ExitStack() as stack:
        procs = {
            name: stack.enter_context(cli_process(
                ["worker", "--port", str(ports[name]), "--worker-id", name, *engine_flags,
                 *(["--dedicated-tenant", "t_dedicated"] if name == "w3" else [])],
                env, logs[name],
            ))
            for name in ("w1", "w2", "w3")
        }
        procs["gateway"] = stack.enter_context(cli_process(
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

        wait_until(lambda: in_rotation() == ["w1", "w2", "w3"], 120, "three workers in rotation",
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
        wait_until(lambda: in_rotation() == sorted({other, "w3"}), 5, "the dead worker gone",
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
        wait_until(lambda: not rds.exists(worker_key("w3")), 2, "the heartbeat deleted", all_logs)
        assert procs["w3"].wait(15) == 0, log_tail(logs["w3"])
        assert rds.smembers(WORKERS_SET) <= {home.encode(), other.encode()}
        wait_until(lambda: client.get("/ready").status_code == 503, 5, "the gateway unready",
              all_logs)
