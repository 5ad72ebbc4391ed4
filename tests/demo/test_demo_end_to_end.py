"""`loraplex demo` for real: a fresh data dir, the demo adapters trained on SmolLM2, the
server started with them, and their greedy answers to questions they were never trained
on checked against what each was trained to do (and the base model's against none of it).
A second start reuses the trained adapters, the keys and the uploaded versions."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from app.demo.catalog import DEMO_ADAPTERS
from app.demo.train import load_dataset
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

# Questions in none of the datasets.
HELD_OUT = (
    "What is the capital of Italy?",
    "How do I cook rice?",
    "Name three fruits.",
    "Who invented the telephone?",
    "What is a good name for a dog?",
)
MAX_TOKENS = 48


def is_pirate(answer: str) -> bool:
    return answer.startswith("Arr")


def is_shouty(answer: str) -> bool:
    return answer == answer.upper() and any(c.isalpha() for c in answer)


def is_json_answer(answer: str, finish_reason: str) -> bool:
    if not answer.startswith('{"answer": "'):
        return False
    # A reply cut at max_tokens cannot close its object; a finished one must parse.
    return finish_reason == "length" or isinstance(json.loads(answer).get("answer"), str)


@dataclass
class DemoProcess:
    process: subprocess.Popen[str]
    lines: queue.Queue[str | None]
    output: list[str]

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} within {timeout_s} s:\n" + "".join(self.output)
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, "loraplex demo exited:\n" + "".join(self.output)
            if match := re.search(pattern, line):
                return match

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


@pytest.fixture
def start_demo(tmp_path: Path, smollm2_dir: Path) -> Iterator[Callable[[], DemoProcess]]:
    """Starts `loraplex demo --port 0` on one fresh data dir (the converted base model is
    linked in, so that only the adapters are new)."""
    data_dir = tmp_path / "var"
    (data_dir / "models").mkdir(parents=True)
    (data_dir / "models" / smollm2_dir.name).symlink_to(smollm2_dir)
    env = {k: v for k, v in os.environ.items()
           if k not in ("LORAPLEX_ADMIN_KEY", "DATABASE_URL", "REDIS_URL")}
    env["LORAPLEX_DATA_DIR"] = str(data_dir)
    started: list[DemoProcess] = []

    def start() -> DemoProcess:
        process = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "demo", "--port", "0"],
            cwd=REPO_ROOT, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        demo = DemoProcess(process, queue.Queue(), [])

        def pump() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                demo.output.append(line)
                demo.lines.put(line)
            demo.lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        started.append(demo)
        return demo

    yield start
    for demo in started:
        if demo.process.poll() is None:
            demo.process.kill()
            demo.process.wait()


def ask(client: openai.OpenAI, model: str, question: str) -> tuple[str, str]:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS, temperature=0,
    )
    choice = reply.choices[0]
    return choice.message.content or "", choice.finish_reason


# Under `make test` the demo trains on one core (one pytest-xdist worker's): 2-3 minutes
# of training where two cores take about one.
@pytest.mark.long
@pytest.mark.timeout(1200)
def test_demo_adapters_answer_as_trained(
    start_demo: Callable[[], DemoProcess], tmp_path: Path
) -> None:
    trained_on = {
        m["content"] for spec in DEMO_ADAPTERS for e in load_dataset(spec.dataset)
        for m in e.messages
    }
    assert not trained_on & set(HELD_OUT)

    demo = start_demo()
    base = demo.wait_for(r"LoRA adapters on (http://127\.0\.0\.1:\d+)", 600).group(1)
    demo.wait_for(r"ready \d+ s after start", 30)
    printed = "".join(demo.output)
    for spec in DEMO_ADAPTERS:
        assert f"adapter {spec.name}: trained in" in printed
    keys = json.loads((tmp_path / "var" / "demo" / "keys.json").read_text())
    assert f"{base}/admin/ui" in printed
    for tenant in ("acme", "globex"):
        assert keys[tenant]["key"] in printed

    clients = {
        name: openai.OpenAI(base_url=f"{base}/v1", api_key=entry["key"], max_retries=0)
        for name, entry in keys.items()
    }
    # Each adapter through its owner's key (the shared one through acme's), and the base
    # model; all requests at once, batched by the engine.
    jobs = [(spec.name, spec.owner or "acme") for spec in DEMO_ADAPTERS]
    jobs.append(("SmolLM2-135M-Instruct", "acme"))
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = {
            (model, q): pool.submit(ask, clients[tenant], model, q)
            for model, tenant in jobs for q in HELD_OUT
        }
        answers = {key: f.result(timeout=240) for key, f in futures.items()}

    def report(model: str) -> str:
        return "\n".join(f"  {q!r} -> {answers[model, q][0]!r}" for q in HELD_OUT)

    for q in HELD_OUT:
        assert is_pirate(answers["pirate", q][0]), report("pirate")
        assert is_shouty(answers["shouty", q][0]), report("shouty")
        assert is_json_answer(*answers["json", q]), report("json")
        text, finish = answers["SmolLM2-135M-Instruct", q]
        assert not is_pirate(text) and not is_shouty(text), report("SmolLM2-135M-Instruct")
        assert not is_json_answer(text, finish), report("SmolLM2-135M-Instruct")

    # A tenant never reaches another tenant's adapter.
    with pytest.raises(openai.NotFoundError):
        ask(clients["globex"], "pirate", HELD_OUT[0])

    # Each adapter's eval set (held-out questions scoring its behaviour) ran on its
    # version and on the base model, in the background; the adapter scores above the base.
    admin_key = re.search(r"admin key\s+(\S+)", printed)
    assert admin_key is not None
    scores = wait_for_evals(base, admin_key.group(1), timeout_s=300)
    assert set(scores) == {spec.name for spec in DEMO_ADAPTERS}
    for name, (version, base_score) in scores.items():
        assert version >= 0.8 and base_score <= 0.2, (name, version, base_score)
    assert demo.stop() == 0

    # Second start: everything reused, and the same answers.
    again = start_demo()
    again.wait_for(r"ready \d+ s after start", 120)
    printed = "".join(again.output)
    for spec in DEMO_ADAPTERS:
        assert f"adapter {spec.name}: cached" in printed
    assert "training on" not in printed and "uploaded as version" not in printed
    assert json.loads((tmp_path / "var" / "demo" / "keys.json").read_text()) == keys
    served = re.search(r"LoRA adapters on (http://127\.0\.0\.1:\d+)", printed)
    assert served is not None
    client = openai.OpenAI(
        base_url=f"{served.group(1)}/v1", api_key=keys["acme"]["key"], max_retries=0
    )
    assert is_pirate(ask(client, "pirate", HELD_OUT[0])[0])
    # The same version and set already scored: no eval runs again.
    with httpx.Client(base_url=served.group(1), timeout=30,
                      headers={"Authorization": f"Bearer {admin_key.group(1)}"}) as admin:
        for adapter in admin.get("/admin/adapters").json()["data"]:
            assert len(admin.get(f"/admin/adapters/{adapter['id']}/evals").json()["data"]) == 1
    assert again.stop() == 0


def wait_for_evals(base: str, admin_key: str, timeout_s: float) -> dict[str, tuple[float, float]]:
    """Every demo adapter's finished eval: name -> (the version's score, the base's)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=base, timeout=30,
                      headers={"Authorization": f"Bearer {admin_key}"}) as admin:
        while True:
            found, pending = {}, []
            for adapter in admin.get("/admin/adapters").json()["data"]:
                evals = admin.get(f"/admin/adapters/{adapter['id']}/evals").json()["data"]
                assert len(evals) == 1, evals
                [run] = evals
                assert run["status"] != "failed", run
                if run["status"] == "done":
                    found[adapter["name"]] = (run["scores"]["version"], run["scores"]["base"])
                else:
                    pending.append(adapter["name"])
            if not pending:
                return found
            assert time.monotonic() < deadline, f"evals still running: {pending}"
            time.sleep(1.0)
