"""ProcessEngine: the engine core stepped in a process of its own, behind the same
EngineClient as AsyncEngine. Outputs equal Hugging Face's, errors cross the pipe as the
same classes, closed streams free their blocks, and a dead engine process fails what was
in flight instead of hanging it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.client import RouteHint
from engine.config import EngineConfig
from engine.core_process import ProcessEngine
from engine.errors import EngineDeadError, RequestRejected
from engine.models.config import ModelLoadError
from engine.request import EngineRequest, SamplingParams
from engine.structured import StructuredOutput
from engine.structured.errors import StructuredOutputError
from tests.utils.hf_oracle import hf_greedy, peft_greedy
from tests.utils.peft_adapters import make_peft_adapter

pytestmark = pytest.mark.slow


def _config(model_dir: Path, **overrides: object) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), dtype="float32", kv_cache_tokens=2048,
        enable_prefix_caching=False, engine_process=True, **overrides,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_factory("llama_long")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[ProcessEngine]:
    eng = ProcessEngine(_config(model_dir))
    eng.start_sync()
    yield eng
    asyncio.run(eng.shutdown())


async def collect(engine: ProcessEngine, rid: str, ids: list[int], n: int,
                  adapter: str | None = None) -> list[int]:
    tokens: list[int] = []
    request = EngineRequest(rid, tuple(ids), SamplingParams(max_tokens=n, temperature=0),
                            adapter=adapter)
    async for out in engine.generate(request):
        tokens.extend(out.new_token_ids)
    return tokens


async def test_runs_in_another_process_and_matches_hf(
    engine: ProcessEngine, model_dir: Path
) -> None:
    assert engine.pid is not None and engine.pid != os.getpid()
    assert engine.is_ready() and engine.failure() is None
    prompts = ["Hello, my name is", "The three primary colors are", "In 1969, astronauts"]
    ids = [engine.encode(p) for p in prompts]
    results = await asyncio.gather(*(collect(engine, f"g{i}", p, 10) for i, p in enumerate(ids)))
    for p, got in zip(ids, results, strict=True):
        assert got == hf_greedy(model_dir, p, 10)


async def test_what_the_server_process_answers_itself(engine: ProcessEngine) -> None:
    from engine.remote.tokenizer import LocalTokenizer

    local = LocalTokenizer(engine.ready_info.model_dir, Path("unused"))
    messages = [{"role": "user", "content": "hi"}]
    assert engine.encode("Hello there") == local.encode("Hello there")
    assert engine.apply_chat_template(messages) == local.apply_chat_template(messages)
    assert engine.token_text(42) == local.token_text(42)
    assert engine.vocab_size == local.vocab_size
    assert engine.max_model_len == min(2048, local.model_config.max_position_embeddings)
    assert engine.device == "cpu"
    assert engine.route(["a"], RouteHint(None)) is None
    [worker] = engine.workers()
    assert (worker.id, worker.model, worker.ready) == ("local", engine.model_id, True)
    assert worker.residency == []


async def test_a_refusal_crosses_the_pipe_as_the_same_error(engine: ProcessEngine) -> None:
    ids = [100] * (engine.max_model_len + 1)
    with pytest.raises(RequestRejected) as refused:
        async for _ in engine.generate(
            EngineRequest("too-long", tuple(ids), SamplingParams(max_tokens=1))
        ):
            pass
    assert refused.value.code == "context_length_exceeded"
    assert engine.is_ready()


async def test_structured_outputs_compile_in_the_engine_process(engine: ProcessEngine) -> None:
    spec = StructuredOutput.choice(["yes", "no"])
    engine.check_structured_output(spec)  # compiles and caches
    request = EngineRequest(
        "choice", tuple(engine.encode("Answer:")),
        SamplingParams(max_tokens=8, temperature=0, structured=spec),
    )
    text = ""
    async for out in engine.generate(request):
        text += out.new_text
    assert text in ("yes", "no")
    bad = StructuredOutput.regex("(unclosed")
    with pytest.raises(StructuredOutputError) as refused:
        await asyncio.to_thread(engine.check_structured_output, bad)
    assert refused.value.code == "invalid_grammar"
    with pytest.raises(StructuredOutputError):
        async for _ in engine.generate(EngineRequest(
            "bad-regex", (1, 2), SamplingParams(max_tokens=2, structured=bad)
        )):
            pass


async def test_closing_the_stream_aborts_and_frees_blocks(engine: ProcessEngine) -> None:
    total = (await engine.refresh_stats()).num_total_blocks
    gen = engine.generate(EngineRequest(
        "long", tuple(engine.encode("Tell me a story")),
        SamplingParams(max_tokens=500, temperature=0, ignore_eos=True),
    ))
    seen = 0
    async for _ in gen:
        seen += 1
        if seen == 3:
            break
    await gen.aclose()
    for _ in range(100):
        stats = await engine.refresh_stats()
        if stats.num_free_blocks == total and stats.num_running == 0:
            break
        await asyncio.sleep(0.05)
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, total)
    assert stats.num_steps > 0


async def test_adapters_are_served_and_mirrored(
    engine: ProcessEngine, model_dir: Path, tmp_path: Path
) -> None:
    adapter_dir = make_peft_adapter(model_dir, tmp_path / "a", r=8, seed=3, std=0.5)
    info = await engine.add_adapter("tuned", str(adapter_dir))
    assert (info.name, info.rank) == ("tuned", 8)
    assert engine.get_adapter("tuned") == info and info in engine.list_adapters()
    assert engine.stats().num_adapters == 1
    ids = engine.encode("Once upon a time")
    got = await collect(engine, "with-adapter", ids, 8, adapter="tuned")
    assert got == peft_greedy(model_dir, {"tuned": adapter_dir}, "tuned", ids, 8)
    assert got != hf_greedy(model_dir, ids, 8)  # the adapter changes the answer
    assert [p.name for p in engine.adapter_residency()] == ["tuned"]
    with pytest.raises(ValueError, match="adapter"):  # AdapterError, from the engine's check
        await engine.add_adapter("broken", str(tmp_path / "missing"))
    assert engine.get_adapter("broken") is None
    assert await engine.remove_adapter("tuned") is True
    assert engine.get_adapter("tuned") is None and engine.list_adapters() == []
    with pytest.raises(RequestRejected) as unknown:
        await collect(engine, "gone", ids, 2, adapter="tuned")
    assert unknown.value.code == "model_not_found"


async def test_a_killed_engine_process_fails_what_was_in_flight(model_dir: Path) -> None:
    engine = ProcessEngine(_config(model_dir))
    await engine.start()
    try:
        gen = engine.generate(EngineRequest(
            "doomed", tuple(engine.encode("Count:")),
            SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True),
        ))
        await gen.__anext__()
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError) as dead:
            async for _ in gen:
                pass
        assert "engine process exited" in str(dead.value)
        assert engine.failure() is not None and "exit code -9" in engine.failure()  # type: ignore[operator]
        assert not engine.is_ready()
        with pytest.raises(EngineDeadError):
            await collect(engine, "after", [1, 2, 3], 2)
    finally:
        await engine.shutdown()


_SERVER_SCRIPT = """
import asyncio, sys
from engine.config import EngineConfig
from engine.core_process import ProcessEngine

async def main():
    engine = ProcessEngine(EngineConfig(model=sys.argv[1], dtype="float32",
                                        kv_cache_tokens=2048, engine_process=True))
    await engine.start()
    print(engine.pid, flush=True)
    await asyncio.sleep(600)

if __name__ == "__main__":
    asyncio.run(main())
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in state  # exited, not yet reaped by its new parent


def test_the_engine_process_stops_when_its_server_is_killed(
    model_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "server.py"
    script.write_text(_SERVER_SCRIPT)
    server = subprocess.Popen(
        [sys.executable, str(script), str(model_dir)], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert server.stdout is not None
        engine_pid = int(server.stdout.readline())
        assert not _gone(engine_pid)
        server.kill()  # SIGKILL: the server cannot stop its engine itself
        server.wait(30)
        deadline = time.monotonic() + 30
        while not _gone(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(engine_pid), "the engine process outlived its server"
    finally:
        server.kill()


async def test_shutdown_stops_the_engine_process(model_dir: Path) -> None:
    engine = ProcessEngine(_config(model_dir))
    await engine.start()
    process = engine._process
    await engine.shutdown()
    assert process is not None and not process.is_alive() and process.exitcode == 0
    with pytest.raises(EngineDeadError):
        await collect(engine, "late", [1, 2], 1)


def test_a_model_that_cannot_load_fails_the_start(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "no-such-family"}')
    engine = ProcessEngine(_config(tmp_path))
    with pytest.raises((ModelLoadError, RuntimeError)) as failed:
        engine.start_sync()
    assert "no-such-family" in str(failed.value)
    assert engine._process is not None and not engine._process.is_alive()
