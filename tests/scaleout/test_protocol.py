"""The wire format: every engine value survives JSON unchanged, unknown fields are refused
(but ignored in heartbeats), and errors come back as the classes the engine raised."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from engine.client import AdapterInfo, AdapterPlacement, EngineStats
from engine.errors import (
    AdapterError,
    AdapterLoadError,
    EngineDeadError,
    EngineError,
    EngineStepError,
    EngineUnavailable,
    NoWorkerAvailable,
    RequestRejected,
    WorkerLost,
)
from engine.remote.heartbeat import Heartbeat
from engine.remote.protocol import (
    AdapterList,
    WireError,
    WorkerStats,
    decode_adapter_info,
    decode_line,
    decode_request,
    encode_adapter_info,
    encode_error,
    encode_output,
    encode_request,
    refusal,
)
from engine.request import EngineRequest, RequestOutput, SamplingParams, TenantContext, TokenLogprob
from engine.stats import AdapterCacheStats, LatencyHistogram
from engine.structured import OutputKind, StructuredOutput, Whitespace

SAMPLING = SamplingParams(
    max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, presence_penalty=0.1,
    frequency_penalty=-0.2, repetition_penalty=1.1, seed=2**62, stop=["\n\n", "END"],
    stop_token_ids=[2, 7], ignore_eos=True, logprobs=3,
)
TENANT = TenantContext("t_1", weight=2.5, max_running=4, max_kv_fraction=0.5,
                       max_tokens=100, max_context_tokens=2048)
REQUEST = EngineRequest(
    request_id="chatcmpl-1-0", prompt_token_ids=(1, 2, 49151), sampling=SAMPLING,
    adapter="av/ver_1", salt="t_1", priority=2, tenant=TENANT,
)
CACHE = AdapterCacheStats(
    device_hits=1, device_misses=2, loads=3, load_failures=4, device_evictions=5,
    host_evictions=6, num_device=7, num_host=8, num_loading=9, num_queued=10,
    load_latency=LatencyHistogram((0.1, 1.0), (1, 3, 4), 2.5, 4),
    device_slots=11, host_capacity=12,
)
INFO = AdapterInfo("av/v1", "av/v1#3", "/data/adapters/abc", 8, 16.0, True,
                   ("q_proj", "v_proj"), 4096, 1_700_000_000)
PLACE = AdapterPlacement("av/v1", 2, True, False, 3, 1)


def test_generate_request_round_trip() -> None:
    back = decode_request(encode_request(REQUEST))
    assert back == REQUEST
    assert back.sampling == SAMPLING and back.tenant == TENANT
    assert (back.request_id, back.prompt_token_ids, back.adapter, back.salt, back.priority) == (
        "chatcmpl-1-0", (1, 2, 49151), "av/ver_1", "t_1", 2
    )
    bare = EngineRequest("r", (5,), SamplingParams())
    assert decode_request(encode_request(bare)) == bare


@pytest.mark.parametrize("spec", [
    StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}},
                                 strict=True, whitespace=Whitespace.COMPACT),
    StructuredOutput.json_object(),
    StructuredOutput.regex(r"[a-z]+\d{2}"),
    StructuredOutput.grammar('start: "a" | "b"'),
    StructuredOutput.choice(["x", "y, z", "é"]),
], ids=lambda s: s.kind.value)
def test_structured_sampling_round_trips(spec: StructuredOutput) -> None:
    request = EngineRequest("r", (5,), SamplingParams(structured=spec, ignore_eos=True))
    back = decode_request(encode_request(request))
    assert back == request
    assert back.sampling.structured == spec
    assert hash(back.sampling.structured) == hash(spec)  # the compiled-grammar cache key
    assert isinstance(back.sampling.structured, StructuredOutput)
    assert type(back.sampling.structured.kind) is OutputKind


def test_a_structured_spec_the_engine_refuses_stays_refused() -> None:
    request = EngineRequest("r", (5,), SamplingParams(structured=StructuredOutput.choice(["a"])))
    body = json.loads(encode_request(request))
    body["request"]["sampling"]["structured"]["value"] = []
    with pytest.raises(ValidationError) as refused:
        decode_request(json.dumps(body))
    assert refusal(refused.value) == "a choice output needs at least one choice"
    body["request"]["sampling"]["structured"] = {"kind": "choice", "value": ["a"], "x": 1}
    with pytest.raises(ValidationError) as unknown:
        decode_request(json.dumps(body))
    assert refusal(unknown.value) is None


def test_sampling_values_the_engine_refuses_stay_refused() -> None:
    body = json.loads(encode_request(REQUEST))
    body["request"]["sampling"]["top_p"] = 0.0
    with pytest.raises(ValueError, match="top_p") as refused:
        decode_request(json.dumps(body))
    assert isinstance(refused.value, ValidationError)
    assert refusal(refused.value) == "top_p must be in (0, 1], got 0.0"
    body["request"]["sampling"]["top_p"] = 1.0
    body["request"]["prompt_token_ids"] = []
    with pytest.raises(ValidationError) as empty:
        decode_request(json.dumps(body))
    assert refusal(empty.value) == "prompt must contain at least one token"
    # A malformed body is no refusal: the worker answers it differently.
    with pytest.raises(ValidationError) as malformed:
        decode_request(b'{"x": 1}')
    assert refusal(malformed.value) is None


@pytest.mark.parametrize(
    "where",
    [(), ("sampling",), ("tenant",)],
    ids=["request", "sampling", "tenant"],
)
def test_unknown_fields_in_a_request_are_refused(where: tuple[str, ...]) -> None:
    body = json.loads(encode_request(REQUEST))
    target = body["request"]
    for key in where:
        target = target[key]
    target["min_p"] = 0.1  # a parameter a newer gateway might send
    with pytest.raises(ValidationError) as refused:
        decode_request(json.dumps(body))
    assert refusal(refused.value) is None


def test_outputs_round_trip_through_lines() -> None:
    out = RequestOutput(
        request_id="r", new_token_ids=[5, 6], new_text="héllo\n", finished=True,
        finish_reason="length", num_prompt_tokens=3, num_output_tokens=9, num_cached_tokens=2,
        new_logprobs=[TokenLogprob(5, -0.25, [(5, -0.25), (9, -1.5)]),
                      TokenLogprob(6, -0.5, [(6, -0.5)])],
        new_token_texts=["hé", "llo\n"],
    )
    line = encode_output(out)
    assert line.endswith(b"\n") and line.count(b"\n") == 1  # one line, newlines escaped
    assert decode_line(line) == out
    plain = RequestOutput("r", [], "", False, None, 3, 0, 0)
    assert decode_line(encode_output(plain)) == plain
    with pytest.raises(ValueError):
        decode_line(line.replace(b'"finished"', b'"extra":1,"finished"'))


def test_errors_round_trip_to_the_engine_exceptions() -> None:
    rejected = WireError.of(RequestRejected("too long", code="context_length_exceeded",
                                            param="messages"))
    decoded = decode_line(encode_error(rejected))
    assert decoded == rejected
    assert isinstance(decoded, WireError)
    exc = decoded.to_exception()
    assert isinstance(exc, RequestRejected)
    assert (str(exc), exc.code, exc.param) == ("too long", "context_length_exceeded", "messages")
    invalid = WireError.of(ValueError("duplicate request id"))
    assert invalid.kind == "invalid"
    assert type(invalid.to_exception()) is ValueError
    crashed = WireError.of(RuntimeError("CUDA error"))
    assert crashed.kind == "engine"
    assert type(crashed.to_exception()) is RuntimeError
    with pytest.raises(ValueError):
        decode_line(b"{}")


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (AdapterError("no such file"), "invalid"),
        (AdapterLoadError("adapter 'x' could not be loaded"), "engine"),
        (EngineStepError("the step failed"), "engine"),
        (EngineDeadError("engine failed: CUDA"), "engine"),
        (EngineUnavailable("starting"), "unavailable"),
        (NoWorkerAvailable("none"), "unavailable"),
        (WorkerLost("w1 died"), "engine"),
    ],
)
def test_engine_errors_come_back_as_their_class(error: EngineError, kind: str) -> None:
    wire = WireError.of(error)
    assert (wire.kind, wire.code) == (kind, error.code)
    decoded = decode_line(encode_error(wire))
    assert isinstance(decoded, WireError)
    back = decoded.to_exception()
    assert type(back) is type(error)
    assert str(back) == str(error)


def test_stats_round_trip_with_the_infinite_bucket() -> None:
    stats = EngineStats(1, 2, 3, 4, 0.25, 5, 6, 7, num_adapters=8, adapter_cache=CACHE,
                        num_structured_requests=9, grammar_compiles=10, grammar_cache_hits=11,
                        grammar_cache_misses=12, grammar_refusals=13, grammar_timeouts=14,
                        grammar_compile_s=1.5)
    body = WorkerStats(model_id="m", max_model_len=64, ready=True, draining=False,
                       stats=stats, residency=[PLACE])
    text = body.model_dump_json()
    json.loads(text)  # strict JSON: no Infinity
    assert "Infinity" not in text
    back = WorkerStats.model_validate_json(text)
    assert back.stats == stats and back.residency == [PLACE]
    assert back.stats.adapter_cache is not None
    assert back.stats.adapter_cache.load_latency.bounds == (0.1, 1.0, float("inf"))
    bare = EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0)
    bare_body = body.model_copy(update={"stats": bare, "residency": []})
    assert WorkerStats.model_validate_json(bare_body.model_dump_json()).stats == bare


def test_a_histogram_needs_a_count_for_the_infinite_bucket() -> None:
    with pytest.raises(ValueError, match="finite"):
        LatencyHistogram((0.1, float("inf")), (1, 2, 2), 0.5, 2)
    with pytest.raises(ValueError, match="one for \\+Inf"):
        LatencyHistogram((0.1, 1.0), (1, 2), 0.5, 2)


def test_adapter_info_and_placement_round_trip() -> None:
    assert decode_adapter_info(encode_adapter_info(INFO)) == INFO
    listed = AdapterList.model_validate_json(AdapterList(adapters=[INFO]).model_dump_json())
    assert listed.adapters == [INFO]
    extra = json.loads(encode_adapter_info(INFO)) | {"merged": True}
    with pytest.raises(ValueError):
        decode_adapter_info(json.dumps(extra))


def test_heartbeats_ignore_fields_they_do_not_know() -> None:
    stats = EngineStats(1, 2, 3, 4, 0.25, 5, 6, 7, adapter_cache=CACHE)
    beat = Heartbeat(
        worker_id="w1", instance="i", seq=3, url="http://w1", device="cpu", mig_profile=None,
        gpu_uuid=None, dedicated_tenants=[], model_id="m", max_model_len=64,
        max_adapter_bytes=1024, ready=True, draining=False, num_running=1, num_waiting=2,
        kv_usage=0.25, adapters_device=[], adapters_host=[], adapters_registered=["av/v1"],
        adapters_preloaded=[INFO], stats=stats, residency=[PLACE], sent_at=1.0,
    )
    assert Heartbeat.model_validate_json(beat.model_dump_json()) == beat
    newer = json.loads(beat.model_dump_json())
    newer["temperature_c"] = 61  # what a newer worker might add, at any depth
    newer["stats"]["num_swapped"] = 0
    newer["residency"][0]["bytes"] = 10
    assert Heartbeat.model_validate(newer) == beat
