"""Built-in adapter evals through the admin API and `loraplex admin adapters eval`, on a
live server with a real engine (a tiny random model, two versions of an adapter
uploaded through the registry): each model's score against Hugging Face / PEFT as the
oracle for the multiple-choice items and the server's own greedy answers for the
generation ones; progress, stored results, and what is refused."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from click.testing import CliRunner

from engine.async_engine import AsyncEngine
from tests.utils.hf_oracle import hf_model, peft_model
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.saas import ADMIN_KEY, bearer, tar_gz
from tests.utils.tiny_server import serve_registry

ADMIN = bearer(ADMIN_KEY)
CHOICE_ITEMS = [
    ("The sky is", ["blue", "green", "loud", "seven"]),
    ("Two plus two is", ["four", "five", "blue", "cold"]),
    ("Water is", ["wet", "dry", "square", "late"]),
]
GENERATION_PROMPTS = ["Name a fruit.", "Say something about the sea."]


@dataclass
class Live:
    url: str
    model_dir: Path
    adapters: dict[int, Path]  # version -> files
    adapter_id: str
    engine: AsyncEngine

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=ADMIN, timeout=60, **kwargs)

    def post(self, path: str, *, headers: dict[str, str] | None = None,
             **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, headers={**ADMIN, **(headers or {})}, timeout=60,
                          **kwargs)


@pytest.fixture(scope="module")
def live(tiny_model_factory: Callable[[str], Path],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    base = tiny_model_factory("llama_gqa")
    root = tmp_path_factory.mktemp("evals")
    adapters = {v: make_peft_adapter(base, root / f"v{v}", r=8, alpha=64,
                                     targets=("q_proj", "v_proj", "o_proj"), seed=50 + v)
                for v in (1, 2)}
    with serve_registry(base, root) as (url, engine):
        for path in adapters.values():
            r = httpx.post(url + "/admin/adapters", headers=ADMIN, data={"name": "bot"},
                           files={"file": ("a.tar.gz", tar_gz(path), "application/gzip")},
                           timeout=60)
            assert r.status_code == 201, r.text
        yield Live(url, base, adapters, r.json()["id"], engine)


@torch.inference_mode()
def choice_of(live: Live, version: int | None, prompt: str, choices: list[str]) -> int:
    """The oracle: the likeliest choice after the prompt (its tokens' summed logprobs)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(live.model_dir)
    if version is None:
        model = hf_model(str(live.model_dir))
    else:
        model = peft_model(str(live.model_dir), ((f"v{version}", str(live.adapters[version])),))
        model.set_adapter(f"v{version}")  # type: ignore[operator]
    context = tokenizer.encode(prompt, add_special_tokens=False)
    totals = []
    for choice in choices:
        continuation = tokenizer.encode(" " + choice, add_special_tokens=False)
        ids = torch.tensor([context + continuation])
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # type: ignore[operator]
        totals.append(sum(logprobs[len(context) + i - 1, t].item()
                          for i, t in enumerate(continuation)))
    return max(range(len(totals)), key=totals.__getitem__)


def greedy_answer(live: Live, model: str, prompt: str) -> str:
    r = httpx.post(live.url + "/v1/chat/completions", headers=ADMIN, timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 6,
        "temperature": 0})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def run_eval(live: Live, data: bytes, **params: Any) -> dict[str, Any]:
    r = live.post(f"/admin/adapters/{live.adapter_id}/evals", content=data, params=params,
                  headers={"Content-Type": "application/jsonl"})
    assert r.status_code == 202, r.text
    started = r.json()
    assert started["status"] == "running" and started["done_items"] == 0
    path = f"/admin/adapters/{live.adapter_id}/evals/{started['id']}"
    for _ in range(600):
        body = live.get(path).json()
        if body["status"] != "running":
            return dict(body)
        asyncio.run(asyncio.sleep(0.1))
    raise AssertionError("the eval did not finish")


def test_scores_of_the_version_the_previous_one_and_the_base(live: Live) -> None:
    model_id = live.engine.model_id
    # Choices: the answer is what v2 finds likeliest (the oracle's), so v2 scores all.
    answers = {p: choice_of(live, 2, p, c) for p, c in CHOICE_ITEMS}
    # Generation: what v2 answers, exactly.
    expected = {p: greedy_answer(live, "bot@2", p) for p in GENERATION_PROMPTS}
    items = [{"prompt": p, "choices": c, "answer": answers[p]} for p, c in CHOICE_ITEMS]
    items += [{"prompt": p, "expected": expected[p], "max_tokens": 6}
              for p in GENERATION_PROMPTS]
    data = "\n".join(json.dumps(i) for i in items).encode()
    body = run_eval(live, data)

    def score_of(version: int | None, model: str) -> float:
        right = sum(choice_of(live, version, p, c) == answers[p] for p, c in CHOICE_ITEMS)
        right += sum(greedy_answer(live, model, p).strip() == expected[p].strip()
                     for p in GENERATION_PROMPTS)
        return right / len(items)

    assert body["status"] == "done", body
    assert (body["version"], body["previous_version"]) == (2, 1)
    assert body["scores"] == pytest.approx({
        "version": 1.0, "previous": score_of(1, "bot@1"), "base": score_of(None, model_id)})
    assert body["scores"]["base"] < 1.0  # the set tells the adapter from the base
    assert body["done_items"] == body["total_items"] == 3 * len(items)
    assert body["set_sha256"] == hashlib.sha256(data).hexdigest()
    # Version 1 on its own: nothing before it to compare with.
    first = run_eval(live, data, version=1)
    assert first["previous_version"] is None and first["scores"]["previous"] is None
    assert first["scores"]["version"] == pytest.approx(score_of(1, "bot@1"))
    listed = live.get(f"/admin/adapters/{live.adapter_id}/evals").json()["data"]
    assert [e["id"] for e in listed][-2:] == [body["id"], first["id"]]


def test_progress_is_written_off_the_event_loop(live: Live,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """While a progress write is held, the server keeps answering: the write runs on a
    worker thread (on the event loop, the held write would hold every request)."""
    from app.evals import service

    entered, release = threading.Event(), threading.Event()
    held: list[bool] = []
    real = service.EvalService._write

    def held_write(self: service.EvalService, eval_id: str, **fields: Any) -> None:
        if "scores" not in fields and not entered.is_set():  # the first progress write
            entered.set()
            held.append(release.wait(10))
        real(self, eval_id, **fields)

    monkeypatch.setattr(service.EvalService, "_write", held_write)
    monkeypatch.setattr(service, "PROGRESS_INTERVAL_S", 0.0)
    items = [{"prompt": p, "expected": "x", "match": "contains", "max_tokens": 3}
             for p in GENERATION_PROMPTS * 2]
    r = live.post(f"/admin/adapters/{live.adapter_id}/evals",
                  content="\n".join(json.dumps(i) for i in items).encode(),
                  headers={"Content-Type": "application/jsonl"})
    assert r.status_code == 202, r.text
    assert entered.wait(30)
    assert live.get("/v1/models").status_code == 200  # answered while the write is held
    release.set()
    path = f"/admin/adapters/{live.adapter_id}/evals/{r.json()['id']}"
    for _ in range(600):
        body = live.get(path).json()
        if body["status"] != "running":
            break
        time.sleep(0.1)
    assert held == [True]
    assert body["status"] == "done" and body["done_items"] == 3 * len(items)


def test_the_command_line_shows_progress_and_scores(live: Live, tmp_path: Path) -> None:
    from app.cli import main

    data = tmp_path / "set.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "choices": c, "answer": 0})
                              for p, c in CHOICE_ITEMS))
    result = CliRunner().invoke(main, ["admin", "--url", live.url, "--admin-key", ADMIN_KEY,
                                       "adapters", "eval", "bot", "--data", str(data)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["MODEL", "SCORE"]
    assert [line.split()[0] for line in lines[1:]] == ["v2", "v1", "base"]
    result = CliRunner().invoke(main, ["admin", "--url", live.url, "--admin-key", ADMIN_KEY,
                                       "adapters", "eval", "nope", "--data", str(data)])
    assert result.exit_code == 2 and "no adapter 'nope'" in result.output


@pytest.mark.parametrize(("path", "params", "body", "status", "wanted"), [
    ("{adapter}", {}, b'{"prompt": "p"}', 400, "line 1: needs 'expected'"),
    ("{adapter}", {"version": 7}, b'{"prompt": "p", "expected": "x"}', 400,
     "has no ready version 7"),
    ("adp_unknown", {}, b'{"prompt": "p", "expected": "x"}', 404, ""),
])
def test_refusals(live: Live, path: str, params: dict[str, Any], body: bytes, status: int,
                  wanted: str) -> None:
    adapter = path.format(adapter=live.adapter_id)
    r = live.post(f"/admin/adapters/{adapter}/evals", content=body, params=params)
    assert r.status_code == status, r.text
    assert wanted in r.json()["error"]["message"]
