"""The synchronous engine: one `step()` schedules, runs the model, samples and reports."""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.model_loader import resolve_model
from engine.model_runner import ModelRunner
from engine.request import Request, RequestOutput, RequestStatus, TokenLogprob
from engine.sampler import Sampler
from engine.scheduler import Scheduler


class RequestRejected(ValueError):
    """A request the engine can never serve (too long for the context or the KV cache)."""

    def __init__(self, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass(slots=True)
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_model(config.model, config.resolved_data_dir)
        self.runner = ModelRunner(config, self.model_dir)
        self.tokenizer = self.runner.tokenizer
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.sampler = Sampler()
        self.eos_token_ids = set(self.runner.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._tracked: dict[str, _Tracked] = {}

    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.config.block_size

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestRejected for a request that can never complete."""
        if num_prompt_tokens >= self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {num_prompt_tokens} tokens.",
                code="context_length_exceeded",
                param="messages",
            )
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) "
                "exceeds it.",
                code="context_length_exceeded",
                param="max_tokens",
            )
        # NOTE: a sequence is only ever preempted for others; alone it must fit.
        if num_prompt_tokens + max_tokens > self.kv_capacity_tokens:
            raise RequestRejected(
                f"The request needs up to {num_prompt_tokens + max_tokens} tokens of KV cache; "
                f"this server holds {self.kv_capacity_tokens}.",
                code="context_length_exceeded",
                param="max_tokens",
            )

    def check_prompt_ids(self, prompt_token_ids: list[int]) -> None:
        """Raise RequestRejected for token ids outside the model's vocabulary."""
        vocab = self.runner.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(
                f"Token id {bad} is outside this model's vocabulary (0..{vocab - 1}).",
                code="invalid_prompt",
                param="prompt",
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self._tracked:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.check_prompt_ids(request.prompt_token_ids)
        self.check_request(request.num_prompt_tokens, request.sampling.max_tokens)
        if request.eos_token_id is None and self.tokenizer.eos_token_id is not None:
            request.eos_token_id = self.tokenizer.eos_token_id
        detok = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, stop=request.sampling.stop
        )
        self._tracked[request.request_id] = _Tracked(request, detok)
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.abort_request(request_id)
        return self._output(tracked.request, [], "", [], [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        logits = self.runner.execute(scheduled)
        self.scheduler.update_after_step(scheduled)
        sampling = [c.request for c in scheduled.chunks if c.samples]
        results = self.sampler(logits, sampling)
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for request, result in zip(sampling, results, strict=True):
            tracked = self._tracked[request.request_id]
            outputs.append(self._append_token(tracked, result.token_id, result.logprob, now))
        return outputs

    def _append_token(
        self, tracked: _Tracked, token_id: int, logprob: TokenLogprob | None, now: float
    ) -> RequestOutput:
        request = tracked.request
        params = request.sampling
        request.output_token_ids.append(token_id)
        if request.first_token_time is None:
            request.first_token_time = now
        new_logprobs = [logprob] if logprob is not None else []

        status: RequestStatus | None = None
        text = ""
        if (not params.ignore_eos and token_id in self.eos_token_ids) or (
            token_id in params.stop_token_ids
        ):
            status = RequestStatus.FINISHED_STOPPED
        else:
            text, stopped = tracked.detokenizer.add_token(token_id)
            if stopped:
                status = RequestStatus.FINISHED_STOPPED
        if status is None and (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            # Text held back as a possible stop-string prefix is released ("" after a stop).
            text += tracked.detokenizer.flush()
            self.scheduler.finish_request(request, status)
            del self._tracked[request.request_id]
        # Per-token text is only reported alongside logprobs.
        token_texts = [self.token_text(token_id)] if logprob is not None else []
        return self._output(request, [token_id], text, new_logprobs, token_texts)

    def token_text(self, token_id: int) -> str:
        return IncrementalDetokenizer.token_text(self.tokenizer, token_id)

    @staticmethod
    def _output(
        request: Request,
        new_token_ids: list[int],
        text: str,
        new_logprobs: list[TokenLogprob],
        token_texts: list[str],
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_text=text,
            finished=request.is_finished,
            finish_reason=request.status.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            new_logprobs=new_logprobs,
            new_token_texts=token_texts,
        )
