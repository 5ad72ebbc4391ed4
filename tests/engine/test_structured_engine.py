"""Structured outputs in the engine, on a tiny random model with the real SmolLM2 tokenizer
and real PEFT adapters: every output that finishes follows its spec, free rows sharing the
steps are untouched, refusals come at admission."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core.constrained import ConstrainedDecoding
from engine.core.engine_core import EngineCore
from engine.core.sampler import MIN_LOGPROB, Sampler, SampleResult
from engine.core.state import Request, SchedulerOutput
from engine.errors import EngineStepError
from engine.request import EngineRequest, SamplingParams
from engine.structured import (
    GRAMMAR_TOO_COMPLEX,
    INVALID_GRAMMAR,
    CompiledGrammar,
    StructuredOutput,
    StructuredOutputError,
    Whitespace,
)
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.tiny_models import random_prompt

# Bounded documents, so that a random model finishes them well within max_tokens.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "inner": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["n"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "ok", "tags", "inner"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,6}-[0-9]{2}"
CHOICES = ("red", "green", "blue")
GRAMMAR = 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[a-z]{2,5}/'

SPECS: dict[str, StructuredOutput] = {
    "json_schema": StructuredOutput.json_schema(SCHEMA, strict=True,
                                                whitespace=Whitespace.COMPACT),
    "regex": StructuredOutput.regex(REGEX),
    "choice": StructuredOutput.choice(CHOICES),
    "grammar": StructuredOutput.grammar(GRAMMAR),
}
MAX_TOKENS = 96


def follows(kind: str, text: str) -> bool:
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    assert kind == "grammar"
    return re.fullmatch(r"(hello|hi) [a-z]{2,5}", text) is not None


@pytest.fixture(scope="module")
def tiny(tiny_model_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[Path, dict[str, Path]]:
    base = tiny_model_factory("llama_gqa")
    root = tmp_path_factory.mktemp("structured_adapters")
    adapters = {
        "qv": make_peft_adapter(base, root / "qv", r=4, alpha=8, seed=21),
        "mlp": make_peft_adapter(base, root / "mlp", r=8, alpha=8,
                                 targets=("gate_proj", "up_proj", "down_proj"), seed=22),
    }
    return base, adapters


@pytest.fixture(scope="module")
def engine(tiny: tuple[Path, dict[str, Path]]) -> Iterator[AsyncEngine]:
    base, adapters = tiny
    eng = AsyncEngine(EngineConfig(model=str(base), max_loras=2))
    eng.start_sync()
    for name, path in adapters.items():
        eng.core.add_adapter(name, path)
    yield eng
    asyncio.run(eng.shutdown())


def make_core(base: Path, adapters: dict[str, Path], **overrides: Any) -> EngineCore:
    core = EngineCore(EngineConfig(model=str(base), max_loras=2,
                                   enable_prefix_caching=False, **overrides))
    for name, path in adapters.items():
        core.add_adapter(name, path)
    return core


def request(rid: str, spec: StructuredOutput | None, *, prompt_seed: int = 0,
            adapter: str | None = None, **sampling: Any) -> EngineRequest:
    sampling.setdefault("max_tokens", MAX_TOKENS)
    sampling.setdefault("temperature", 0)
    return EngineRequest(rid, tuple(random_prompt(6, seed=prompt_seed)),
                         SamplingParams(structured=spec, **sampling), adapter=adapter)


async def stream(engine: AsyncEngine, req: EngineRequest) -> dict[str, Any]:
    """The streamed deltas of one request, joined."""
    text, tokens, logprobs, reason = "", [], [], None
    async for out in engine.generate(req):
        text += out.new_text
        tokens += out.new_token_ids
        logprobs += out.new_logprobs
        reason = out.finish_reason
    return {"text": text, "tokens": tokens, "logprobs": logprobs, "reason": reason}


def run_core(core: EngineCore, requests: list[EngineRequest]) -> dict[str, dict[str, Any]]:
    got: dict[str, dict[str, Any]] = {
        r.request_id: {"text": "", "tokens": [], "reason": None} for r in requests}
    for r in requests:
        core.add_request(r)
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        result = core.step()
        if result.idle:
            time.sleep(0.01)
        for rid, error in result.failures.items():
            got[rid]["error"] = error
        for out in result.outputs:
            got[out.request_id]["text"] += out.new_text
            got[out.request_id]["tokens"] += out.new_token_ids
            got[out.request_id]["reason"] = out.finish_reason
    assert not core.has_unfinished_requests(), "engine did not finish"
    return got


# ----------------------------------------------------------------- through AsyncEngine


@pytest.mark.parametrize("kind", list(SPECS))
async def test_outputs_follow_their_spec(engine: AsyncEngine, kind: str) -> None:
    """Greedy and seeded sampling, on the base model and on adapters, streamed: every
    output finishes with "stop" and follows the spec; a seed reproduces its output."""
    spec = SPECS[kind]
    reqs = [
        request(f"{kind}-greedy-{i}", spec, prompt_seed=i, adapter=adapter)
        for i, adapter in enumerate([None, "qv", "mlp"])
    ] + [
        request(f"{kind}-seed-{i}-{run}", spec, prompt_seed=i, temperature=1.0, top_p=0.9,
                seed=100 + i, adapter="qv" if i else None)
        for i in range(3) for run in range(2)
    ]
    outs = dict(zip([r.request_id for r in reqs],
                    await asyncio.gather(*(stream(engine, r) for r in reqs)), strict=True))
    for rid, out in outs.items():
        assert out["reason"] == "stop", (rid, out)
        assert follows(kind, out["text"]), (rid, out["text"])
    for i in range(3):
        assert outs[f"{kind}-seed-{i}-0"] == outs[f"{kind}-seed-{i}-1"]


async def test_json_object(engine: AsyncEngine) -> None:
    spec = StructuredOutput.json_object(whitespace=Whitespace.COMPACT)
    reqs = [request(f"obj-{i}", spec, prompt_seed=i, temperature=1.0 if i % 2 else 0,
                    seed=i, max_tokens=48) for i in range(6)]
    outs = await asyncio.gather(*(stream(engine, r) for r in reqs))
    stopped = [o for o in outs if o["reason"] == "stop"]
    assert stopped, outs
    for out in stopped:
        assert follows("json_object", out["text"]), out["text"]
    for out in outs:  # cut by length: still a prefix of an object
        assert out["text"].startswith("{")


async def test_choices_share_one_compile_not_a_matcher(engine: AsyncEngine) -> None:
    """n choices of one API request: one compile, each its own matcher and output."""
    spec = StructuredOutput.regex(r"(yes|no|maybe)-[0-9]{3}")  # not compiled before
    before = engine.stats()
    reqs = [request(f"n-{i}", spec, temperature=1.0, seed=7 + i) for i in range(4)]
    outs = await asyncio.gather(*(stream(engine, r) for r in reqs))
    for out in outs:
        assert out["reason"] == "stop"
        assert re.fullmatch(r"(yes|no|maybe)-[0-9]{3}", out["text"]), out["text"]
    assert len({o["text"] for o in outs}) > 1  # independent matchers, independent draws
    after = engine.stats()
    assert after.grammar_compiles == before.grammar_compiles + 1
    assert after.grammar_cache_misses + after.grammar_cache_hits == (
        before.grammar_cache_misses + before.grammar_cache_hits + 4)
    assert after.num_structured_requests == before.num_structured_requests + 4
    assert after.grammar_compile_s > 0


async def test_logprobs_are_those_of_the_masked_distribution(engine: AsyncEngine) -> None:
    spec = SPECS["choice"]
    free, constrained = await asyncio.gather(
        stream(engine, request("lp-free", None, max_tokens=3, logprobs=5)),
        stream(engine, request("lp-choice", spec, logprobs=5)),
    )
    assert constrained["reason"] == "stop" and constrained["text"] in CHOICES
    first = constrained["logprobs"][0]
    allowed = [(t, lp) for t, lp in first.top if lp > MIN_LOGPROB]
    assert allowed and first.logprob > MIN_LOGPROB
    for token_id, _ in allowed:
        text = engine.token_text(token_id)
        assert any(c.startswith(text) for c in CHOICES), text
    # The masked distribution sums to 1 over the allowed tokens: the best of them has a
    # far larger probability than it has among the whole vocabulary.
    assert math.exp(allowed[0][1]) > 0.05
    assert len([lp for _, lp in free["logprobs"][0].top if lp > MIN_LOGPROB]) == 5


async def test_stop_string_cuts_a_constrained_output(engine: AsyncEngine) -> None:
    out = await stream(engine, request("stop", SPECS["regex"], stop=["-"]))
    assert out["reason"] == "stop"
    assert re.fullmatch(r"[a-z]{1,6}", out["text"]), out["text"]


async def test_a_complete_grammar_ends_a_request_that_ignores_eos(engine: AsyncEngine) -> None:
    out = await stream(engine, request("ignore-eos", SPECS["choice"], ignore_eos=True,
                                       max_tokens=60))
    assert out["reason"] == "stop" and out["text"] in CHOICES
    assert len(out["tokens"]) < 10


HOSTILE = [
    (StructuredOutput.regex("a" * 5000), GRAMMAR_TOO_COMPLEX),
    (StructuredOutput.regex("(unclosed"), INVALID_GRAMMAR),
    (StructuredOutput.json_schema("[" * 100 + "]" * 100), GRAMMAR_TOO_COMPLEX),
    (StructuredOutput.json_schema({"type": "object", "properties": {"a": {"$ref": "#/x"}}}),
     INVALID_GRAMMAR),
]


@pytest.mark.parametrize(("spec", "code"), HOSTILE)
async def test_hostile_spec_is_refused_at_admission(engine: AsyncEngine,
                                                    spec: StructuredOutput, code: str) -> None:
    free = request("bystander", None, max_tokens=12, ignore_eos=True)
    alone = await stream(engine, free)
    before = engine.stats()
    with pytest.raises(StructuredOutputError) as checked:
        await asyncio.to_thread(engine.check_structured_output, spec)
    assert checked.value.code == code

    async def hostile() -> None:
        async for _ in engine.generate(request("hostile", spec)):
            raise AssertionError("a refused request streamed an output")

    results = await asyncio.gather(hostile(), stream(engine, request(
        "bystander-2", None, max_tokens=12, ignore_eos=True)), return_exceptions=True)
    assert isinstance(results[0], StructuredOutputError) and results[0].code == code
    assert results[1] == alone
    after = engine.stats()
    assert after.num_structured_requests == before.num_structured_requests
    assert after.grammar_refusals >= 1 and after.num_waiting == 0


async def test_engine_client_surface(engine: AsyncEngine) -> None:
    assert engine.vocab_size == engine.core.runner.vocab_size
    # Valid: cached by the check, so admission is a cache hit.
    engine.check_structured_output(StructuredOutput.regex("[0-9]{4}"))
    hits = engine.stats().grammar_cache_hits
    out = await stream(engine, request("checked", StructuredOutput.regex("[0-9]{4}")))
    assert re.fullmatch("[0-9]{4}", out["text"])
    assert engine.stats().grammar_cache_hits == hits + 1
    messages = [{"role": "user", "content": "hi"}]
    assert engine.apply_chat_template(messages, tools=None) == engine.apply_chat_template(
        messages)
    assert engine.chat_template_has_tools is False  # SmolLM2's template shows no tools


# ----------------------------------------------------------------- the engine core


def constrained_and_free(adapters: list[str | None]) -> tuple[list[EngineRequest],
                                                                 list[EngineRequest]]:
    free = [request(f"free-{i}-{a}", None, prompt_seed=10 + i, adapter=a, max_tokens=10,
                    ignore_eos=True)
            for i in range(2) for a in adapters]
    constrained = [
        request(f"c-{kind}-{a}", spec, prompt_seed=20 + j, adapter=a,
                temperature=1.0 if j % 2 else 0, seed=j)
        for j, (kind, spec) in enumerate(SPECS.items()) for a in adapters
    ]
    return free, constrained


class RecordingSampler(Sampler):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[Request]] = []

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampleResult]:
        self.batches.append(list(requests))
        return super().__call__(logits, requests)


def test_mixed_steps_leave_free_rows_exactly_as_alone(tiny: tuple[Path, dict[str, Path]]
                                                      ) -> None:
    """The acceptance test: constrained and free rows of several adapters share steps;
    the free rows' greedy tokens are those they get without the constrained rows."""
    base, adapters = tiny
    names: list[str | None] = [None, "qv", "mlp"]
    free, constrained = constrained_and_free(names)
    alone = run_core(make_core(base, adapters), free)

    core = make_core(base, adapters)
    sampler = core.sampler = RecordingSampler()
    mixed = run_core(core, free + constrained)
    for r in free:
        assert mixed[r.request_id]["tokens"] == alone[r.request_id]["tokens"], r.request_id
    for r in constrained:
        kind = r.request_id.split("-")[1]
        assert mixed[r.request_id]["reason"] == "stop", r.request_id
        assert follows(kind, mixed[r.request_id]["text"]), mixed[r.request_id]
    # The steps really were mixed: free and constrained rows of every adapter together.
    shared = [b for b in sampler.batches
              if {r.adapter_id for r in b if r.matcher is None} == set(names)
              and {r.adapter_id for r in b if r.matcher is not None} == set(names)]
    assert shared
    assert not core.constrained.live


def test_the_mixed_step_test_catches_a_mask_on_the_wrong_row(
        tiny: tuple[Path, dict[str, Path]], monkeypatch: pytest.MonkeyPatch) -> None:
    """What the acceptance test guards against: masks applied one row off reach the free
    rows, and their tokens change."""
    base, adapters = tiny
    free, constrained = constrained_and_free([None])
    alone = run_core(make_core(base, adapters), free)
    core = make_core(base, adapters)
    # Free rows come first in a step (decodes, then prefills): one row up is a free row.
    apply = core.constrained.masker.apply

    def off_by_one(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        apply(logits, [(r - 1) % logits.shape[0] for r in rows], bitmask)

    monkeypatch.setattr(core.constrained.masker, "apply", off_by_one)
    mixed = run_core(core, free + constrained)
    assert any(mixed[r.request_id]["tokens"] != alone[r.request_id]["tokens"] for r in free)


def test_masks_write_constrained_rows_only(tiny: tuple[Path, dict[str, Path]]) -> None:
    base, _ = tiny
    core = make_core(base, {})
    decoding: ConstrainedDecoding = core.constrained
    states = [Request.of(request(f"m{i}", spec if i % 2 else None))
              for i, spec in enumerate([None, SPECS["regex"], None, SPECS["choice"], None])]
    for state in states:
        decoding.bind(state)
    vocab = core.runner.vocab_size
    logits = torch.randn(len(states), vocab, generator=torch.Generator().manual_seed(0))
    logits[0, 5] = float("nan")
    logits[2, 7] = float("inf")
    before = logits.clone()
    assert decoding.mask(logits, states) == []
    for i, state in enumerate(states):
        if state.matcher is None:  # bit for bit, NaN and inf included
            assert torch.equal(logits[i].view(torch.int32), before[i].view(torch.int32))
        else:
            allowed = logits[i] > float("-inf")
            assert 0 < int(allowed.sum()) < vocab
            assert torch.equal(logits[i][allowed], before[i][allowed])
            texts = [core.token_text(t) for t in allowed.nonzero().flatten().tolist()]
            if state.request_id == "m3":
                assert all(any(c.startswith(t) for c in CHOICES) for t in texts), texts


def test_steps_without_constrained_rows_do_no_mask_work(
        tiny: tuple[Path, dict[str, Path]], monkeypatch: pytest.MonkeyPatch) -> None:
    base, adapters = tiny
    core = make_core(base, adapters)

    def fail(*args: object) -> None:
        raise AssertionError("masked a step without constrained rows")

    monkeypatch.setattr(ConstrainedDecoding, "mask", fail)
    monkeypatch.setattr(ConstrainedDecoding, "advance", fail)
    got = run_core(core, [request("f", None, max_tokens=4, adapter="qv")])
    assert len(got["f"]["tokens"]) == 4


def test_a_refused_token_fails_that_request_alone(tiny: tuple[Path, dict[str, Path]]) -> None:
    base, adapters = tiny
    core = make_core(base, adapters)
    eos = core.tokenizer.eos_token_id

    class Rogue(Sampler):
        """Samples EOS for the victim: its regex needs a letter first."""

        def __call__(self, logits: torch.Tensor, requests: list[Request]
                     ) -> list[SampleResult]:
            results = super().__call__(logits, requests)
            return [SampleResult(eos, None) if r.request_id == "victim" else res
                    for r, res in zip(requests, results, strict=True)]

    core.sampler = Rogue()
    got = run_core(core, [request("victim", SPECS["regex"]),
                          request("other", SPECS["choice"]),
                          request("free", None, max_tokens=5, ignore_eos=True)])
    assert isinstance(got["victim"]["error"], EngineStepError)
    assert "does not follow the structured output" in str(got["victim"]["error"])
    assert got["victim"]["tokens"] == []
    assert got["other"]["reason"] == "stop" and got["other"]["text"] in CHOICES
    assert len(got["free"]["tokens"]) == 5
    assert core.consecutive_failures == 0 and not core.constrained.live


def test_sampling_one_by_one_after_a_failure_still_masks(
        tiny: tuple[Path, dict[str, Path]]) -> None:
    base, adapters = tiny
    core = make_core(base, adapters)

    class FailsBatched(Sampler):
        def __call__(self, logits: torch.Tensor, requests: list[Request]
                     ) -> list[SampleResult]:
            if len(requests) > 1:
                raise RuntimeError("batched sampling failed")
            return super().__call__(logits, requests)

    core.sampler = FailsBatched()
    reqs = [request(f"iso-{kind}", spec, adapter="mlp") for kind, spec in SPECS.items()]
    got = run_core(core, [*reqs, request("iso-free", None, max_tokens=6)])
    assert core.num_step_failures > 0
    for r in reqs:
        kind = r.request_id.removeprefix("iso-")
        assert got[r.request_id]["reason"] == "stop", got[r.request_id]
        assert follows(kind, got[r.request_id]["text"])


def test_a_forward_run_one_by_one_still_masks(tiny: tuple[Path, dict[str, Path]]) -> None:
    base, adapters = tiny
    core = make_core(base, adapters)
    execute = core._execute

    def fails_batched(scheduled: SchedulerOutput, slots: Any) -> torch.Tensor:
        if len(scheduled.chunks) > 1:
            raise RuntimeError("batched forward failed")
        return execute(scheduled, slots)

    core._execute = fails_batched
    reqs = [request(f"fwd-{kind}", spec, adapter="qv") for kind, spec in SPECS.items()]
    got = run_core(core, [*reqs, request("fwd-free", None, max_tokens=6)])
    assert core.num_step_failures > 0
    for r in reqs:
        assert got[r.request_id]["reason"] == "stop", got[r.request_id]
        assert follows(r.request_id.removeprefix("fwd-"), got[r.request_id]["text"])


def test_preemption_never_feeds_a_matcher_twice(tiny: tuple[Path, dict[str, Path]]) -> None:
    """Requests preempted and recomputed keep their matcher where their output stands."""
    base, adapters = tiny
    core = make_core(base, adapters, kv_cache_tokens=128, max_num_batched_tokens=64)
    reqs = [EngineRequest(f"p{i}", tuple(random_prompt(16, seed=i)),
                          SamplingParams(max_tokens=64, temperature=0,
                                         structured=SPECS["json_schema"]))
            for i in range(6)]
    states: list[Request] = []
    add = core.add_request

    def keep(req: EngineRequest, grammar: CompiledGrammar | None = None) -> Request:
        states.append(add(req, grammar))
        return states[-1]

    setattr(core, "add_request", keep)  # noqa: B010 (an instance attribute shadows it)
    got = run_core(core, reqs)
    assert core.scheduler.num_preemptions > 0
    for state in states:
        assert state.matcher is not None
        assert state.matcher.num_tokens == state.num_output_tokens
        assert got[state.request_id]["reason"] == "stop"
        assert follows("json_schema", got[state.request_id]["text"])


def test_core_compiles_what_it_is_not_handed(tiny: tuple[Path, dict[str, Path]]) -> None:
    base, _ = tiny
    core = make_core(base, {})
    with pytest.raises(StructuredOutputError) as info:
        core.add_request(request("bad", StructuredOutput.regex("(")))
    assert info.value.code == INVALID_GRAMMAR
    assert not core.has_unfinished_requests() and not core.constrained.live
    state = core.add_request(request("good", SPECS["choice"]))
    assert state.matcher is not None and core.constrained.num_admitted == 1
    with pytest.raises(ValueError, match="duplicate"):
        core.add_request(request("good", SPECS["choice"]))
    assert core.constrained.live == {"good": state}
    core.abort_request("good")
    assert not core.constrained.live


async def test_metrics_export_the_structured_counters(engine: AsyncEngine) -> None:
    from app.metrics import Metrics

    for i in range(2):  # a compile, then a cache hit
        await stream(engine, request(f"metrics-{i}", SPECS["choice"]))
    stats = engine.stats()
    text = Metrics(engine).render().decode()
    samples = {line.split(" ")[0]: float(line.split(" ")[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    assert samples["loraplex_structured_requests_total"] == stats.num_structured_requests > 0
    assert samples["loraplex_grammar_compiles_total"] == stats.grammar_compiles > 0
    assert samples["loraplex_grammar_cache_hits_total"] == stats.grammar_cache_hits > 0
    assert samples["loraplex_grammar_cache_misses_total"] == stats.grammar_cache_misses
    assert samples["loraplex_grammar_refusals_total"] == stats.grammar_refusals
    assert samples["loraplex_grammar_compile_timeouts_total"] == stats.grammar_timeouts
    assert samples["loraplex_grammar_compile_seconds_total"] == pytest.approx(
        stats.grammar_compile_s)
