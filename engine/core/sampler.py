"""Next-token selection: penalties, greedy, temperature / top-k / top-p sampling, logprobs.

The order follows the usual Hugging Face / OpenAI semantics:
repetition penalty -> frequency penalty -> presence penalty -> temperature -> top-k -> top-p.

NOTE: whatever the logits hold (NaN or inf from a broken adapter, extreme penalties) and
whatever finite parameters a request passed, every row gets a token id inside the
vocabulary: NaN never wins, +inf counts as the largest float, a row with no finite logit
at all is sampled uniformly, and the nucleus always keeps the best token.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch
from torch import Tensor

from engine.core.state import Request
from engine.request import SamplingParams, TokenLogprob
from loraplex_kernels import cpu_ops


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprob: TokenLogprob | None  # None unless the request asked for logprobs


def _uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


class Sampler:
    """Picks one token per row of a [S, V] logits matrix, row i belonging to requests[i].

    NOTE: a request with a seed owns a `torch.Generator` and each of its sampling steps
    draws exactly one number from it, after batch-independent row-wise math; so a seeded
    request yields the same tokens whatever else shares the batch and at whatever row.
    Sampling is inverse-CDF over the vocabulary in token-id order (one uniform draw per
    row) rather than an exponential race, which would draw V numbers per row.
    """

    def __init__(self, num_candidates: int = 256) -> None:
        # Top-p first looks for the nucleus among this many best tokens and falls back to a
        # full sort only for rows whose nucleus is wider, sparing a [S, V] sort per step.
        if num_candidates < 1:
            raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")
        self.num_candidates = num_candidates

    def __call__(self, logits: Tensor, requests: list[Request]) -> list[SampleResult]:
        assert logits.dim() == 2 and logits.shape[0] == len(requests), (
            f"logits {tuple(logits.shape)} do not match {len(requests)} requests"
        )
        logits = logits.float()
        params = [r.sampling for r in requests]
        penalized = [i for i, p in enumerate(params) if _uses_penalties(p)]
        wants_logprobs = any(p.logprobs is not None for p in params)
        all_greedy = all(p.greedy for p in params)

        if all_greedy and not penalized and not wants_logprobs:
            return [SampleResult(t, None) for t in _argmax(logits).tolist()]

        raw = logits
        if penalized:
            logits = apply_penalties(logits, requests, penalized)

        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if all_greedy:
            token_ids = _argmax(logits)
        elif len(sampled) == len(params):
            token_ids = self._sample(logits, requests)
        else:
            token_ids = _argmax(logits)
            rows = torch.tensor(sampled, device=logits.device)
            token_ids[rows] = self._sample(logits[rows], [requests[i] for i in sampled])
        ids: list[int] = token_ids.tolist()

        logprobs: list[TokenLogprob | None] = [None] * len(params)
        if wants_logprobs:
            logprobs = compute_logprobs(raw, ids, params)
        return [SampleResult(t, lp) for t, lp in zip(ids, logprobs, strict=True)]

    def _sample(self, logits: Tensor, requests: list[Request]) -> Tensor:
        """Samples one token id per row; no request here is greedy."""
        vocab_size = logits.shape[1]
        device = logits.device
        params = [r.sampling for r in requests]
        temps = torch.tensor([p.temperature for p in params], device=device)
        x = logits / temps[:, None]  # [R, V], private: edited in place below
        _make_finite_(x)
        top_ks = [p.top_k if p.top_k < vocab_size else 0 for p in params]
        top_ps = [p.top_p for p in params]
        if any(top_ks) or any(p < 1.0 for p in top_ps):
            probs = self._truncated_probs(x, top_ks, top_ps)
        else:
            probs = torch.softmax(x, dim=-1)
        return _inverse_cdf(probs, _uniform_draws(requests).to(device))

    def _truncated_probs(self, x: Tensor, top_ks: list[int], top_ps: list[float]) -> Tensor:
        """Probabilities of x with each row cut to its top-k, then its top-p tokens.

        Rows with top_k == 0 and top_p == 1 pass through unchanged. Cut tokens get
        probability 0 and the rest are not renormalized (the sampler does not need it).

        NOTE: both cuts are value thresholds, so tokens tied with the last kept one are
        kept too. That keeps the result independent of how a sort orders ties, which the
        per-request seed guarantee relies on.
        """
        vocab_size = x.shape[1]
        device = x.device
        ks = torch.tensor(top_ks, device=device)
        ps = torch.tensor(top_ps, device=device)
        has_p = ps < 1.0
        wants_nucleus = bool(has_p.any())
        wanted = max(max(top_ks), self.num_candidates if wants_nucleus else 1)
        values, ids = x.topk(min(vocab_size, wanted), dim=-1)  # [R, C], best first

        has_k = ks > 0
        if bool(has_k.any()):
            kth = values.gather(1, (ks.clamp(min=1) - 1)[:, None])  # [R, 1]
            kth = torch.where(has_k[:, None], kth, -torch.inf)
            x.masked_fill_(x < kth, -torch.inf)
            positions = torch.arange(values.shape[1], device=device)
            values.masked_fill_(has_k[:, None] & (positions >= ks[:, None]), -torch.inf)
        # NOTE: torch.softmax, not exp by hand: its kernel stays fast where exp of very
        # negative logits would produce subnormal floats, which are slow on the CPU.
        probs = torch.softmax(x, dim=-1)
        if not wants_nucleus:
            return probs

        threshold, complete = _nucleus_threshold(values, probs.gather(1, ids), ps)
        wide = (has_p & ~complete).nonzero().flatten()
        if wide.numel():
            values_wide, ids_wide = x[wide].sort(dim=-1, descending=True)
            probs_wide = probs[wide].gather(1, ids_wide)
            threshold[wide], _ = _nucleus_threshold(values_wide, probs_wide, ps[wide])
        threshold = torch.where(has_p, threshold, -torch.inf)
        return probs.masked_fill_(x < threshold[:, None], 0.0)


def _nucleus_threshold(values: Tensor, probs: Tensor, top_ps: Tensor) -> tuple[Tensor, Tensor]:
    """Smallest logit of each row's nucleus, found among a row's best candidates.

    values: [R, C] logits sorted best first (-inf for candidates already cut); probs:
    [R, C] their probabilities. The nucleus is the shortest run of best tokens whose
    probability sum reaches top_p; the best token always belongs to it. `complete` is
    False where the candidates hold less than top_p, so the nucleus may reach past them.
    """
    probs = probs.masked_fill(values == -torch.inf, 0.0)
    cumulative = probs.cumsum(dim=-1)
    # Mass of the better tokens before each candidate; monotone, so `keep` is a prefix.
    before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
    keep = before < top_ps[:, None]
    # The best token sees an empty prefix, so it is kept unless top_p is 0 in float32 (a
    # top_p below float32's resolution): it is kept then too.
    num_kept = keep.sum(dim=-1).clamp(min=1)
    threshold = values.gather(1, (num_kept - 1)[:, None]).squeeze(1)
    complete = cumulative[:, -1] >= top_ps
    return threshold, complete


def _argmax(logits: Tensor) -> Tensor:
    """Best token id per row of [S, V]; a NaN (which argmax ranks above everything) never
    wins over a number, and a row of NaN only still gets a valid id."""
    if (logits.dim() == 2 and logits.stride(1) == 1 and logits.dtype == torch.float32
            and cpu_ops.available(logits.device, logits.dtype)):
        return cpu_ops.argmax_rows(logits)  # one parallel pass, the same ranking
    ids = logits.argmax(dim=-1)
    nan_rows = logits.gather(1, ids[:, None]).squeeze(1).isnan()
    if bool(nan_rows.any()):
        rows = nan_rows.nonzero().flatten()
        cleaned = logits[rows].nan_to_num(nan=-torch.inf, posinf=torch.inf, neginf=-torch.inf)
        ids[rows] = cleaned.argmax(dim=-1)
    return ids


def _make_finite_(x: Tensor) -> None:
    """In place: NaN -> -inf, +inf -> the largest float; a row with no finite value left
    becomes all zeros (uniform), so that softmax of every row has a positive sum."""
    torch.nan_to_num_(x, nan=-torch.inf, posinf=torch.finfo(x.dtype).max, neginf=-torch.inf)
    x.masked_fill_((x.amax(dim=-1) == -torch.inf)[:, None], 0.0)  # no host sync


# Logprobs are floored here, as OpenAI's API reports them: JSON has no -Infinity.
MIN_LOGPROB = -9999.0

_CDF_BLOCK = 256


def _inverse_cdf(weights: Tensor, draws: Tensor) -> Tensor:
    """Per row, the token where the running sum of weights passes draw * total.

    Two levels: pick the block of _CDF_BLOCK tokens from block sums, then the token inside
    it, so no cumulative sum (or float64 copy) of the whole vocabulary is materialized.
    Sums of a block are float32 (256 terms lose nothing that matters); across blocks and
    inside the chosen one they run in float64.
    weights: [R, V] >= 0 with a positive sum per row; draws: [R] in [0, 1).
    """
    num_rows, vocab_size = weights.shape
    device = weights.device
    num_full = vocab_size // _CDF_BLOCK
    full = weights[:, : num_full * _CDF_BLOCK].view(num_rows, num_full, _CDF_BLOCK)
    block_sums = full.sum(dim=-1).double()  # [R, B]
    if vocab_size % _CDF_BLOCK:
        tail = weights[:, num_full * _CDF_BLOCK :].sum(dim=-1).double()
        block_sums = torch.cat([block_sums, tail[:, None]], dim=-1)
    block_ends = block_sums.cumsum(dim=-1)
    total = block_ends[:, -1]
    # Strictly below the total, so the search can only land where weight is positive.
    target = torch.minimum(draws * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_ends, target[:, None], right=True)  # [R, 1]
    block_starts = torch.cat([torch.zeros_like(block_ends[:, :1]), block_ends], dim=-1)
    residual = target[:, None] - block_starts.gather(1, block)  # >= 0

    positions = block * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=device)  # [R, BLOCK]
    local = weights.gather(1, positions.clamp(max=vocab_size - 1)).double()
    local.masked_fill_(positions >= vocab_size, 0.0)
    local_ends = local.cumsum(dim=-1)
    inside = torch.searchsorted(local_ends, residual, right=True)
    # The block's own sum may round differently from its running sum: never step past
    # its last token with positive weight.
    last = torch.searchsorted(local_ends, local_ends[:, -1:].contiguous(), right=False)
    return (positions[:, :1] + torch.minimum(inside, last)).squeeze(1)


def _uniform_draws(requests: list[Request]) -> Tensor:
    """One float64 in [0, 1) per request: seeded requests from their own generator."""
    draws = torch.empty(len(requests), dtype=torch.float64)
    unseeded = [j for j, r in enumerate(requests) if r.generator is None]
    if unseeded:
        draws[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for j, r in enumerate(requests):
        if r.generator is not None:
            draws[j] = torch.rand(1, dtype=torch.float64, generator=r.generator)[0]
    return draws


def _flat_keys(
    token_lists: list[list[int]], rows: list[int], vocab_size: int, device: torch.device
) -> Tensor:
    """row * V + token for every token of token_lists[j], which belongs to row rows[j]."""
    lengths = torch.tensor([len(t) for t in token_lists], device=device)
    row_of = torch.repeat_interleave(torch.tensor(rows, device=device), lengths)
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    assert tokens.numel() == 0 or int(tokens.max()) < vocab_size, "token id beyond the logits"
    return row_of * vocab_size + tokens


def _per_row(values: dict[int, float], num_rows: int, device: torch.device) -> Tensor:
    out = torch.zeros(num_rows, device=device)
    out[list(values)] = torch.tensor(list(values.values()), device=device)
    return out


def apply_penalties(logits: Tensor, requests: list[Request], rows: list[int]) -> Tensor:
    """Returns a copy of logits with the penalties of requests[rows] applied to those rows.

    Repetition (Hugging Face): a token seen in the prompt or the output has a positive
    logit divided by the penalty and a non-positive one multiplied by it. Frequency and
    presence (OpenAI): minus count-in-output * frequency, then minus presence if it occurs
    in the output at all. Only the logits of tokens in a history are read or written, so
    the cost follows the history length, not the vocabulary size.
    """
    out = logits.clone()
    num_rows, vocab_size = out.shape
    device = out.device
    flat = out.view(-1)

    rep = {i: requests[i].sampling.repetition_penalty for i in rows}
    rep = {i: p for i, p in rep.items() if p != 1.0}
    if rep:
        histories = [requests[i].all_token_ids for i in rep]
        keys = _flat_keys(histories, list(rep), vocab_size, device).unique()
        penalty = _per_row(rep, num_rows, device)[keys // vocab_size]
        x = flat[keys]
        flat[keys] = torch.where(x > 0, x / penalty, x * penalty)

    counted = [
        i
        for i in rows
        if requests[i].output_token_ids
        and (requests[i].sampling.frequency_penalty or requests[i].sampling.presence_penalty)
    ]
    if counted:
        outputs = [requests[i].output_token_ids for i in counted]
        keys, counts = _flat_keys(outputs, counted, vocab_size, device).unique(return_counts=True)
        row_of = keys // vocab_size
        frequency = {i: requests[i].sampling.frequency_penalty for i in counted}
        presence = {i: requests[i].sampling.presence_penalty for i in counted}
        x = flat[keys]
        x = x - counts * _per_row(frequency, num_rows, device)[row_of]
        flat[keys] = x - _per_row(presence, num_rows, device)[row_of]
    return out


def _log_probs(logits: Tensor) -> Tensor:
    """log-softmax of raw logits, as reported: a NaN logit never wins, and every value is
    floored at MIN_LOGPROB (JSON has no -Infinity)."""
    logprobs = torch.log_softmax(logits.nan_to_num(nan=-torch.inf), dim=-1)
    return logprobs.nan_to_num_(nan=MIN_LOGPROB).clamp_(min=MIN_LOGPROB)


def prompt_token_logprobs(logits: Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """For rows of prompt positions: the logprob and rank of the prompt token that follows
    each (`targets`) under the model's distribution, and the top-k alternatives."""
    logprobs = _log_probs(logits)
    index = torch.tensor(targets, device=logits.device)[:, None]
    chosen = logprobs.gather(1, index)
    ranks = (logprobs > chosen).sum(dim=1).add_(1).tolist()
    values: list[list[float]] = [[] for _ in targets]
    ids: list[list[int]] = [[] for _ in targets]
    if k:
        top = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
        values, ids = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprob(token_id=t, logprob=lp, top=list(zip(i, v, strict=True)), rank=r)
        for t, lp, i, v, r in zip(targets, chosen.squeeze(1).tolist(), ids, values, ranks,
                                  strict=True)
    ]


def compute_logprobs(
    logits: Tensor, token_ids: list[int], params: list[SamplingParams]
) -> list[TokenLogprob | None]:
    """Logprobs of the chosen tokens and the best alternatives, for rows that asked.

    NOTE: computed from the model's raw logits, before penalties and temperature, so they
    describe the model's distribution (what OpenAI reports), not the sampling one. The
    rows of structured outputs come masked (engine/core/constrained.py): theirs are those of
    the model's distribution over the tokens the grammar allows.
    """
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return result
    device = logits.device
    index = torch.tensor(rows, device=device)
    logprobs = _log_probs(logits[index])  # [R, V]
    chosen_ids = torch.tensor([token_ids[i] for i in rows], device=device)
    chosen = logprobs.gather(1, chosen_ids[:, None]).squeeze(1).tolist()
    num_top = min(max(params[i].logprobs or 0 for i in rows), logits.shape[1])
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if num_top:
        top = logprobs.topk(num_top, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    for j, i in enumerate(rows):
        k = params[i].logprobs or 0
        top_j = list(zip(top_ids[j][:k], top_values[j][:k], strict=True))
        result[i] = TokenLogprob(token_id=token_ids[i], logprob=chosen[j], top=top_j)
    return result
