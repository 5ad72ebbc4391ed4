"""FakeEngine: the model-free EngineClient the API tests and the gateway benchmark serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.client import RouteHint
from engine.errors import AdapterError, RequestRejected
from engine.request import EngineRequest, RequestOutput, SamplingParams
from engine.structured import StructuredOutput
from engine.testing import FILLER, FakeEngine, fake_logprob, fake_top


async def run(engine: FakeEngine, request: EngineRequest) -> list[RequestOutput]:
    return [out async for out in engine.generate(request)]


def request(prompt: bytes = b"hello", rid: str = "r", **sampling: object) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams(**sampling))  # type: ignore[arg-type]


async def test_echoes_the_prompt_cyclically_from_the_seed() -> None:
    engine = FakeEngine()
    outputs = await run(engine, request(b"abc", max_tokens=5, seed=4))
    assert [o.new_text for o in outputs] == ["b", "c", "a", "b", "c"]
    assert [o.num_output_tokens for o in outputs] == [1, 2, 3, 4, 5]
    assert [o.finish_reason for o in outputs] == [None] * 4 + ["length"]
    assert engine.finished == ["r"] and engine.aborted == [] and engine.active == set()
    [submitted] = engine.submitted
    assert (submitted.prompt_token_ids, submitted.adapter_id) == ([97, 98, 99], None)


async def test_stop_strings_are_held_back_and_never_sent() -> None:
    engine = FakeEngine()
    outputs = await run(engine, request(b"hello world", max_tokens=11, stop=["lo w", "xyz"]))
    # "l" may start "lo w": held back until the next byte shows it does not.
    assert [o.new_text for o in outputs] == ["h", "e", "", "l", "", "", ""]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].num_output_tokens == 7
    # A prefix that does not become a stop string is released.
    outputs = await run(engine, request(b"helium", rid="r2", max_tokens=6, stop=["lo"]))
    assert "".join(o.new_text for o in outputs) == "helium"


async def test_eos_after_and_logprobs() -> None:
    engine = FakeEngine(eos_after=2)
    outputs = await run(engine, request(b"hi!", max_tokens=10, logprobs=2))
    assert [o.finish_reason for o in outputs] == [None, "stop"]
    [logprob] = outputs[1].new_logprobs
    assert (logprob.token_id, logprob.logprob) == (ord("i"), fake_logprob(ord("i")))
    assert logprob.top == fake_top(ord("i"), 2) == [(105, -0.5), (106, -1.5)]
    assert outputs[1].new_token_texts == ["i"]


async def test_instant_answers_filler_in_one_output() -> None:
    engine = FakeEngine.instant_engine()
    [out] = await run(engine, request(b"any prompt at all", max_tokens=50))
    assert out.new_token_ids == list((FILLER * 2)[:50])
    assert out.new_text == (FILLER * 2)[:50].decode()
    assert (out.finished, out.finish_reason, out.num_output_tokens) == (True, "length", 50)
    assert out.num_prompt_tokens == len(b"any prompt at all")
    assert engine.submitted == [] and engine.finished == []  # a benchmark keeps no log
    assert (engine.model_id, engine.max_model_len) == ("instant", 4096)


async def test_abort_ends_a_stream_with_abort() -> None:
    engine = FakeEngine(token_delay_s=0.01)
    stream = engine.generate(request(b"hello", max_tokens=100))
    first = await anext(stream)
    assert first.new_text == "h" and engine.active == {"r"}
    engine.abort("r")
    rest = [out async for out in stream]
    assert [(o.finished, o.finish_reason) for o in rest] == [(True, "abort")]
    assert engine.aborted == ["r"] and engine.active == set()


async def test_closing_a_stream_early_counts_as_aborted() -> None:
    engine = FakeEngine(token_delay_s=0.01)
    stream = engine.generate(request(b"hello", max_tokens=100))
    await anext(stream)
    await stream.aclose()
    assert engine.aborted == ["r"] and engine.finished == []


async def test_fail_with_raises_after_recording() -> None:
    engine = FakeEngine(fail_with=RequestRejected("no", code="context_length_exceeded"))
    with pytest.raises(RequestRejected):
        await run(engine, request())
    assert [s.request_id for s in engine.submitted] == ["r"]


async def test_strict_adapters_serve_only_what_was_added() -> None:
    engine = FakeEngine(strict_adapters=True)
    missing = EngineRequest("r", (1,), SamplingParams(max_tokens=1), adapter="a")
    with pytest.raises(RequestRejected) as rejected:
        await run(engine, missing)
    assert (rejected.value.code, rejected.value.param) == ("model_not_found", "model")
    assert engine.submitted == []
    await engine.add_adapter("a", "/nowhere/a")
    assert (await run(engine, missing))[-1].finished
    assert FakeEngine().get_adapter("a") is None  # lenient: any name is served
    assert (await run(FakeEngine(), missing))[-1].finished


async def test_adapters_get_fixed_info_or_their_config(tmp_path: Path) -> None:
    engine = FakeEngine()
    info = await engine.add_adapter("x", "/nowhere/x")
    assert (info.key, info.rank, info.alpha, info.target_modules, info.created) == (
        "x#1", 8, 16.0, ("q_proj", "v_proj"), 1_700_000_000
    )
    assert (await engine.add_adapter("x", "/nowhere/x2")).key == "x#2"
    assert [a.name for a in engine.list_adapters()] == ["x"]
    assert engine.stats().num_adapters == 1
    reading = FakeEngine(read_adapter_configs=True)
    with pytest.raises(AdapterError, match=r"adapter_config\.json"):
        await reading.add_adapter("y", str(tmp_path))
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": ["o_proj"]})
    )
    read = await reading.add_adapter("y", str(tmp_path))
    assert (read.rank, read.alpha, read.use_rslora, read.target_modules) == (
        4, 8.0, True, ("o_proj",)
    )
    assert read.size_bytes == (tmp_path / "adapter_config.json").stat().st_size
    assert await reading.remove_adapter("y") and not await reading.remove_adapter("y")


async def test_runs_everything_itself() -> None:
    engine = FakeEngine(model_id="m")
    assert engine.route(["a"], RouteHint("x", "t", dedicated=True)) is None
    engine.release(["a"])
    [worker] = engine.workers()
    assert (worker.id, worker.model, worker.ready, worker.in_rotation) == ("local", "m", True,
                                                                            None)
    assert worker.stats == engine.stats()
    engine.failed = "broken"
    assert not engine.workers()[0].ready and engine.failure() == "broken"


def test_structured_surface_serves_every_spec_and_renders_tools() -> None:
    engine = FakeEngine()
    assert engine.vocab_size == 256
    engine.check_structured_output(StructuredOutput.regex("("))  # nothing to compile against
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert engine.chat_template_has_tools
    plain = bytes(engine.apply_chat_template(messages)).decode()
    with_tools = bytes(engine.apply_chat_template(messages, tools=tools)).decode()
    assert plain == "<|user|>hi\n<|assistant|>"
    tools_line = '<|tools|>[{"type":"function","function":{"name":"f","parameters":{}}}]\n'
    assert with_tools == tools_line + plain
