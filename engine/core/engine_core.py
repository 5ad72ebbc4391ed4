"""The synchronous engine: one `step()` schedules, runs the model, samples and reports."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.client import AdapterInfo, EngineStepError, RequestRejected
from engine.config import EngineConfig
from engine.core.background import BackgroundSteps, StepCutShort
from engine.core.block_manager import BlockManager
from engine.core.constrained import ConstrainedDecoding
from engine.core.faults import FaultPlan
from engine.core.isolation import Execute, forward_one_by_one, probe_device, sample_one_by_one
from engine.core.model_runner import ModelRunner
from engine.core.output_processor import OutputProcessor, request_output
from engine.core.sampler import Sampler, SampleResult
from engine.core.scheduler import Scheduler
from engine.core.state import Request, RequestStatus
from engine.limits import ContextLimits, check_prompt_ids, resolve_max_tokens
from engine.lora.cache import AdapterCache
from engine.lora.manager import AdapterManager
from engine.lora.weights import LoRAWeights
from engine.models.loader import resolve_model_dir
from engine.request import EngineRequest, RequestOutput, TenantContext
from engine.structured import CompiledGrammar

__all__ = ["EngineCore", "RequestRejected", "StepResult"]  # RequestRejected: what it raises

log = logging.getLogger("loraplex.engine")


@dataclass(slots=True)
class StepResult:
    """What one `EngineCore.step()` did."""

    outputs: list[RequestOutput]
    # Requests that failed since the last step (their adapter could not be loaded, or the
    # step failed on them), with the error for their callers.
    failures: dict[str, BaseException]
    idle: bool  # nothing could run: whatever is queued waits on adapter loads
    # Set once steps kept failing with nothing to blame (see engine/core/isolation.py): the
    # engine serves no more and the step loop must stop.
    fatal: str | None = None


class EngineCore:
    def __init__(
        self, config: EngineConfig, *, wakeup: Callable[[], None] | None = None
    ) -> None:
        """wakeup: called (from any thread) when something the step loop may be waiting
        for happened (an adapter finished loading)."""
        self.config = config
        self.model_dir = resolve_model_dir(config.model, config.resolved_data_dir)
        self.runner = ModelRunner(config, self.model_dir)
        self.tokenizer = self.runner.tokenizer
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        runner = self.runner
        self.adapters = AdapterManager(
            config, runner.lora, runner.model_config, runner.dtype, self.model_dir,
            wakeup=wakeup,
        )
        self.scheduler = Scheduler(config, self.block_manager, self.adapters.cache)
        self.sampler = Sampler()
        self.outputs = OutputProcessor(
            self.tokenizer, self.runner.model_config.eos_token_ids, self.max_model_len,
            self._finish_request,
        )
        # The grammars end documents with the tokens that end requests.
        self.constrained = ConstrainedDecoding(
            config, self.tokenizer, self.runner.vocab_size, self.outputs.eos_token_ids
        )
        self._failures: dict[str, BaseException] = {}  # for the next StepResult
        self.num_step_failures = 0  # steps that raised (their requests ran one by one)
        self.num_steps = 0  # steps that ran a batch, and their time
        self.step_seconds = 0.0
        # Steps in a row in which nothing could run (see engine/core/isolation.py).
        self.consecutive_failures = 0
        self.last_failure: str | None = None
        self._execute: Execute = self.runner.execute
        # Background steps cut short between layers (engine/core/background.py): CPU only,
        # where one step of a few rows takes tens of milliseconds.
        self.background = BackgroundSteps(
            config.background_priority if self.runner.device.type == "cpu" else None
        )
        if self.background.background_priority is not None:
            for layer in self.runner.model.layers:
                layer.register_forward_pre_hook(self._between_layers)
        faults = FaultPlan.from_env()
        if faults is not None:
            self._execute = faults.wrap(self._execute)

    @property
    def adapter_cache(self) -> AdapterCache | None:
        return self.adapters.cache

    def load_adapter(self, name: str, path: str | Path) -> LoRAWeights:
        return self.adapters.load(name, path)  # any thread

    def register_adapter(self, name: str, weights: LoRAWeights) -> AdapterInfo:
        return self.adapters.register(name, weights)  # thread-safe

    def add_adapter(self, name: str, path: str | Path) -> AdapterInfo:
        return self.register_adapter(name, self.load_adapter(name, path))

    def remove_adapter(self, name: str) -> bool:
        return self.adapters.versions.remove(name)

    def get_adapter(self, name: str) -> AdapterInfo | None:
        return self.adapters.versions.get(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.adapters.versions.served()

    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.config.block_size

    def check_request(
        self, num_prompt_tokens: int, max_tokens: int, tenant: TenantContext | None = None
    ) -> None:
        """Raise RequestRejected for a request that can never complete, or that asks for
        more than its tenant's per-request limits (engine/limits.py)."""
        limits = ContextLimits.of(
            self.max_model_len, tenant, kv_capacity_tokens=self.kv_capacity_tokens
        )
        # The engine sees token ids, not which field they came from: most come as a chat.
        resolve_max_tokens(limits, num_prompt_tokens, max_tokens, prompt_param="messages")

    def check_prompt_ids(self, prompt_token_ids: list[int] | tuple[int, ...]) -> None:
        """Raise RequestRejected for token ids outside the model's vocabulary."""
        check_prompt_ids(prompt_token_ids, self.runner.vocab_size)

    def token_text(self, token_id: int) -> str:
        return self.outputs.token_text(token_id)

    def add_request(
        self, request: EngineRequest, grammar: CompiledGrammar | None = None
    ) -> Request:
        """Queue a request; returns the engine's own state of it. A structured request
        (sampling.structured) uses `grammar`, compiled from its spec off the step loop
        (AsyncEngine does so); without one, this waits for the compile (raising its
        StructuredOutputError)."""
        self.check_prompt_ids(request.prompt_token_ids)
        self.check_request(
            len(request.prompt_token_ids), request.sampling.max_tokens, request.tenant
        )
        state = Request.of(request, eos_token_id=self.tokenizer.eos_token_id)
        if request.request_id in self.outputs:
            # Refused here, before its matcher would replace the live request's.
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.constrained.bind(state, grammar)
        self.adapters.bind(state)  # the scheduler refuses a duplicate id: unbound below
        try:
            self.scheduler.add_request(state)
        except BaseException:
            self.adapters.unbind(state)
            self.constrained.unbind(state)
            raise
        self.outputs.add(state)
        return state

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.outputs.pop(request_id)
        if request is None:
            return None
        self.scheduler.abort_request(request_id)
        self.adapters.unbind(request)
        self.constrained.unbind(request)
        return request_output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _finish_request(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(request, status)
        self.adapters.unbind(request)
        self.constrained.unbind(request)

    def step(self) -> StepResult:
        started = time.perf_counter()
        try:
            outputs, idle = self._step()
        except Exception as exc:
            # NOTE: the forward and sampling contain their own failures; what reaches here
            # failed in scheduling or bookkeeping, with no request to blame: the next steps
            # try again, a few times.
            self._note_failure("scheduling", exc)
            self.consecutive_failures += 1
            outputs, idle = [], False
        if not idle:
            self.num_steps += 1
            self.step_seconds += time.perf_counter() - started
        failures, self._failures = self._failures, {}
        fatal = None
        if self.consecutive_failures >= self.config.max_consecutive_step_failures:
            fatal = (f"{self.consecutive_failures} engine steps in a row failed; the last: "
                     f"{self.last_failure}")
        return StepResult(outputs, failures, idle, fatal)

    def _step(self) -> tuple[list[RequestOutput], bool]:
        """(outputs, whether nothing could run)."""
        load_failures = self.adapters.between_steps(
            self.scheduler.waiting, self.scheduler.block_manager.drop_adapter
        )
        for request_id, error in load_failures.items():
            self._failures[request_id] = error
            self.abort_request(request_id)
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return [], True
        adapter_slots = self.adapters.device_slots(c.request for c in scheduled.chunks)
        failed: list[tuple[Request, BaseException]] = []
        try:
            with self.background.forward(scheduled.chunks):
                logits = self._execute(scheduled, adapter_slots)
        except StepCutShort:
            # Nothing of the step is applied: its rows run again in the next step.
            for chunk in scheduled.chunks:
                self.block_manager.forget_unwritten(chunk.request)
            return [], False
        except Exception as exc:
            self._note_failure("forward", exc)
            isolated = forward_one_by_one(
                self._execute, scheduled, adapter_slots, self.config.block_size
            )
            scheduled, logits, failed = isolated.output, isolated.logits, isolated.failed
        self._record_prompt_logprobs()
        self.scheduler.update_after_step(scheduled)
        sampling = [c.request for c in scheduled.chunks if c.samples]
        results: list[SampleResult | None] = []
        # NOTE: one dict test when no request is constrained (the throughput path).
        constrained = bool(self.constrained.live) and bool(sampling)
        if constrained:
            # In place, so that sampling one by one after a failure samples masked rows.
            mask_failed = self.constrained.mask(logits, sampling)
        if sampling:
            try:
                results = list(self.sampler(logits, sampling))
            except Exception as exc:
                self._note_failure("sampling", exc)
                results, failed_samples = sample_one_by_one(self.sampler, logits, sampling)
                failed += failed_samples
        if constrained:
            failed += self.constrained.advance(sampling, results, mask_failed)
        outputs, failed_outputs = self.outputs.append_tokens(sampling, results)
        failed += failed_outputs
        if failed:
            failed_ids = {request.request_id for request, _ in failed}
            ran_any = any(c.request.request_id not in failed_ids for c in scheduled.chunks)
            self._fail_requests(failed, ran_any=ran_any)
        else:
            self.consecutive_failures = 0
        return outputs, False

    def _between_layers(self, *_: object) -> None:
        self.background.check()  # raises StepCutShort to cut a background step short

    def _record_prompt_logprobs(self) -> None:
        """Into each request, the prompt logprobs its chunks of this step computed."""
        for request_id, (first, entries) in self.runner.take_prompt_logprobs().items():
            request = self.scheduler.get_request(request_id)
            if request is None or request.prompt_logprobs is None:
                continue
            request.prompt_logprobs[first:first + len(entries)] = entries

    def _note_failure(self, where: str, exc: BaseException) -> None:
        self.num_step_failures += 1
        self.last_failure = f"{where}: {type(exc).__name__}: {exc}"
        log.error("engine step failed in %s", where, exc_info=exc)
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()  # an out-of-memory error may clear with the cache

    def _fail_requests(self, failed: list[tuple[Request, BaseException]], *, ran_any: bool) -> None:
        """Fail the requests a step failed on, freeing their blocks and adapter pins; with
        nothing else run, probe the device (see engine/core/isolation.py)."""
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
