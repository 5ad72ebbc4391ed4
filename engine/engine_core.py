"""The synchronous engine: one `step()` schedules, runs the model, samples and reports."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.adapter_versions import AdapterVersions, adapter_name
from engine.block_manager import BlockManager
from engine.client import AdapterInfo, EngineStepError, RequestRejected
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.faults import FaultPlan
from engine.isolation import Execute, forward_one_by_one, probe_device, sample_one_by_one
from engine.lora.cache import AdapterCache
from engine.lora.peft import load_peft_adapter
from engine.lora.weights import AdapterError, LoRAWeights
from engine.model_loader import resolve_model
from engine.model_runner import ModelRunner
from engine.request import Request, RequestOutput, RequestStatus, TenantContext, TokenLogprob
from engine.sampler import Sampler, SampleResult
from engine.scheduler import Scheduler

log = logging.getLogger("loraplex.engine")

# What requests may put in `model` to name an adapter; '@' is kept for `name@version`.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-/:]{0,127}")


@dataclass(slots=True)
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer


@dataclass(slots=True)
class StepResult:
    """What one `EngineCore.step()` did."""

    outputs: list[RequestOutput]
    # Requests that failed since the last step (their adapter could not be loaded, or the
    # step failed on them), with the error for their callers.
    failures: dict[str, BaseException]
    idle: bool  # nothing could run: whatever is queued waits on adapter loads
    # Set once steps kept failing with nothing to blame (see engine/isolation.py): the
    # engine serves no more and the step loop must stop.
    fatal: str | None = None


class EngineCore:
    def __init__(
        self, config: EngineConfig, *, wakeup: Callable[[], None] | None = None
    ) -> None:
        """wakeup: called (from any thread) when something the step loop may be waiting
        for happened (an adapter finished loading)."""
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
        self._failures: dict[str, BaseException] = {}  # for the next StepResult
        self.num_step_failures = 0  # steps that raised (their requests ran one by one)
        # Steps in a row in which nothing could run (see engine/isolation.py).
        self.consecutive_failures = 0
        self.last_failure: str | None = None
        self._execute: Execute = self.runner.execute
        faults = FaultPlan.from_env()
        if faults is not None:
            self._execute = faults.wrap(self._execute)
        self.wakeup = wakeup
        self._init_adapters()

    # ---- adapters (versions: engine/adapter_versions.py) ------------------------------

    def _init_adapters(self) -> None:
        self.adapter_cache: AdapterCache | None = None
        self._adapter_event = False
        lora = self.runner.lora
        if lora is not None:
            self.adapter_cache = AdapterCache(
                max_loras=self.config.max_loras,
                max_cpu_loras=self.config.max_cpu_loras,
                load=self._reload_adapter,
                install=lora.install,
                evict=lora.clear,
                on_ready=self._on_adapter_ready,
            )
            self.scheduler.adapters = self.adapter_cache
        self.adapters = AdapterVersions(self.adapter_cache)

    def load_adapter(self, name: str, path: str | Path) -> LoRAWeights:
        """Read and validate a PEFT directory (any thread; touches no engine state)."""
        if self.adapter_cache is None:
            raise AdapterError("LoRA adapters are disabled on this engine (--max-loras 0)")
        if not ADAPTER_NAME.fullmatch(name):
            raise AdapterError(
                f"invalid adapter name {name!r}: 1-128 characters among letters, digits and "
                "'._-/:', starting with a letter or digit ('@' is kept for versions)"
            )
        if name == self.model_dir.name or name == self.config.model:
            raise AdapterError(f"adapter name {name!r} is the base model's name")
        return load_peft_adapter(
            Path(path),
            self.runner.model_config,
            max_rank=self.config.max_lora_rank,
            name=name,
            dtype=self.runner.dtype,
        )

    def register_adapter(self, name: str, weights: LoRAWeights) -> AdapterInfo:
        """Serve validated weights as `name` (thread-safe); replaces the current version."""
        return self.adapters.register(name, weights)

    def add_adapter(self, name: str, path: str | Path) -> AdapterInfo:
        return self.register_adapter(name, self.load_adapter(name, path))

    def remove_adapter(self, name: str) -> bool:
        return self.adapters.remove(name)

    def get_adapter(self, name: str) -> AdapterInfo | None:
        return self.adapters.get(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.adapters.served()

    def _reload_adapter(self, key: str) -> LoRAWeights:
        """The adapter cache's loader: read a version back from disk (loader thread)."""
        path = self.adapters.path_of(key)
        if path is None:
            raise AdapterError(f"adapter {key} has no directory to load it from")
        return self.load_adapter(adapter_name(key), path)

    def _on_adapter_ready(self, key: str) -> None:
        self._adapter_event = True
        if self.wakeup is not None:
            self.wakeup()

    def _bind_adapter(self, request: Request) -> None:
        """Replace the adapter name a request came with by its current version's key."""
        if request.adapter_id is not None:
            request.adapter_id = self.adapters.bind(request.adapter_id)

    def _unbind_adapter(self, request: Request) -> None:
        if request.adapter_id is not None:
            self.adapters.unbind(request.adapter_id)

    def _between_steps(self) -> None:
        """Adapter housekeeping on the step thread: forget dropped versions' cached KV and
        fail the requests whose adapter could not be loaded."""
        for key in self.adapters.drain_dropped():
            self.block_manager.drop_adapter(key)
        if not self._adapter_event or self.adapter_cache is None:
            return
        self._adapter_event = False
        for request in self.scheduler.waiting:
            adapter_key = request.adapter_id
            if adapter_key is None:
                continue
            error = self.adapter_cache.load_error(adapter_key)
            if error is not None:
                self._failures[request.request_id] = RuntimeError(
                    f"adapter '{adapter_name(adapter_key)}' could not be loaded: {error}"
                )
                self.abort_request(request.request_id)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.config.block_size

    def check_request(
        self, num_prompt_tokens: int, max_tokens: int, tenant: TenantContext | None = None
    ) -> None:
        """Raise RequestRejected for a request that can never complete, or that asks for
        more than its tenant's per-request limits."""
        if tenant is not None:
            check_tenant_limits(tenant, num_prompt_tokens, max_tokens)
        # NOTE: worded as OpenAI's, which clients such as litellm match on.
        if num_prompt_tokens >= self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, the prompt has {num_prompt_tokens} tokens, leaving no room for a "
                "completion.",
                code="context_length_exceeded",
                param="messages",
            )
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                f"({num_prompt_tokens} in the prompt, {max_tokens} in the completion).",
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
        """`request.adapter_id` names the adapter (None: the base model)."""
        if request.request_id in self._tracked:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.check_prompt_ids(request.prompt_token_ids)
        self.check_request(
            request.num_prompt_tokens, request.sampling.max_tokens, request.tenant
        )
        self._bind_adapter(request)
        if request.eos_token_id is None and self.tokenizer.eos_token_id is not None:
            request.eos_token_id = self.tokenizer.eos_token_id
        detok = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, stop=request.sampling.stop
        )
        try:
            self.scheduler.add_request(request)
        except BaseException:
            self._unbind_adapter(request)
            raise
        self._tracked[request.request_id] = _Tracked(request, detok)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.abort_request(request_id)
        self._unbind_adapter(tracked.request)
        return self._output(tracked.request, [], "", [], [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> StepResult:
        idle = False
        try:
            outputs, idle = self._step()
        except Exception as exc:
            # NOTE: the forward and sampling contain their own failures; what reaches here
            # failed in scheduling or bookkeeping, with no request to blame: the next steps
            # try again, a few times.
            self._note_failure("scheduling", exc)
            self.consecutive_failures += 1
            outputs = []
        failures, self._failures = self._failures, {}
        fatal = None
        if self.consecutive_failures >= self.config.max_consecutive_step_failures:
            fatal = (f"{self.consecutive_failures} engine steps in a row failed; the last: "
                     f"{self.last_failure}")
        return StepResult(outputs, failures, idle, fatal)

    def _step(self) -> tuple[list[RequestOutput], bool]:
        """(outputs, whether nothing could run)."""
        self._between_steps()
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return [], True
        adapter_slots: dict[str, int] = {}
        if self.adapter_cache is not None:
            for chunk in scheduled.chunks:
                key = chunk.request.adapter_id
                if key is not None and key not in adapter_slots:
                    slot = self.adapter_cache.slot_of(key)
                    assert slot is not None, f"adapter {key} scheduled without a device slot"
                    adapter_slots[key] = slot
        failed: list[tuple[Request, BaseException]] = []
        try:
            logits = self._execute(scheduled, adapter_slots)
        except Exception as exc:
            self._note_failure("forward", exc)
            isolated = forward_one_by_one(
                self._execute, scheduled, adapter_slots, self.config.block_size
            )
            scheduled, logits, failed = isolated.output, isolated.logits, isolated.failed
        self.scheduler.update_after_step(scheduled)
        sampling = [c.request for c in scheduled.chunks if c.samples]
        results: list[SampleResult | None] = []
        if sampling:
            try:
                results = list(self.sampler(logits, sampling))
            except Exception as exc:
                self._note_failure("sampling", exc)
                results, failed_samples = sample_one_by_one(self.sampler, logits, sampling)
                failed += failed_samples
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for request, result in zip(sampling, results, strict=True):
            if result is None:
                continue
            tracked = self._tracked[request.request_id]
            try:
                outputs.append(self._append_token(tracked, result.token_id, result.logprob, now))
            except Exception as exc:
                log.exception("engine request %s: its output failed", request.request_id)
                failed.append((request, exc))
        if failed:
            failed_ids = {request.request_id for request, _ in failed}
            ran_any = any(c.request.request_id not in failed_ids for c in scheduled.chunks)
            self._fail_requests(failed, ran_any=ran_any)
        else:
            self.consecutive_failures = 0
        return outputs, False

    def _note_failure(self, where: str, exc: BaseException) -> None:
        self.num_step_failures += 1
        self.last_failure = f"{where}: {type(exc).__name__}: {exc}"
        log.error("engine step failed in %s", where, exc_info=exc)
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()  # an out-of-memory error may clear with the cache

    def _fail_requests(self, failed: list[tuple[Request, BaseException]], *, ran_any: bool) -> None:
        """Fail the requests a step failed on, freeing their blocks and adapter pins; with
        nothing else run, probe the device (see engine/isolation.py)."""
        for request, exc in failed:
            self._failures[request.request_id] = EngineStepError(
                f"the engine step running this request failed: {type(exc).__name__}: {exc}"
            )
            self.abort_request(request.request_id)
        if ran_any or probe_device(
            self._execute, self.block_manager, self.tokenizer.bos_token_id or 0
        ):
            self.consecutive_failures = 0
        else:
            self.consecutive_failures += 1

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
            self._unbind_adapter(request)
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


def check_tenant_limits(tenant: TenantContext, num_prompt_tokens: int, max_tokens: int) -> None:
    """The tenant's per-request limits, enforced here too: a gateway that forgets them
    cannot let one request take more than its plan allows."""
    if tenant.max_tokens is not None and max_tokens > tenant.max_tokens:
        raise RequestRejected(
            f"max_tokens is {max_tokens}; this account allows at most {tenant.max_tokens} "
            "per request.",
            code="max_tokens_exceeded",
            param="max_tokens",
        )
    context = tenant.max_context_tokens
    if context is None:
        return
    if num_prompt_tokens >= context:
        raise RequestRejected(
            f"This account's context limit is {context} tokens; the prompt has "
            f"{num_prompt_tokens} tokens.",
            code="context_length_exceeded",
            param="messages",
        )
    if num_prompt_tokens + max_tokens > context:
        raise RequestRejected(
            f"This account's context limit is {context} tokens; the prompt "
            f"({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds it.",
            code="context_length_exceeded",
            param="max_tokens",
        )
