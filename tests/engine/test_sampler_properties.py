"""Sampler properties over every value SamplingParams accepts, and logits of any kind.

Whatever a batch mixes (greedy and sampled rows, subnormal, zero, one and huge values,
penalties at float32's edges, NaN and inf logits), every row gets a token id inside the
vocabulary, no exception is raised, logprobs stay finite, and a NaN logit never wins
where a number was there to win.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core import sampler as sampler_module
from engine.core.sampler import MIN_LOGPROB, Sampler
from engine.core.state import Request
from engine.request import GREEDY_TEMPERATURE, SamplingParams

VOCAB = 300  # more than one block of the two-level inverse CDF

SMALL = [5e-324, 1e-300, 1e-50, 1e-38, 1e-30, 1e-8, 1e-6, GREEDY_TEMPERATURE]
temperatures = st.one_of(st.sampled_from([0.0, *SMALL, 1.0, 2.0, 1e30, 1e300]),
                         st.floats(0, 2))
top_ps = st.one_of(st.sampled_from([5e-324, 1e-300, 1e-50, 1e-8, 0.5, 1 - 1e-12, 1.0]),
                   st.floats(0, 1, exclude_min=True))
top_ks = st.one_of(st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 2**62]),
                   st.integers(0, VOCAB * 2))
repetition = st.one_of(st.sampled_from([5e-324, 1e-300, 1e-45, 0.01, 1.0, 100.0, 1e38, 1e300]),
                       st.floats(0, 1e300, exclude_min=True))
penalty = st.one_of(st.sampled_from([-2.0, 0.0, 2.0]), st.floats(-2, 2))
special = st.sampled_from([math.nan, math.inf, -math.inf, 3.4e38, -3.4e38, 0.0, 1e-45])


@st.composite
def params(draw: st.DrawFn) -> SamplingParams:
    return SamplingParams(
        max_tokens=4,
        temperature=draw(temperatures),
        top_p=draw(top_ps),
        top_k=draw(top_ks),
        presence_penalty=draw(penalty),
        frequency_penalty=draw(penalty),
        repetition_penalty=draw(repetition),
        seed=draw(st.none() | st.integers(0, 2**63 - 1)),
        logprobs=draw(st.none() | st.integers(0, 20)),
    )


@st.composite
def rows(draw: st.DrawFn) -> tuple[list[float], list[int]]:
    """One row of logits (normal, then a few special values planted) and a history."""
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([1e-30, 1.0, 30.0, 1e4, 1e30]))
    row = (torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * scale).tolist()
    for _ in range(draw(st.integers(0, 4))):
        row[draw(st.integers(0, VOCAB - 1))] = draw(special)
    if draw(st.booleans()):
        value = draw(special)
        row = [value] * VOCAB  # a whole row of NaN, inf or one value
    history = draw(st.lists(st.integers(0, VOCAB - 1), max_size=12))
    return row, history


def _request(i: int, p: SamplingParams, history: list[int]) -> Request:
    request = Request(f"r{i}", [0, *history[:6]], p)
    request.output_token_ids.extend(history[6:])
    if p.seed is not None:
        request.generator = torch.Generator().manual_seed(p.seed)
    return request


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(params(), rows()), min_size=1, max_size=6), st.integers(1, 256))
def test_every_row_gets_a_valid_token(
    batch: list[tuple[SamplingParams, tuple[list[float], list[int]]]], num_candidates: int
) -> None:
    logits = torch.tensor([row for _, (row, _) in batch], dtype=torch.float32)
    requests = [_request(i, p, history) for i, (p, (_, history)) in enumerate(batch)]
    results = Sampler(num_candidates=num_candidates)(logits.clone(), requests)

    assert len(results) == len(batch)
    for (p, (row, history)), result in zip(batch, results, strict=True):
        assert isinstance(result.token_id, int) and 0 <= result.token_id < VOCAB
        chosen = torch.tensor(row, dtype=torch.float32)[result.token_id]
        has_number = any(not math.isnan(v) for v in row)
        untouched = p.repetition_penalty == 1.0 and (
            not history[6:] or (p.presence_penalty == 0 and p.frequency_penalty == 0)
        )
        if has_number and untouched:
            assert not math.isnan(chosen), "a NaN logit won over a number"
        if p.greedy and untouched and has_number:
            finite_row = torch.tensor(row).nan_to_num(nan=-math.inf, posinf=math.inf,
                                                      neginf=-math.inf)
            assert chosen == finite_row.max(), "greedy did not take the best logit"
        if p.logprobs is None:
            assert result.logprob is None
        else:
            assert result.logprob is not None
            values = [result.logprob.logprob, *(v for _, v in result.logprob.top)]
            assert all(math.isfinite(v) and MIN_LOGPROB <= v <= 0.0 for v in values)
            assert len(result.logprob.top) == min(p.logprobs, VOCAB)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(top_p=top_ps, temperature=st.sampled_from([GREEDY_TEMPERATURE, 1e-3, 1.0, 2.0]))
def test_the_nucleus_always_holds_the_best_token(top_p: float, temperature: float) -> None:
    """top_p below float32's resolution (0.0 once converted) still keeps the best token."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    best = int(logits.argmax())
    p = SamplingParams(temperature=temperature, top_p=top_p, seed=1)
    results = Sampler()(logits, [_request(0, p, [])])
    assert 0 <= results[0].token_id < VOCAB
    if top_p < 1e-30:
        assert results[0].token_id == best


def test_the_requests_that_stopped_the_engine() -> None:
    """The values of the incident: each gives a valid token instead of an IndexError."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    requests = [
        _request(0, SamplingParams(top_p=1e-50), [1, 2, 3]),
        _request(1, SamplingParams(temperature=1e-50), [1, 2, 3]),
        _request(2, SamplingParams(repetition_penalty=1e-300), [int(logits[2].argmax())] * 7),
    ]
    results = Sampler()(logits, requests)
    assert results[0].token_id == int(logits[0].argmax())
    assert results[1].token_id == int(logits[1].argmax())
    assert 0 <= results[2].token_id < VOCAB


def test_nan_and_infinite_parameters_are_refused() -> None:
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        for value in (math.nan, math.inf):
            try:
                SamplingParams(**{name: value})  # type: ignore[arg-type]
            except ValueError as exc:
                assert name in str(exc)
            else:
                raise AssertionError(f"{name}={value} was accepted")


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_greedy_never_picks_a_nan(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's argmax ranks NaN above every number; the plain greedy batch must not, on
    the CPU kernel's path or torch's (CUDA, half precision, no compiler)."""
    if not kernel:
        monkeypatch.setattr(sampler_module.cpu_ops, "available", lambda device, dtype: False)
    elif not sampler_module.cpu_ops.available(torch.device("cpu"), torch.float32):
        pytest.skip("no C compiler for the CPU kernels")
    calls: list[int] = []
    real = sampler_module.cpu_ops.argmax_rows

    def counting(logits: torch.Tensor) -> torch.Tensor:
        calls.append(logits.shape[0])
        return real(logits)

    monkeypatch.setattr(sampler_module.cpu_ops, "argmax_rows", counting)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    logits[0, 17] = math.nan
    logits[1] = math.nan
    greedy = SamplingParams(temperature=0)
    results = Sampler()(logits.clone(), [_request(0, greedy, []), _request(1, greedy, [])])
    assert results[0].token_id == int(logits[0].nan_to_num(nan=-math.inf).argmax())
    assert 0 <= results[1].token_id < VOCAB
    assert calls == ([2] if kernel else [])
