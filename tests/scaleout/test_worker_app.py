"""The worker's internal API: its token, its adapter paths, its streams (over real HTTP)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.errors import EngineDeadError, RequestRejected
from engine.remote.protocol import (
    ABORT_PATH,
    ADAPTERS_PATH,
    GENERATE_PATH,
    REMOVE_ADAPTER_PATH,
    STATS_PATH,
    WireError,
    decode_line,
    encode_request,
)
from engine.remote.worker_app import begin_drain, create_worker_app
from engine.request import EngineRequest, RequestOutput, SamplingParams
from engine.structured import GRAMMAR_TOO_COMPLEX, GrammarLimitError, StructuredOutput
from tests.utils.fake_engine import FakeEngine
from tests.utils.live_server import serve_in_thread

TOKEN = "worker-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(model_id="fake-model", max_model_len=4096, token_delay_s=0.01)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    store = tmp_path / "data" / "adapters" / ("a" * 64)
    store.mkdir(parents=True)
    (store / "adapter_config.json").write_text("{}")
    return tmp_path / "data"


@pytest.fixture
def worker(engine: FakeEngine, data_dir: Path) -> Iterator[str]:
    app = create_worker_app(engine, token=TOKEN, data_dir=data_dir, keepalive_s=0.05,
                            render_metrics=lambda: b"loraplex_test 1\n")
    with serve_in_thread(app) as base:
        yield base


def _generate_body(request_id: str, prompt: str = "hello", **sampling: object) -> dict[str, Any]:
    params = SamplingParams(**{"max_tokens": 4, **sampling})  # type: ignore[arg-type]
    body: dict[str, Any] = json.loads(
        encode_request(EngineRequest(request_id, tuple(prompt.encode()), params))
    )
    return body


def _lines(response: httpx.Response) -> list[RequestOutput | WireError | None]:
    return [None if not line else decode_line(line) for line in response.text.split("\n")[:-1]]


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong-token-0123456789abcdef"}, {"Authorization": TOKEN},
     {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}],
)
def test_internal_routes_need_the_token(worker: str, headers: dict[str, str]) -> None:
    with httpx.Client(base_url=worker, timeout=10) as client:
        for method, path, body in [
            ("POST", GENERATE_PATH, _generate_body("r1")),
            ("POST", ABORT_PATH, {"request_id": "r1"}),
            ("GET", ADAPTERS_PATH, None),
            ("POST", ADAPTERS_PATH, {"name": "x", "path": "adapters/" + "a" * 64}),
            ("POST", REMOVE_ADAPTER_PATH, {"name": "x"}),
            ("GET", STATS_PATH, None),
        ]:
            response = client.request(method, path, json=body, headers=headers)
            assert response.status_code == 401, (path, response.text)
            assert response.json()["error"]["kind"] == "unauthorized"
        # Probes and metrics answer anyone.
        assert client.get("/health").json() == {"status": "ok"}
        assert client.get("/ready").status_code == 200
        assert client.get("/metrics").text == "loraplex_test 1\n"


def test_generate_streams_outputs_as_lines(worker: str, engine: FakeEngine) -> None:
    with httpx.Client(base_url=worker, timeout=10) as client:
        response = client.post(GENERATE_PATH, json=_generate_body("r1", max_tokens=3),
                               headers=AUTH)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-ndjson"
    outputs = [x for x in _lines(response) if x is not None]
    assert [o.new_text for o in outputs if isinstance(o, RequestOutput)] == ["h", "e", "l"]
    last = outputs[-1]
    assert isinstance(last, RequestOutput)
    assert (last.finished, last.finish_reason, last.num_output_tokens) == (True, "length", 3)
    assert engine.finished == ["r1"]


def test_a_request_the_engine_refuses_is_refused(worker: str, engine: FakeEngine) -> None:
    with httpx.Client(base_url=worker, timeout=10) as client:
        empty = _generate_body("r1")
        empty["request"]["prompt_token_ids"] = []
        response = client.post(GENERATE_PATH, json=empty, headers=AUTH)
        assert response.status_code == 400
        error = WireError.model_validate(response.json()["error"])
        assert error == WireError(kind="invalid", message="prompt must contain at least one token")
        bad = _generate_body("r2")
        bad["request"]["sampling"]["top_p"] = 0
        refused = client.post(GENERATE_PATH, json=bad, headers=AUTH)
        assert refused.status_code == 400
        assert refused.json()["error"]["kind"] == "invalid"
        assert client.post(GENERATE_PATH, json={"x": 1}, headers=AUTH).status_code == 422
        newer = _generate_body("r3")
        newer["request"]["sampling"]["min_p"] = 0.1  # unknown here: refused, not dropped
        assert client.post(GENERATE_PATH, json=newer, headers=AUTH).status_code == 422
    assert engine.submitted == []


def test_a_structured_request_reaches_the_engine_whole(worker: str, engine: FakeEngine
                                                       ) -> None:
    spec = StructuredOutput.json_schema({"type": "object"}, strict=True)
    with httpx.Client(base_url=worker, timeout=10) as client:
        response = client.post(GENERATE_PATH, json=_generate_body("r1", structured=spec),
                               headers=AUTH)
    assert response.status_code == 200
    [submitted] = engine.submitted
    assert submitted.sampling.structured == spec


def test_a_refused_structured_output_ends_the_stream_as_rejected(
        worker: str, engine: FakeEngine) -> None:
    engine.fail_with = GrammarLimitError("the regex is longer than 4096 characters "
                                         "(max_regex_chars)", limit="max_regex_chars")
    with httpx.Client(base_url=worker, timeout=10) as client:
        response = client.post(GENERATE_PATH, json=_generate_body(
            "r1", structured=StructuredOutput.regex("a")), headers=AUTH)
    [error] = [x for x in _lines(response) if x is not None]
    assert isinstance(error, WireError)
    assert (error.kind, error.code) == ("rejected", GRAMMAR_TOO_COMPLEX)
    back = error.to_exception()
    assert isinstance(back, RequestRejected) and back.code == GRAMMAR_TOO_COMPLEX
    assert "max_regex_chars" in str(back)


def test_an_engine_error_ends_the_stream_with_its_code(worker: str, engine: FakeEngine) -> None:
    engine.fail_with = EngineDeadError("engine failed: CUDA error")
    with httpx.Client(base_url=worker, timeout=10) as client:
        response = client.post(GENERATE_PATH, json=_generate_body("r1"), headers=AUTH)
    assert response.status_code == 200
    [error] = [x for x in _lines(response) if x is not None]
    assert error == WireError(kind="engine", code="engine_failed",
                              message="engine failed: CUDA error")
    assert isinstance(error, WireError)
    assert type(error.to_exception()) is EngineDeadError


def test_keepalive_lines_while_a_request_waits(worker: str, engine: FakeEngine) -> None:
    engine.first_token_delay_s = 0.4  # keepalive every 0.05 s
    with httpx.Client(base_url=worker, timeout=10) as client:
        response = client.post(GENERATE_PATH, json=_generate_body("r1", max_tokens=1),
                               headers=AUTH)
    lines = _lines(response)
    assert lines[0] is None and lines.count(None) >= 3
    assert isinstance(lines[-1], RequestOutput) and lines[-1].finished


def test_a_dropped_connection_aborts_the_engine_request(worker: str, engine: FakeEngine) -> None:
    engine.token_delay_s = 0.05
    with httpx.Client(base_url=worker, timeout=10) as client, client.stream(
        "POST", GENERATE_PATH, json=_generate_body("r1", max_tokens=1000), headers=AUTH
    ) as response:
        # NOTE: a reference to the iterator is kept: dropping it closes the connection.
        lines = response.iter_lines()
        while not next(lines):
            pass
        assert engine.active == {"r1"}
    deadline = time.monotonic() + 5
    while "r1" not in engine.aborted:
        assert time.monotonic() < deadline, "the engine request was never aborted"
        time.sleep(0.01)
    assert engine.active == set()
    assert "r1" not in engine.finished


def test_draining_worker_refuses_new_generations(engine: FakeEngine, data_dir: Path) -> None:
    app = create_worker_app(engine, token=TOKEN, data_dir=data_dir)
    begin_drain(app)
    with serve_in_thread(app) as base, httpx.Client(base_url=base, timeout=10) as client:
        response = client.post(GENERATE_PATH, json=_generate_body("r1"), headers=AUTH)
        assert response.status_code == 503
        assert response.json()["error"]["kind"] == "unavailable"
        assert client.get("/ready").status_code == 503
        assert client.get(STATS_PATH, headers=AUTH).json()["draining"] is True
    assert engine.submitted == []


def test_adapter_paths_must_lie_in_the_store(
    worker: str, engine: FakeEngine, data_dir: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.symlink(outside, data_dir / "adapters" / ("b" * 64))
    digest = "a" * 64
    with httpx.Client(base_url=worker, timeout=10) as client:
        for path in [
            "../elsewhere", str(outside), "adapters", "adapters/..", str(data_dir / "adapters"),
            f"adapters/{digest}/../../..", "adapters/" + "b" * 64,  # a symlink out of it
            "/etc",
        ]:
            response = client.post(ADAPTERS_PATH, json={"name": "x", "path": path},
                                   headers=AUTH)
            assert response.status_code == 400, (path, response.text)
            assert response.json()["error"]["code"] == "path_outside_store"
        assert engine.adapters == {}
        # Relative to the data directory, or absolute: both resolve to the same directory.
        added = client.post(ADAPTERS_PATH, json={"name": "x", "path": f"adapters/{digest}"},
                            headers=AUTH)
        assert added.status_code == 200, added.text
        info = added.json()
        assert info["path"] == str((data_dir / "adapters" / digest).resolve())
        # Registering the same directory again is a no-op; the same version is served.
        again = client.post(
            ADAPTERS_PATH, json={"name": "x", "path": str(data_dir / "adapters" / digest)},
            headers=AUTH,
        )
        assert again.json()["key"] == info["key"] == "x#1"
        listed = client.get(ADAPTERS_PATH, headers=AUTH).json()["adapters"]
        assert [a["name"] for a in listed] == ["x"]
        removed = client.post(REMOVE_ADAPTER_PATH, json={"name": "x"}, headers=AUTH)
        assert removed.json() == {"removed": True}
        assert engine.adapters == {}


def test_stats_report_the_engine(worker: str, engine: FakeEngine) -> None:
    with httpx.Client(base_url=worker, timeout=10) as client:
        stats = client.get(STATS_PATH, headers=AUTH).json()
    assert stats["model_id"] == "fake-model"
    assert stats["max_model_len"] == 4096
    assert stats["ready"] is True
    assert json.dumps(stats["stats"]["num_total_blocks"]) == "128"
