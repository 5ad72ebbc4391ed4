"""Sampler: penalties against a plain-Python computation, greedy, truncation, seeds, logprobs."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from engine.core.sampler import Sampler, _inverse_cdf, apply_penalties
from engine.core.state import Request
from tests.utils.factories import make_request


def _req(
    prompt: list[int] | None = None, output: list[int] | None = None, **sampling: Any
) -> Request:
    request = make_request("r", prompt if prompt is not None else [0], **sampling)
    request.output_token_ids.extend(output or [])
    return request


def _expected_penalized(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    repetition: float,
    frequency: float,
    presence: float,
) -> list[float]:
    result = []
    for token, x in enumerate(logits):
        if token in prompt or token in output:
            x = x / repetition if x > 0 else x * repetition
        count = output.count(token)
        x -= count * frequency
        if count:
            x -= presence
        result.append(x)
    return result


# Every value below and every intermediate result is exact in binary floating point.
LOGITS = [
    [2.0, -1.0, 0.5, 3.0, -2.0, 1.25],
    [1.0, 4.0, -0.5, 0.0, 2.5, -3.0],
    [0.25, 0.5, 1.5, -1.5, 2.0, 3.5],
    [-1.0, 2.0, 0.0, 1.0, -4.0, 0.5],
]
CASES = [
    # prompt, output, repetition, frequency, presence
    ([0, 1], [3, 3, 4], 2.0, 0.5, 0.25),
    ([5], [1, 1, 1, 2], 1.0, 0.75, 0.0),
    ([2, 3], [], 1.0, 0.0, 0.0),  # no penalty: the row must stay untouched
    ([0, 4], [3, 2, 2], 0.5, 0.0, 1.5),
]


def test_penalties_match_plain_python() -> None:
    logits = torch.tensor(LOGITS)
    original = logits.clone()
    requests = [
        _req(prompt, output, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
        for prompt, output, rep, freq, pres in CASES
    ]
    penalized = apply_penalties(logits, requests, [0, 1, 3])
    expected = torch.tensor(
        [_expected_penalized(row, *case) for row, case in zip(LOGITS, CASES, strict=True)]
    )
    assert torch.equal(penalized, expected)
    assert torch.equal(logits, original)  # the caller's logits are not modified


def test_greedy_with_penalties_takes_argmax_of_penalized_logits() -> None:
    requests = [
        _req(
            prompt,
            output,
            temperature=0.0,
            repetition_penalty=rep,
            frequency_penalty=freq,
            presence_penalty=pres,
        )
        for prompt, output, rep, freq, pres in CASES
    ]
    results = Sampler()(torch.tensor(LOGITS), requests)
    # Row 0: token 3 falls from 3.0 to 0.25 and token 0 to 1.0, so token 5 (1.25) wins.
    # Row 1: token 1 falls from 4.0 to 1.75, token 4 (2.5) wins. Row 3: token 1 (2.0) stays
    # ahead of token 3 (1.0 boosted to 2.0, then 0.5 after presence).
    assert [r.token_id for r in results] == [5, 4, 5, 1]
    assert all(r.logprob is None for r in results)


def test_empty_batch() -> None:
    assert Sampler()(torch.zeros(0, 50), []) == []


def test_greedy_batch_is_argmax() -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(1))
    requests = [_req(temperature=0.0) for _ in range(16)]
    results = Sampler()(logits, requests)
    assert [r.token_id for r in results] == logits.argmax(dim=-1).tolist()


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    logits = torch.randn(10, 300, generator=torch.Generator().manual_seed(2))
    requests = [_req(temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(10)]
    tokens = [r.token_id for r in Sampler()(logits, requests)]
    argmax = logits.argmax(dim=-1).tolist()
    assert [tokens[i] for i in range(1, 10, 2)] == [argmax[i] for i in range(1, 10, 2)]


@pytest.mark.parametrize("truncation", [{"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 0.5}])
def test_narrowest_truncation_equals_greedy(truncation: dict[str, Any]) -> None:
    logits = torch.randn(32, 2000, generator=torch.Generator().manual_seed(3)) * 3
    requests = [_req(temperature=1.5, seed=i, **truncation) for i in range(32)]
    for sampler in (Sampler(), Sampler(num_candidates=1)):
        tokens = [r.token_id for r in sampler(logits, requests)]
        assert tokens == logits.argmax(dim=-1).tolist()


PROBS = [0.1, 0.2, 0.3, 0.4]


def _frequencies(sampler: Sampler, num_draws: int, **sampling: Any) -> list[float]:
    torch.manual_seed(1234)
    logits = torch.tensor(PROBS).log().expand(num_draws, 4).contiguous()
    requests = [_req(**sampling) for _ in range(num_draws)]
    tokens = [r.token_id for r in sampler(logits, requests)]
    return [tokens.count(t) / num_draws for t in range(4)]


def _normalized(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


@pytest.mark.parametrize("num_candidates", [1024, 1])
@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        ({"temperature": 1.0}, PROBS),
        ({"temperature": 2.0}, _normalized([math.sqrt(p) for p in PROBS])),
        ({"temperature": 0.5}, _normalized([p * p for p in PROBS])),
        ({"temperature": 1.0, "top_k": 2}, [0.0, 0.0, 3 / 7, 4 / 7]),
        # 0.4 < 0.65, then 0.4 + 0.3 reaches it: tokens 3 and 2 form the nucleus.
        ({"temperature": 1.0, "top_p": 0.65}, [0.0, 0.0, 3 / 7, 4 / 7]),
        ({"temperature": 1.0, "top_p": 0.35}, [0.0, 0.0, 0.0, 1.0]),
        # top-k first (tokens 1..3, renormalized to 2/9, 3/9, 4/9), then top-p over those.
        ({"temperature": 1.0, "top_k": 3, "top_p": 0.5}, [0.0, 0.0, 3 / 7, 4 / 7]),
    ],
)
def test_sampling_frequencies(
    num_candidates: int, sampling: dict[str, Any], expected: list[float]
) -> None:
    frequencies = _frequencies(Sampler(num_candidates), 20_000, **sampling)
    for got, want in zip(frequencies, expected, strict=True):
        if want == 0.0:
            assert got == 0.0
        else:
            assert abs(got - want) < 0.015, (frequencies, expected)


def test_sampled_tokens_stay_inside_top_k_and_top_p() -> None:
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(4)) * 2
    top_k = [_req(temperature=1.0, top_k=5) for _ in range(64)]
    tokens = [r.token_id for r in Sampler()(logits, top_k)]
    allowed = logits.topk(5, dim=-1).indices.tolist()
    assert all(t in allowed[i] for i, t in enumerate(tokens))

    top_p = [_req(temperature=1.0, top_p=0.5) for _ in range(64)]
    tokens = [r.token_id for r in Sampler()(logits, top_p)]
    probs = torch.softmax(logits, dim=-1)
    for i, token in enumerate(tokens):
        # Mass of the tokens strictly better than the sampled one is below top_p.
        better = probs[i][probs[i] > probs[i, token]].sum().item()
        assert better < 0.5


def _run_seeded(
    position: int, num_rows: int, seed: int, target_logits: torch.Tensor, noise_seed: int
) -> list[int]:
    """Samples 12 steps of one seeded request placed at `position` among random others."""
    noise = torch.Generator().manual_seed(noise_seed)
    vocab = target_logits.shape[1]
    target = _req(
        [7, 8, 9], temperature=0.9, top_k=200, top_p=0.95, repetition_penalty=1.3, seed=seed
    )
    tokens = []
    sampler = Sampler(num_candidates=64)
    for step in range(target_logits.shape[0]):
        others = [
            _req(temperature=float(torch.rand(1, generator=noise)) * 2, top_p=0.9),
            _req(temperature=0.0, logprobs=2),
            _req(temperature=1.0, seed=int(torch.randint(1000, (1,), generator=noise))),
            _req([1, 2], [3], temperature=1.2, top_k=10, frequency_penalty=0.5),
        ]
        batch = [others[i % len(others)] for i in range(num_rows - 1)]
        batch.insert(position, target)
        logits = torch.randn(num_rows, vocab, generator=noise) * 3
        logits[position] = target_logits[step]
        token = sampler(logits, batch)[position].token_id
        target.output_token_ids.append(token)
        tokens.append(token)
    return tokens


def test_seeded_request_is_independent_of_batch_and_row() -> None:
    target_logits = torch.randn(12, 3000, generator=torch.Generator().manual_seed(5)) * 2
    alone = _run_seeded(0, 1, 42, target_logits, noise_seed=10)
    first = _run_seeded(0, 3, 42, target_logits, noise_seed=11)
    middle = _run_seeded(5, 9, 42, target_logits, noise_seed=12)
    last = _run_seeded(30, 31, 42, target_logits, noise_seed=13)
    assert alone == first == middle == last
    assert len(set(alone)) > 6  # genuinely random draws, not one repeated token
    assert _run_seeded(0, 3, 43, target_logits, noise_seed=11) != alone


def test_seeded_tokens_do_not_depend_on_the_candidate_count() -> None:
    logits = torch.randn(24, 2000, generator=torch.Generator().manual_seed(6))
    results = []
    for num_candidates in (1, 16, 2000):
        requests = [_req(temperature=1.0, top_p=0.9, seed=100 + i) for i in range(24)]
        results.append([r.token_id for r in Sampler(num_candidates)(logits, requests)])
    assert results[0] == results[1] == results[2]


def test_logprobs_come_from_raw_logits() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(7)) * 2
    requests = [
        _req(
            [1, 2, 3],
            [4, 4],
            temperature=0.7,
            repetition_penalty=1.5,
            frequency_penalty=0.3,
            logprobs=3,
            seed=1,
        ),
        _req(temperature=0.0, logprobs=0),
        _req(temperature=1.0, seed=2),
        _req(temperature=0.0, logprobs=5),
    ]
    results = Sampler()(logits, requests)
    reference = torch.log_softmax(logits, dim=-1)

    for i, k in ((0, 3), (1, 0), (3, 5)):
        result = results[i]
        assert result.logprob is not None
        assert result.logprob.token_id == result.token_id
        assert result.logprob.logprob == pytest.approx(
            reference[i, result.token_id].item(), abs=1e-6
        )
        top = reference[i].topk(k) if k else None
        assert [t for t, _ in result.logprob.top] == ([] if top is None else top.indices.tolist())
        if top is not None:
            assert [v for _, v in result.logprob.top] == pytest.approx(
                top.values.tolist(), abs=1e-6
            )
    assert results[2].logprob is None
    assert results[1].token_id == logits[1].argmax().item()
    top3 = results[3].logprob
    assert top3 is not None and top3.top[0][0] == results[3].token_id  # greedy: the best one


@pytest.mark.parametrize("seed", range(8))
def test_inverse_cdf_lands_only_on_positive_weights(seed: int) -> None:
    weights = torch.rand(4, 600, generator=torch.Generator().manual_seed(seed))
    weights[:, :3] = 0.0
    weights[:, 246:] = 0.0  # the last 10 tokens of the first block and everything after
    # Extreme draws: the smallest and the largest below 1, where rounding of the block
    # sums could otherwise push the search onto a token of weight 0.
    draws = torch.tensor([0.0, 1.0 - 2.0**-53, 0.5, 1.0 - 2.0**-30], dtype=torch.float64)
    tokens = _inverse_cdf(weights, draws).tolist()
    assert tokens[0] == 3 and tokens[1] == 245
    assert all(3 <= t <= 245 for t in tokens)
