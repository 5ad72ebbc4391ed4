"""The wire format: every engine type survives JSON unchanged, and stays in step with the
dataclasses it carries."""

from __future__ import annotations

import dataclasses
import json

import pytest
from pydantic import BaseModel

from engine.client import AdapterInfo, AdapterPlacement, EngineStats, RequestRejected
from engine.lora.cache import AdapterCacheStats, LatencyHistogram
from engine.remote.protocol import (
    AdapterCacheWire,
    AdapterInfoWire,
    GenerateRequest,
    OutputWire,
    PlacementWire,
    SamplingWire,
    StatsWire,
    TenantWire,
    WireError,
    decode_line,
    encode_error,
    encode_output,
)
from engine.request import RequestOutput, SamplingParams, TenantContext, TokenLogprob


@pytest.mark.parametrize(
    ("wire", "dataclass"),
    [
        (SamplingWire, SamplingParams),
        (TenantWire, TenantContext),
        (OutputWire, RequestOutput),
        (AdapterInfoWire, AdapterInfo),
        (StatsWire, EngineStats),
        (AdapterCacheWire, AdapterCacheStats),
        (PlacementWire, AdapterPlacement),
    ],
)
def test_wire_models_have_the_fields_of_their_dataclass(
    wire: type[BaseModel], dataclass: type
) -> None:
    assert list(wire.model_fields) == [f.name for f in dataclasses.fields(dataclass)]


def test_generate_request_round_trip() -> None:
    sampling = SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, presence_penalty=0.1,
        frequency_penalty=-0.2, repetition_penalty=1.1, seed=2**62, stop=["\n\n", "END"],
        stop_token_ids=[2, 7], ignore_eos=True, logprobs=3,
    )
    tenant = TenantContext("t_1", weight=2.5, max_running=4, max_kv_fraction=0.5,
                           max_tokens=100, max_context_tokens=2048)
    request = GenerateRequest(
        request_id="chatcmpl-1-0", prompt_token_ids=[1, 2, 49151],
        sampling=SamplingWire.of(sampling), adapter_id="av/ver_1", salt="t_1", priority=2,
        tenant=TenantWire.of(tenant),
    )
    back = GenerateRequest.model_validate_json(request.model_dump_json())
    assert back.sampling.to_params() == sampling
    assert back.tenant is not None and back.tenant.to_context() == tenant
    assert (back.request_id, back.prompt_token_ids, back.adapter_id, back.salt, back.priority) == (
        "chatcmpl-1-0", [1, 2, 49151], "av/ver_1", "t_1", 2
    )


def test_sampling_values_the_engine_refuses_stay_refused() -> None:
    wire = SamplingWire.of(SamplingParams())
    bad = SamplingWire.model_validate({**wire.model_dump(), "top_p": 0.0})
    with pytest.raises(ValueError, match="top_p"):
        bad.to_params()


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


def test_stats_round_trip_with_the_infinite_bucket() -> None:
    cache = AdapterCacheStats(
        device_hits=1, device_misses=2, loads=3, load_failures=4, device_evictions=5,
        host_evictions=6, num_device=7, num_host=8, num_loading=9, num_queued=10,
        load_latency=LatencyHistogram((0.1, 1.0, float("inf")), (1, 3, 4), 2.5, 4),
        device_slots=11, host_capacity=12,
    )
    stats = EngineStats(1, 2, 3, 4, 0.25, 5, 6, 7, num_adapters=8, adapter_cache=cache)
    text = StatsWire.of(stats).model_dump_json()
    json.loads(text)  # strict JSON: no Infinity
    assert "Infinity" not in text
    assert StatsWire.model_validate_json(text).to_stats() == stats
    bare = EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0)
    assert StatsWire.model_validate_json(StatsWire.of(bare).model_dump_json()).to_stats() == bare


def test_adapter_info_and_placement_round_trip() -> None:
    info = AdapterInfo("av/v1", "av/v1#3", "/data/adapters/abc", 8, 16.0, True,
                       ("q_proj", "v_proj"), 4096, 1_700_000_000)
    wire = AdapterInfoWire.model_validate_json(AdapterInfoWire.of(info).model_dump_json())
    assert wire.to_info() == info
    place = AdapterPlacement("av/v1", 2, True, False, 3, 1)
    wire_place = PlacementWire.model_validate_json(PlacementWire.of(place).model_dump_json())
    assert wire_place.to_placement() == place
