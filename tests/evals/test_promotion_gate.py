"""The promotion gate on a live server with a real engine (a tiny random model): a gated
adapter stages each new version, scores it with the gate's eval set against the current
one, and promotes it only if it does at least as well; plain `name` keeps serving the
current version meanwhile, and switches with no failed request. Promote, rollback,
staged uploads and the CLI, and what each refuses."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.saas import ADMIN_KEY, bearer, tar_gz
from tests.utils.tiny_server import serve_registry

ADMIN = bearer(ADMIN_KEY)
PROMPTS = ["Name a fruit.", "Say something about the sea.", "Count to three.",
           "What is a cat?"]


@dataclass
class Live:
    url: str
    adapters: dict[str, Path]  # "good" (v1's weights), "worse" (other weights)

    def call(self, method: str, path: str, *, headers: dict[str, str] | None = None,
             **kwargs: Any) -> httpx.Response:
        return httpx.request(method, self.url + path, headers={**ADMIN, **(headers or {})},
                             timeout=60, **kwargs)

    def upload(self, which: str, **fields: str) -> dict[str, Any]:
        r = httpx.post(self.url + "/admin/adapters", headers=ADMIN,
                       data={"name": "bot", **fields},
                       files={"file": ("a.tar.gz", tar_gz(self.adapters[which]),
                                       "application/gzip")}, timeout=60)
        assert r.status_code == 201, r.text
        return dict(r.json())

    def adapter(self, adapter_id: str) -> dict[str, Any]:
        return dict(self.call("GET", f"/admin/adapters/{adapter_id}").json())

    def answer(self, model: str, prompt: str) -> str:
        r = httpx.post(self.url + "/v1/chat/completions", headers=ADMIN, timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    def gate_eval(self, adapter_id: str, version: int, timeout_s: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            runs = [e for e in self.call("GET", f"/admin/adapters/{adapter_id}/evals")
                    .json()["data"] if e["gate"] and e["version"] == version]
            if runs and runs[-1]["status"] != "running" and runs[-1]["gate_outcome"]:
                return dict(runs[-1])
            assert not runs or runs[-1]["status"] != "failed", runs
            assert time.monotonic() < deadline, f"no gate outcome for v{version}: {runs}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def live(tiny_model_factory: Callable[[str], Path],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    base = tiny_model_factory("llama_gqa")
    root = tmp_path_factory.mktemp("gate")
    adapters = {name: make_peft_adapter(base, root / name, r=8, alpha=64,
                                        targets=("q_proj", "v_proj", "o_proj"), seed=seed)
                for name, seed in (("good", 70), ("worse", 71))}
    with serve_registry(base, root, max_loras=4) as (url, _):
        yield Live(url, adapters)


def test_a_gated_adapter_keeps_a_worse_version_staged_and_promotes_a_good_one(
    live: Live, tmp_path: Path
) -> None:
    first = live.upload("good")
    adapter_id = first["id"]
    assert (first["version"], first["staged"], first["latest_version"]) == (1, False, 1)
    assert not first["gated"]
    # The gate's set: v1's own greedy answers, so that v1 scores 1.0 on it.
    expected = {p: live.answer("bot", p) for p in PROMPTS}
    gate_set = "\n".join(json.dumps({"prompt": p, "expected": a, "max_tokens": 6})
                         for p, a in expected.items()).encode()
    r = live.call("PUT", f"/admin/adapters/{adapter_id}/gate", content=gate_set,
                  headers={"Content-Type": "application/jsonl"})
    assert r.status_code == 200, r.text
    assert (r.json()["gated"], r.json()["gate_threshold"]) == (True, None)

    # A version with other weights: staged at once, scored below v1, kept staged.
    worse = live.upload("worse")
    assert (worse["version"], worse["staged"], worse["latest_version"]) == (2, True, 1)
    assert {p: live.answer("bot", p) for p in PROMPTS} == expected  # still v1
    worse_answers = {p: live.answer("bot@2", p) for p in PROMPTS}
    assert worse_answers != expected  # the staged version is served by its own name
    kept = live.gate_eval(adapter_id, 2)
    assert kept["previous_version"] == 1
    assert kept["scores"]["version"] < kept["scores"]["previous"] == 1.0
    assert kept["gate_outcome"].startswith("kept staged: scored")
    assert live.adapter(adapter_id)["latest_version"] == 1
    models = [m["id"] for m in live.call("GET", "/v1/models").json()["data"]]
    assert "bot" in models

    # The same weights as v1 again: as good as the current version, promoted; plain
    # `bot` switches to it while requests for it keep coming, none of them failing.
    statuses: list[int] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            statuses.append(httpx.post(live.url + "/v1/chat/completions", headers=ADMIN,
                                       timeout=60, json={"model": "bot", "max_tokens": 2,
                                       "messages": [{"role": "user", "content": "Hi"}]}
                                       ).status_code)

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        good = live.upload("good")
        assert (good["version"], good["staged"]) == (3, True)
        promoted = live.gate_eval(adapter_id, 3)
    finally:
        stop.set()
        thread.join(60)
    assert promoted["gate_outcome"] == "promoted", promoted
    assert promoted["previous_version"] == 1  # compared with the current one, not v2
    assert statuses and set(statuses) == {200}, statuses
    view = live.adapter(adapter_id)
    assert view["latest_version"] == 3
    assert [(v["version"], v["staged"]) for v in view["versions"]] == [
        (1, False), (2, True), (3, False)]
    audit = live.call("GET", "/admin/audit", params={"action": "adapter.promote"}).json()
    assert any(e["actor"] == "gate" for e in audit["data"])

    # Rollback: back to v1 (v3 staged again); promoting v2 (newer than v1) is allowed by
    # hand, and v2 then serves plain `bot`; a second rollback goes to v1 again.
    r = live.call("POST", f"/admin/adapters/{adapter_id}/rollback")
    assert r.status_code == 200 and r.json()["latest_version"] == 1, r.text
    r = live.call("POST", f"/admin/adapters/{adapter_id}/promote", params={"version": 2})
    assert r.status_code == 200 and r.json()["latest_version"] == 2, r.text
    assert {p: live.answer("bot", p) for p in PROMPTS} == worse_answers
    assert live.call("POST", f"/admin/adapters/{adapter_id}/rollback").json()[
        "latest_version"] == 1
    assert {p: live.answer("bot", p) for p in PROMPTS} == expected

    # Refusals.
    refusals = [
        (live.call("POST", f"/admin/adapters/{adapter_id}/promote", params={"version": 1}),
         409, "version_not_staged"),
        (live.call("POST", f"/admin/adapters/{adapter_id}/promote", params={"version": 9}),
         409, "version_not_ready"),
        (live.call("PUT", f"/admin/adapters/{adapter_id}/gate", content=b"{nope",
                   headers={"Content-Type": "application/jsonl"}), 400, "invalid_eval_set"),
        (live.call("PUT", f"/admin/adapters/{adapter_id}/gate", params={"threshold": 2},
                   content=gate_set, headers={"Content-Type": "application/jsonl"}),
         400, None),
        (live.call("POST", "/admin/adapters/ad_missing/promote", params={"version": 1}),
         404, None),
    ]
    for response, status, code in refusals:
        assert response.status_code == status, response.text
        if code is not None:
            assert response.json()["error"]["code"] == code

    # The gate off: a new version is current once ready.
    r = live.call("DELETE", f"/admin/adapters/{adapter_id}/gate")
    assert r.status_code == 200 and r.json()["gated"] is False
    fourth = live.upload("worse")
    assert (fourth["version"], fourth["staged"], fourth["latest_version"]) == (4, False, 4)


def test_a_staged_upload_waits_for_promote_and_a_threshold_holds_the_gate(
    live: Live, tmp_path: Path
) -> None:
    from app.admin_cli import admin

    staged = live.upload("good", name="solo", stage="true")
    adapter_id = staged["id"]
    assert (staged["staged"], staged["latest_version"]) == (True, None)
    assert "solo" not in [m["id"] for m in live.call("GET", "/v1/models").json()["data"]]
    r = httpx.post(live.url + "/v1/chat/completions", headers=ADMIN, timeout=60, json={
        "model": "solo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 404, r.text
    assert live.answer("solo@1", "Hi")  # reachable by its version
    assert live.call("POST", f"/admin/adapters/{adapter_id}/rollback").json()["error"][
        "code"] == "nothing_to_roll_back"
    bad_stage = httpx.post(live.url + "/admin/adapters", headers=ADMIN,
                           data={"name": "solo", "stage": "maybe"},
                           files={"file": ("a.tar.gz", tar_gz(live.adapters["good"]),
                                           "application/gzip")}, timeout=60)
    assert bad_stage.status_code == 400, bad_stage.text

    runner = CliRunner()
    env = {"LORAPLEX_URL": live.url, "LORAPLEX_ADMIN_KEY": ADMIN_KEY}
    result = runner.invoke(admin, ["adapters", "promote", "solo", "--version", "1"], env=env)
    assert result.exit_code == 0, result.output
    assert "solo: v1 is current" in result.output
    assert live.answer("solo", "Hi") == live.answer("solo@1", "Hi")

    # A gate whose threshold no version reaches (an item nobody answers): kept staged.
    gate_set = tmp_path / "gate.jsonl"
    gate_set.write_text(json.dumps({"prompt": "Hi", "expected": "unreachable answer"}) + "\n")
    result = runner.invoke(admin, ["adapters", "gate", "solo", "--data", str(gate_set),
                                   "--threshold", "0.5"], env=env)
    assert result.exit_code == 0, result.output
    assert "at least 0.5" in result.output
    second = live.upload("good", name="solo")
    assert (second["version"], second["staged"]) == (2, True)
    outcome = live.gate_eval(adapter_id, 2)["gate_outcome"]
    assert outcome == "kept staged: scored 0, below the threshold 0.5", outcome
    result = runner.invoke(admin, ["adapters", "rollback", "solo"], env=env)
    assert result.exit_code != 0 and "no earlier promoted version" in result.output
    result = runner.invoke(admin, ["adapters", "gate", "solo", "--off"], env=env)
    assert result.exit_code == 0 and "gate off" in result.output
    result = runner.invoke(admin, ["adapters", "gate", "solo"], env=env)
    assert result.exit_code == 2 and "either --data FILE" in result.output
