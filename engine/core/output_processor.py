"""From sampled tokens to what callers see: text per request, when it stops, and the
`RequestOutput` of each step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.sampler import SampleResult
from engine.core.state import Request, RequestStatus
from engine.request import RequestOutput, TokenLogprob

log = logging.getLogger("loraplex.engine")


@dataclass(slots=True)
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer


class OutputProcessor:
    """Tracks the live requests of an engine. A request stops on an EOS token (unless it
    ignores EOS), one of its stop token ids or stop strings, or when its structured output
    is complete (its grammar allows nothing more, whether it ignores EOS or not); it ends
    by length at its max_tokens or the model's context."""

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        finish: Callable[[Request, RequestStatus], None],
    ) -> None:
        """eos_token_ids: the model's (the tokenizer's own is added); finish: ends a request
        in the engine (frees what it holds) once it stopped."""
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.max_model_len = max_model_len
        self._finish = finish
        self._tracked: dict[str, _Tracked] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tracked

    def add(self, request: Request) -> None:
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, stop=request.sampling.stop
        )
        self._tracked[request.request_id] = _Tracked(request, detokenizer)

    def pop(self, request_id: str) -> Request | None:
        tracked = self._tracked.pop(request_id, None)
        return None if tracked is None else tracked.request

    def append_tokens(
        self, requests: list[Request], results: Sequence[SampleResult | None]
    ) -> tuple[list[RequestOutput], list[tuple[Request, BaseException]]]:
        """Each request's sampled token (None: its sampling failed, nothing to add): the
        outputs, and the requests whose output failed, with the error."""
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        failed: list[tuple[Request, BaseException]] = []
        for request, result in zip(requests, results, strict=True):
            if result is None:
                continue
            try:
                outputs.append(self.append_token(request, result.token_id, result.logprob, now))
            except Exception as exc:
                log.exception("engine request %s: its output failed", request.request_id)
                failed.append((request, exc))
        return outputs, failed

    def append_token(
        self, request: Request, token_id: int, logprob: TokenLogprob | None, now: float
    ) -> RequestOutput:
        tracked = self._tracked[request.request_id]
        params = request.sampling
        request.output_token_ids.append(token_id)
        if request.first_token_time is None:
            request.first_token_time = now
        status: RequestStatus | None = None
        text = ""
        # The matcher has already accepted token_id (engine/core/constrained.py).
        grammar_done = request.matcher is not None and request.matcher.is_finished
        if ((not params.ignore_eos or grammar_done) and token_id in self.eos_token_ids) or (
            token_id in params.stop_token_ids
        ):
            status = RequestStatus.FINISHED_STOPPED
        else:
            text, stopped = tracked.detokenizer.add_token(token_id)
            if stopped or grammar_done:
                status = RequestStatus.FINISHED_STOPPED
        if status is None and (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            # Text held back as a possible stop-string prefix is released ("" after a stop).
            text += tracked.detokenizer.flush()
            self._finish(request, status)
            del self._tracked[request.request_id]
        if logprob is None:
            return request_output(request, [token_id], text)
        # Per-token text is only reported alongside logprobs.
        return request_output(request, [token_id], text, [logprob], [self.token_text(token_id)])

    def token_text(self, token_id: int) -> str:
        return IncrementalDetokenizer.token_text(self.tokenizer, token_id)


def request_output(
    request: Request,
    new_token_ids: list[int] | None = None,
    text: str = "",
    new_logprobs: list[TokenLogprob] | None = None,
    token_texts: list[str] | None = None,
) -> RequestOutput:
    prompt_logprobs = None
    if request.prompt_logprobs is not None and not request.prompt_logprobs_sent and (
        new_token_ids or request.is_finished
    ):
        prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids or [],
        new_text=text,
        finished=request.is_finished,
        finish_reason=request.status.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens,
        new_logprobs=new_logprobs or [],
        new_token_texts=token_texts or [],
        prompt_logprobs=prompt_logprobs,
    )
