"""The engine core in a process of its own: `ProcessEngine`, the same `EngineClient` as the
in-process `AsyncEngine`, for a server whose event loop must not share an interpreter with
the step loop.

In one process the step thread and the event loop take turns on one GIL. Here the
engine process runs `EngineCore.step()` on its main thread, and the server's process talks
to it over a pipe (pickled messages, one per step with every output of that step), as
vLLM runs its API server and engine core apart. A crash in the engine (a kernel, the OOM
killer) then fails its requests and drains the server instead of killing it.

NOTE: on a 2-core CPU this served the bf16 burst no faster than the thread
(docs/BENCHMARKS.md, "The engine in a process of its own"): the server's process used
0.48 s of CPU in a 7 s burst, and takes it from a core the engine's OpenMP team runs on
either way. Hence off by default (`--engine-process`).

The server process keeps what it needs between messages: the tokenizer (prompts are
tokenized and chat templates rendered there), the adapters served (a mirror updated by
the calls that change them), and the engine's stats as of its last report (refreshed at
most every `_STATS_EVERY_S` while it steps, and on demand). Structured-output grammars
compile in the engine process, from its cache. If the engine process dies, every request
in flight ends with `EngineDeadError` and `failure()` says why, as a failed step loop does
in process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import pickle
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from engine.async_engine import AsyncEngine, StreamTable, read_stream
from engine.client import AdapterInfo, AdapterPlacement, EngineStats, RunsItsOwnRequests
from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineUnavailable
from engine.remote.tokenizer import LocalTokenizer, TokenizingClient
from engine.request import EngineRequest, RequestOutput
from engine.runtime.host_memory import share_one_heap
from engine.structured import CompiledGrammar, StructuredOutput

log = logging.getLogger("loraplex.engine")

# While requests run, the engine process sends its stats with a step's outputs at most
# this often (and always with the step that finishes its last request).
_STATS_EVERY_S = 0.1
# stats() older than this asks the engine for fresh ones (answered in the background).
_STATS_STALE_S = 0.5
# How long a quick call (residency, stats) may wait for the engine process's answer.
_QUICK_CALL_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class _Ready:
    """What the engine process reports once its model is loaded."""

    model_id: str
    model_dir: str
    device: str
    max_model_len: int
    vocab_size: int
    max_adapter_bytes: int
    adapters: list[AdapterInfo]
    stats: EngineStats


# -- the engine process ------------------------------------------------------------------


class _PipeStreams:
    """The engine process's side of StreamTable: outputs go to the server process, which
    keeps the streams."""

    def __init__(self, host: _CoreHost) -> None:
        self._host = host
        self._last_stats = 0.0

    def deliver(self, outputs: list[RequestOutput], errors: dict[str, BaseException]) -> None:
        host = self._host
        now = time.monotonic()
        stats = None
        if now - self._last_stats >= _STATS_EVERY_S or not host.core.has_unfinished_requests():
            stats, self._last_stats = host.stats(), now
        host.send(("out", outputs, {rid: _picklable(exc) for rid, exc in errors.items()}, stats))

    def fail_all(self, exc: BaseException) -> None:
        self._host.send(("dead", exc))


def _picklable(exc: BaseException) -> BaseException:
    """`exc`, or where it cannot cross the pipe, a RuntimeError with its type and message."""
    try:
        pickle.dumps(exc)
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


class _CoreHost(AsyncEngine):
    """AsyncEngine's step loop on the engine process's main thread, fed from a pipe: a
    receiving thread queues adds and aborts for it and answers calls."""

    def __init__(self, config: EngineConfig, conn: Connection) -> None:
        super().__init__(config)
        self._conn = conn
        self._send_lock = threading.Lock()
        self._streams = _PipeStreams(self)  # type: ignore[assignment]
        # Grammar compiles and adapter checks wait here, never on the receiving thread.
        self._calls = concurrent.futures.ThreadPoolExecutor(4, "loraplex-engine-call")

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the server process is gone: stop stepping
                self._request_stop()

    def serve(self) -> None:
        loaded: concurrent.futures.Future[None] = concurrent.futures.Future()
        loaded.add_done_callback(self._on_loaded)
        self._load_and_run(loaded)  # returns when stopped, or when the engine failed
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._adapter_reads.shutdown(wait=False, cancel_futures=True)

    def _mark_failed(self, reason: str) -> None:
        super()._mark_failed(reason)
        # Ahead of the fatal step's outputs (the pipe keeps the order): the server process
        # reports the engine failed before any caller hears of that step's errors.
        self.send(("failing", reason))

    def _on_loaded(self, loaded: concurrent.futures.Future[None]) -> None:
        exc = loaded.exception()
        if exc is not None:
            self.send(("start_failed", _picklable(exc)))
            return
        core = self.core
        self.send(("ready", _Ready(
            model_id=self.model_id, model_dir=str(core.model_dir), device=self.device,
            max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            max_adapter_bytes=self.max_adapter_bytes(), adapters=self.list_adapters(),
            stats=self.stats(),
        )))
        threading.Thread(target=self._receive, name="loraplex-engine-recv", daemon=True).start()

    def _receive(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._request_stop()  # the server process is gone
                return
            kind = message[0]
            if kind == "add":
                self._add(message[1])
            elif kind == "abort":
                self._queue_abort(message[1])
            elif kind == "call":
                self._call(message[1], message[2], message[3])
            elif kind == "stop":
                self._request_stop()
                return

    def _add(self, request: EngineRequest) -> None:
        spec = request.sampling.structured
        if spec is None:
            self._queue(request, None)
            return

        def compiled(done: concurrent.futures.Future[CompiledGrammar]) -> None:
            exc = done.exception()
            if exc is not None:
                self._streams.deliver([], {request.request_id: exc})
            else:
                self._queue(request, done.result())

        def compile_it() -> None:
            # The compiler is built on first use (it reads the vocabulary): off this thread.
            self.core.constrained.compiler.compile_async(spec).add_done_callback(compiled)

        self._calls.submit(compile_it)

    def _queue(self, request: EngineRequest, grammar: CompiledGrammar | None) -> None:
        with self._lock:
            self._queue_add_locked(request, grammar)

    def _call(self, call_id: int, name: str, args: tuple[Any, ...]) -> None:
        def reply(work: Callable[[], Any]) -> None:
            try:
                value = work()
            except BaseException as exc:  # the caller raises it
                answer: tuple[Any, ...] = ("reply", call_id, False, exc)
            else:
                answer = ("reply", call_id, True, value)
            try:
                self.send(answer)
            except Exception as exc:  # not picklable: the caller must still hear
                self.send(("reply", call_id, False, RuntimeError(
                    f"engine call {name!r}: the answer could not be sent: {exc}")))

        core = self.core
        if name == "stats":
            reply(self.stats)
        elif name == "residency":
            reply(self.adapter_residency)
        elif name == "remove_adapter":
            def remove() -> bool:
                removed = core.remove_adapter(args[0])
                self._wake()
                return removed
            reply(remove)
        elif name == "add_adapter":
            def add() -> AdapterInfo:
                info = core.register_adapter(args[0], core.load_adapter(args[0], args[1]))
                self._wake()
                return info
            # Read and checked on the adapter reads' thread (one core), as in process.
            self._adapter_reads.submit(reply, add)
        elif name == "check_structured":
            def check() -> None:
                core.constrained.compiler.compile(args[0])  # cached for the request's own
            self._calls.submit(reply, check)
        else:
            reply(lambda: _unknown_call(name))


def _unknown_call(name: str) -> None:
    raise ValueError(f"unknown engine call {name!r}")


def serve_core(config: EngineConfig, conn: Connection) -> None:
    """The engine process's entry: load the model, then step until told to stop or until
    the server process is gone."""
    # NOTE: Ctrl-C reaches the whole process group: the server drains its requests and
    # then stops this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    share_one_heap()  # before any thread starts (engine/runtime/host_memory.py)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s"
    )
    _CoreHost(config, conn).serve()


# -- the server process ------------------------------------------------------------------


class ProcessEngine(TokenizingClient, RunsItsOwnRequests):
    """EngineClient of an engine that steps in a process of its own (see the module's
    docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._streams = StreamTable()
        self._ready: _Ready | None = None
        self._adapters: dict[str, AdapterInfo] = {}
        self._stats: EngineStats | None = None
        self._stats_at = 0.0
        self._stats_refreshing = False
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._calls_lock = threading.Lock()
        self._failure: str | None = None
        self._stopping = False

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine process; returns once its model is loaded (or raises what
        loading raised there)."""
        await asyncio.to_thread(self.start_sync)

    def start_sync(self) -> None:
        assert self._process is None, "engine already started"
        context = multiprocessing.get_context("spawn")  # no fork of a threaded process
        ours, theirs = context.Pipe()
        self._process = context.Process(
            target=serve_core, args=(self.config, theirs), name="loraplex-engine", daemon=True
        )
        self._process.start()
        theirs.close()
        self._conn = ours
        try:
            message = ours.recv()
        except EOFError:
            self._process.join(5.0)
            raise RuntimeError(
                f"the engine process exited while loading the model "
                f"(exit code {self._process.exitcode})"
            ) from None
        if message[0] == "start_failed":
            self._process.join(30.0)
            raise message[1]
        ready: _Ready = message[1]
        self._tokenizer = LocalTokenizer(ready.model_dir, self.config.resolved_data_dir)
        self._ready = ready
        self._adapters = {info.name: info for info in ready.adapters}
        self._stats, self._stats_at = ready.stats, time.monotonic()
        threading.Thread(target=self._read, name="loraplex-engine-pipe", daemon=True).start()

    async def shutdown(self) -> None:
        self._stopping = True
        if self._process is not None:
            self._send(("stop",))
            await asyncio.to_thread(self._process.join, 30.0)
            if self._process.is_alive():
                self._process.terminate()
                await asyncio.to_thread(self._process.join, 5.0)
        self._streams.fail_all(EngineDeadError("engine shut down"))
        self._fail_calls(EngineDeadError("engine shut down"))

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before start)."""
        return None if self._process is None else self._process.pid

    # -- the pipe ------------------------------------------------------------------------

    def _send(self, message: tuple[Any, ...]) -> None:
        assert self._conn is not None, "engine not started"
        with self._send_lock, contextlib.suppress(OSError, ValueError):  # gone: see _read
            self._conn.send(message)

    def _read(self) -> None:
        assert self._conn is not None and self._process is not None
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "out":
                _, outputs, errors, stats = message
                if stats is not None:  # before the outputs: their callers may read it
                    self._stats, self._stats_at = stats, time.monotonic()
                self._streams.deliver(outputs, errors)
            elif kind == "reply":
                _, call_id, ok, value = message
                with self._calls_lock:
                    future = self._calls.pop(call_id, None)
                if future is not None:
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(value)
            elif kind == "failing":
                self._mark_failed(message[1])
            elif kind == "dead":
                self._fail_for_good(str(message[1]).removeprefix("engine failed: "))
                return
        self._process.join(5.0)
        if not self._stopping:
            self._fail_for_good(
                f"the engine process exited (exit code {self._process.exitcode})"
            )

    def _fail_for_good(self, reason: str) -> None:
        self._mark_failed(reason)
        self._streams.fail_all(EngineDeadError.failed(reason))

    def _mark_failed(self, reason: str) -> None:
        if self._failure is None:
            log.critical("engine failed, serving no more requests: %s", reason)
            self._failure = reason
        self._fail_calls(EngineDeadError.failed(reason))

    def _fail_calls(self, exc: BaseException) -> None:
        with self._calls_lock:
            calls = list(self._calls.values())
            self._calls.clear()
        for future in calls:
            if not future.done():
                future.set_exception(exc)

    def _call(self, name: str, *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self._failure is not None:
            future.set_exception(EngineDeadError.failed(self._failure))
            return future
        call_id = next(self._call_ids)
        with self._calls_lock:
            self._calls[call_id] = future
        self._send(("call", call_id, name, args))
        return future

    def _call_now(self, name: str, *args: Any) -> Any:
        """A quick call, answered by the engine process's receiving thread."""
        try:
            return self._call(name, *args).result(_QUICK_CALL_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise EngineUnavailable(f"the engine process did not answer {name!r}") from None

    # -- EngineClient --------------------------------------------------------------------

    @property
    def ready_info(self) -> _Ready:
        assert self._ready is not None, "engine not started"
        return self._ready

    @property
    def model_id(self) -> str:
        return self.ready_info.model_id

    @property
    def device(self) -> str:
        return self.ready_info.device

    @property
    def max_model_len(self) -> int:
        return self.ready_info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.ready_info.vocab_size

    def check_structured_output(self, spec: StructuredOutput) -> None:
        # Blocking, as the protocol allows: the engine's compiler and cache answer it.
        self._call("check_structured", spec).result()

    def is_ready(self) -> bool:
        return (
            self._ready is not None
            and self._process is not None
            and self._process.is_alive()
            and self._failure is None
            and not self._stopping
        )

    def failure(self) -> str | None:
        return self._failure

    def stats(self) -> EngineStats:
        """The engine's stats as of its last report (at most `_STATS_EVERY_S` old while it
        steps); an older report asks for a fresh one in the background."""
        assert self._stats is not None, "engine not started"
        if time.monotonic() - self._stats_at > _STATS_STALE_S and not self._stats_refreshing:
            self._stats_refreshing = True
            self._call("stats").add_done_callback(self._refreshed)
        return replace(self._stats, num_adapters=len(self._adapters))

    def _refreshed(self, future: concurrent.futures.Future[Any]) -> None:
        self._stats_refreshing = False
        if future.exception() is None:
            self._stats, self._stats_at = future.result(), time.monotonic()

    async def refresh_stats(self) -> EngineStats:
        """The engine's stats now, asked of the engine process."""
        self._stats = await asyncio.wrap_future(self._call("stats"))
        self._stats_at = time.monotonic()
        return self.stats()

    def get_adapter(self, name: str) -> AdapterInfo | None:
        return self._adapters.get(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return list(self._adapters.values())

    async def add_adapter(self, name: str, path: str) -> AdapterInfo:
        info: AdapterInfo = await asyncio.wrap_future(self._call("add_adapter", name, str(path)))
        self._adapters.pop(name, None)  # a new version goes last, as the engine lists it
        self._adapters[name] = info
        return info

    async def remove_adapter(self, name: str) -> bool:
        removed: bool = await asyncio.wrap_future(self._call("remove_adapter", name))
        self._adapters.pop(name, None)
        return removed

    def adapter_residency(self) -> list[AdapterPlacement]:
        if self._failure is not None or self._stopping:
            return []  # a dead engine holds no adapter
        return self._call_now("residency")

    def max_adapter_bytes(self) -> int:
        return self.ready_info.max_adapter_bytes

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        if self._failure is not None:
            raise EngineDeadError.failed(self._failure)
        if self._stopping:
            raise EngineDeadError("engine is shutting down")
        request_id = request.request_id
        # NOTE: no check of self._failure after the send. The engine may fail meanwhile on
        # this very request's step, and then its own error (delivered before the engine's
        # death) is what the caller must get. If it died before the open, the stream holds
        # the death already (StreamTable.fail_all); after it, fail_all ends it.
        stream = self._streams.open(request_id)
        self._send(("add", request))
        try:
            async for item in read_stream(stream):
                yield item
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._streams.close(request_id)
        if self._failure is None and not self._stopping:
            self._send(("abort", request_id))
