"""AsyncEngine: the engine core stepped by a background thread, streamed to asyncio callers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.chat_template import render_chat_ids, template_has_tools
from engine.client import AdapterInfo, AdapterPlacement, EngineStats, RunsItsOwnRequests
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.model_runner import dtype_name
from engine.errors import EngineDeadError
from engine.models.loader import ModelConfig
from engine.models.registry import model_class_for
from engine.request import EngineRequest, RequestOutput, TenantContext
from engine.runtime.host_memory import share_one_heap
from engine.runtime.threads import single_core_executor
from engine.structured import CompiledGrammar, GrammarCompiler, StructuredOutput

log = logging.getLogger("loraplex.engine")

# With requests queued but nothing runnable (adapters loading), the step thread sleeps at
# most this long between checks; a finished load wakes it at once.
_IDLE_WAIT_S = 0.05
# adapter_config.json (rank_pattern / alpha_pattern may name every module) and the
# safetensors header's fixed part.
_ADAPTER_FILES_SLACK = 1024 * 1024


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    finished: bool = False


class StreamTable:
    """The callers' streams of an engine, by request id: filled from the thread that
    steps (or hears from) the engine, read on each caller's event loop. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        # What fail_all ended every stream with: a stream opened after it gets the same
        # (the engine died between a caller's check and its open).
        self._failed: BaseException | None = None

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._streams

    def open(self, request_id: str) -> _Stream:
        """A stream for `request_id` on the running loop; ValueError if one is open. After
        fail_all, a stream that already holds fail_all's error."""
        stream = _Stream(loop=asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            if self._failed is not None:
                stream.finished = True
                stream.queue.put_nowait(self._failed)
                return stream
            self._streams[request_id] = stream
        return stream

    def close(self, request_id: str) -> None:
        """Forget `request_id`'s stream: nothing more is delivered to it."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.finished = True

    def deliver(self, outputs: list[RequestOutput], errors: dict[str, BaseException]) -> None:
        """Hand each output and error to its stream (ids without one are dropped); a
        finished output or an error closes the stream."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    stream.finished = True
                    del self._streams[out.request_id]
                by_loop.setdefault(stream.loop, []).append((stream, out))
            for request_id, exc in errors.items():
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.finished = True
                    by_loop.setdefault(stream.loop, []).append((stream, exc))
        for loop, items in by_loop.items():
            # A closed caller loop means nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, items)

    def fail_all(self, exc: BaseException) -> None:
        """End every open stream, and any opened later, with `exc`."""
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            self._failed = exc
        for stream in streams:
            stream.finished = True
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(_put_all, [(stream, exc)])


async def read_stream(stream: _Stream) -> AsyncIterator[RequestOutput]:
    """A stream's outputs until the finished one; an error delivered to it is raised."""
    while True:
        item = await stream.queue.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finished:
            return


class AsyncEngine(RunsItsOwnRequests):
    """Thread-safe front of `EngineCore`.

    NOTE: the core is touched only by the step thread. Callers hand it adds and aborts
    through `_pending_*` under a lock; outputs go back to each caller's event loop with
    one `call_soon_threadsafe` per step and loop.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._core: EngineCore | None = None
        self._lock = threading.Condition()
        # With the compiled grammar of a structured request.
        self._pending_adds: list[tuple[EngineRequest, CompiledGrammar | None]] = []
        self._pending_aborts: list[str] = []
        self._streams = StreamTable()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failure: str | None = None  # why the engine stopped serving for good
        # Adapter directories are read and checked here: off the event loop and the step
        # thread, with torch on one core (engine/runtime/threads.py).
        self._adapter_reads = single_core_executor(2, "loraplex-adapter-read")

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start the step thread, which loads the model; returns once it is loaded (or
        raises what loading raised)."""
        await asyncio.wrap_future(self._start_thread())

    def start_sync(self) -> None:
        """`start` from synchronous code."""
        self._start_thread().result()

    def _start_thread(self) -> concurrent.futures.Future[None]:
        assert self._thread is None, "engine already started"
        share_one_heap()  # before the step thread's first allocation (host_memory.py)
        loaded: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._load_and_run, args=(loaded,), name="loraplex-engine", daemon=True
        )
        self._thread.start()
        return loaded

    def _load_and_run(self, loaded: concurrent.futures.Future[None]) -> None:
        # NOTE: the model is built on the thread that steps it. On the CPU each thread that
        # runs parallel torch ops gets an OpenMP team of its own, and once a process has
        # more OpenMP threads than cores, libgomp stops spinning between parallel regions:
        # every small op of a step then waits for its team to be woken (a decode step
        # measured ~10% slower). Other threads' torch work runs on one core (see
        # engine/runtime/threads.py).
        try:
            self._core = EngineCore(self.config, wakeup=self._wake)
        except BaseException as exc:
            loaded.set_exception(exc)
            return
        loaded.set_result(None)
        self._run()

    async def shutdown(self) -> None:
        self._request_stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
        self._adapter_reads.shutdown(wait=False, cancel_futures=True)
        if self._core is not None and self._core.adapter_cache is not None:
            self._core.adapter_cache.close()
        if self._core is not None:
            self._core.constrained.close()
        self._fail_all(EngineDeadError("engine shut down"))

    @property
    def core(self) -> EngineCore:
        assert self._core is not None, "engine not started"
        return self._core

    # -- EngineClient ------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return model_id_for(self.config.model, self.core.model_dir)

    @property
    def device(self) -> str:
        """Where it computes: "cpu", "cuda:0", ..."""
        return str(self.core.runner.device)

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def encode(self, text: str) -> list[int]:
        return list(self.core.tokenizer(text).input_ids)

    @property
    def vocab_size(self) -> int:
        return self.core.runner.vocab_size

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return render_chat_ids(self.core.tokenizer, messages, tools)

    @property
    def chat_template_has_tools(self) -> bool:
        return template_has_tools(self.core.tokenizer)

    def check_structured_output(self, spec: StructuredOutput) -> None:
        self.core.constrained.compiler.compile(spec)

    def token_text(self, token_id: int) -> str:
        return self.core.token_text(token_id)

    def is_ready(self) -> bool:
        return (
            self._core is not None
            and self._thread is not None
            and self._thread.is_alive()
            and self._failure is None
            and not self._stopping
        )

    def failure(self) -> str | None:
        return self._failure

    def stats(self) -> EngineStats:
        core = self.core
        bm = core.block_manager
        return EngineStats(
            num_running=core.scheduler.num_running,
            num_waiting=core.scheduler.num_waiting,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=core.runner.num_blocks,
            kv_usage=bm.usage,
            num_preemptions=core.scheduler.num_preemptions,
            prefix_cache_hits=bm.prefix_cache_hits,
            prefix_cache_queries=bm.prefix_cache_queries,
            num_adapters=len(core.list_adapters()),
            adapter_cache=None if core.adapter_cache is None else core.adapter_cache.stats(),
            num_step_failures=core.num_step_failures,
            num_steps=core.num_steps,
            num_steps_cut=core.background.num_cut,
            kv_filled_slots=bm.filled_slots(list(core.scheduler.running)),
            block_size=bm.block_size,
            step_seconds=core.step_seconds,
            dtype=dtype_name(core.runner.dtype),
            compute=core.runner.compute,
            quantization=core.runner.describe_quantization(),
            weight_bytes=core.runner.weight_bytes,
            **structured_stats(core),
        )

    def get_adapter(self, name: str) -> AdapterInfo | None:
        return self.core.get_adapter(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.core.list_adapters()

    async def add_adapter(self, name: str, path: str) -> AdapterInfo:
        # Reading and validating the files runs off both the event loop and the step loop.
        weights = await asyncio.get_running_loop().run_in_executor(
            self._adapter_reads, self.core.load_adapter, name, path
        )
        info = self.core.register_adapter(name, weights)
        self._wake()
        return info

    async def remove_adapter(self, name: str) -> bool:
        removed = self.core.remove_adapter(name)
        self._wake()
        return removed

    def adapter_residency(self) -> list[AdapterPlacement]:
        cache = self.core.adapter_cache
        if cache is None:
            return []
        names = {info.key: info.name for info in self.core.list_adapters()}
        return [
            AdapterPlacement(
                name=names[r.key],
                slot=r.slot,
                on_host=r.on_host,
                loading=r.loading or r.queued,
                pins=r.pins,
                reservations=r.reservations,
            )
            for r in cache.resident()
            if r.key in names  # a removed version still finishing is no longer served
        ]

    def max_adapter_bytes(self) -> int:
        return max_adapter_bytes(self.core.runner.model_config, self.config.max_lora_rank)

    def check_request(
        self, num_prompt_tokens: int, max_tokens: int, tenant: TenantContext | None = None
    ) -> None:
        self.core.check_request(num_prompt_tokens, max_tokens, tenant)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        if self._failure is not None:
            raise EngineDeadError.failed(self._failure)
        if self._stopping:
            raise EngineDeadError("engine is shutting down")
        request_id = request.request_id
        # Reject up front, in the caller's thread, what the core would refuse.
        self.core.check_prompt_ids(request.prompt_token_ids)
        self.core.check_request(
            len(request.prompt_token_ids), request.sampling.max_tokens, request.tenant
        )
        grammar = None
        spec = request.sampling.structured
        if spec is not None:
            # Compiled on the compiler's threads, never the step thread; a refusal is
            # raised here, before anything is queued.
            grammar = await asyncio.wrap_future((await self._compiler()).compile_async(spec))
        stream = self._streams.open(request_id)
        with self._lock:
            dead = None
            if self._failure is not None:  # failed since the check above
                dead = EngineDeadError.failed(self._failure)
            elif self._stopping:
                dead = EngineDeadError("engine is shutting down")
            else:
                self._queue_add_locked(request, grammar)
        if dead is not None:
            self._streams.close(request_id)
            raise dead
        try:
            async for item in read_stream(stream):
                yield item
        finally:
            if not stream.finished:
                self.abort(request_id)

    async def _compiler(self) -> GrammarCompiler:
        constrained = self.core.constrained
        if constrained.has_compiler:
            return constrained.compiler
        # Building it reads the whole vocabulary: off the event loop, once.
        return await asyncio.to_thread(lambda: constrained.compiler)

    def abort(self, request_id: str) -> None:
        self._streams.close(request_id)
        self._queue_abort(request_id)

    def _queue_add_locked(self, request: EngineRequest, grammar: CompiledGrammar | None
                          ) -> None:
        """Queue a request for the step loop (the caller holds the lock); a foreground one
        cuts a background step in progress short (engine/core/background.py)."""
        self._pending_adds.append((request, grammar))
        self.core.background.note_arrival(request.priority)
        self._lock.notify_all()

    def _queue_abort(self, request_id: str) -> None:
        with self._lock:
            self._pending_aborts.append(request_id)
            self._lock.notify_all()

    def _request_stop(self) -> None:
        """Have the step loop return at its next turn."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    # -- step thread -------------------------------------------------------------------

    def _run(self) -> None:
        core = self.core
        idle = False  # the last step had nothing it could run
        try:
            while True:
                with self._lock:
                    while (
                        not self._stopping
                        and not self._pending_adds
                        and not self._pending_aborts
                        and not core.has_unfinished_requests()
                    ):
                        self._lock.wait()
                    if (
                        idle
                        and not self._stopping
                        and not self._pending_adds
                        and not self._pending_aborts
                    ):
                        # Everything queued waits on adapter loads: sleep until one ends.
                        self._lock.wait(_IDLE_WAIT_S)
                    if self._stopping:
                        return
                    adds, self._pending_adds = self._pending_adds, []
                    aborts, self._pending_aborts = self._pending_aborts, []
                    core.background.take_in()
                for request_id in aborts:
                    core.abort_request(request_id)
                for request, grammar in adds:
                    if request.request_id in aborts:
                        continue
                    try:
                        core.add_request(request, grammar)
                    except ValueError as exc:
                        self._streams.deliver([], {request.request_id: exc})
                result = core.step()
                idle = result.idle
                if result.fatal is not None:
                    # Failed before the step's errors go out: a caller that gets its error
                    # and asks /health at once must find the engine failed.
                    self._mark_failed(result.fatal)
                if result.outputs or result.failures:
                    self._streams.deliver(result.outputs, result.failures)
                if result.fatal is not None:
                    self._fail_all(EngineDeadError.failed(result.fatal))
                    return
        except BaseException as exc:
            log.exception("engine step loop failed")
            self._fail_for_good(f"the step loop failed: {type(exc).__name__}: {exc}")

    def _fail_for_good(self, reason: str) -> None:
        self._mark_failed(reason)
        self._fail_all(EngineDeadError.failed(reason))

    def _mark_failed(self, reason: str) -> None:
        log.critical("engine failed, serving no more requests: %s", reason)
        with self._lock:
            self._failure = reason

    def _fail_all(self, exc: BaseException) -> None:
        self._streams.fail_all(exc)


def _put_all(items: list[tuple[_Stream, Any]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def max_adapter_bytes(model_config: ModelConfig, max_rank: int) -> int:
    """Bytes of the largest adapter load_peft_adapter accepts for this base model."""
    num_params = 0
    # NOTE: the loader's own shape table (the architecture's), so that the bound and the
    # check never disagree.
    shapes = model_class_for(model_config).linear_shapes(model_config)
    for in_features, out_features in shapes.values():
        num_params += max_rank * (in_features + out_features)  # lora_A [r, in] + lora_B [out, r]
    num_tensors = 2 * len(shapes) * model_config.num_layers
    # float32 is the widest dtype adapters are saved in; each tensor's header entry
    # (name, dtype, shape, offsets) stays well under 256 bytes of JSON.
    weights = 4 * num_params * model_config.num_layers + 256 * num_tensors
    return weights + _ADAPTER_FILES_SLACK


def structured_stats(core: EngineCore) -> dict[str, Any]:
    """The EngineStats fields of structured outputs."""
    grammar = core.constrained.stats()
    fields: dict[str, Any] = {"num_structured_requests": core.constrained.num_admitted}
    if grammar is not None:
        fields.update(
            grammar_compiles=grammar.num_compiles, grammar_cache_hits=grammar.hits,
            grammar_cache_misses=grammar.misses, grammar_refusals=grammar.num_refused,
            grammar_timeouts=grammar.num_timeouts, grammar_compile_s=grammar.compile_s,
        )
    return fields


def model_id_for(model: str, model_dir: Path) -> str:
    return model_dir.name if model == "default" else Path(model).name
