"""Compiling structured-output specs into grammars: off the step loop, cached, bounded.

One `GrammarCompiler` per engine, built from the model's Hugging Face tokenizer. A spec is
compiled on one of a few worker threads; `compile_async` returns a future at once, which
resolves with the `CompiledGrammar`, or with a `StructuredOutputError` saying which limit
the spec exceeds or what is wrong with it, or, at `compile_timeout_s` after the call, with
a `GrammarTimeoutError`, whatever the worker is still doing. Grammars, and refusals, are
kept in an LRU keyed by the spec, so a tenant's repeated schema compiles once.

NOTE: the workers run with a large stack. llguidance builds grammars recursively in the
calling thread: a chain of `$ref`s or Lark rules a few thousand deep, well inside the size
limit, needs more than the 8 MiB a thread gets by default, and overflowing it kills the
process rather than raising.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from engine.structured.errors import GrammarTimeoutError, StructuredOutputError
from engine.structured.grammar import to_grammar
from engine.structured.limits import StructuredLimits, library_refusal
from engine.structured.matcher import CompiledGrammar, num_bitmask_words
from engine.structured.spec import StructuredOutput

log = logging.getLogger(__name__)

WORKER_STACK_BYTES = 256 * 1024 * 1024  # virtual: pages are committed only when touched
_thread_start_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class GrammarCacheStats:
    """For /metrics: counters since the compiler started, and the cache now."""

    hits: int  # compile calls answered from the cache (grammars and refusals)
    misses: int  # calls that waited for a compile (their own or one already running)
    num_compiles: int  # compiles started
    num_refused: int  # compiles that ended in a refusal (limits, invalid specs)
    num_timeouts: int  # calls answered with GrammarTimeoutError
    num_evictions: int
    compile_s: float  # total worker time of finished compiles
    num_cached: int
    cache_size: int
    num_in_flight: int  # compiles running or queued


@dataclass(slots=True)
class _Job:
    spec: StructuredOutput
    waiters: list[Future[CompiledGrammar]]


_Outcome = CompiledGrammar | StructuredOutputError


class GrammarCompiler:
    def __init__(self, tokenizer: Any, *, vocab_size: int | None = None,
                 eos_token_ids: Sequence[int] | None = None, cache_size: int = 256,
                 compile_timeout_s: float = 2.0, limits: StructuredLimits | None = None,
                 num_threads: int = 2) -> None:
        """`tokenizer`: the model's Hugging Face (fast) tokenizer, or an llguidance
        LLTokenizer. `vocab_size`: the width of the model's logits when it differs from
        the tokenizer's (tokens past the tokenizer's are never allowed). `eos_token_ids`:
        the tokens that end a request (default: the tokenizer's EOS)."""
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        if not compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if isinstance(tokenizer, llguidance.LLTokenizer):
            assert vocab_size is None and eos_token_ids is None
            self.tokenizer = tokenizer
        else:
            eos = list(eos_token_ids) if eos_token_ids is not None else None
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                          eos_token=eos)
        self.vocab_size: int = self.tokenizer.vocab_size
        self.eos_token_ids: tuple[int, ...] = tuple(self.tokenizer.eos_tokens)
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self.limits = limits or StructuredLimits()
        self._parser_limits = self.limits.parser_limits()

        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, _Outcome] = OrderedDict()
        self._in_flight: dict[StructuredOutput, _Job] = {}
        self._hits = self._misses = self._compiles = self._refused = 0
        self._timeouts = self._evictions = 0
        self._compile_s = 0.0
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._deadlines: list[tuple[float, int, Future[CompiledGrammar], str]] = []
        self._deadline_seq = itertools.count()
        self._deadline_changed = threading.Condition(self._lock)
        self._closed = False
        self._workers = [self._start(self._work, f"grammar-compile-{i}", WORKER_STACK_BYTES)
                         for i in range(num_threads)]
        self._watcher = self._start(self._watch_deadlines, "grammar-deadlines", 0)

    # ------------------------------------------------------------------ the interface

    def compile_async(self, spec: StructuredOutput) -> Future[CompiledGrammar]:
        """A future of the compiled grammar; never blocks. It resolves within
        compile_timeout_s: with the grammar, a StructuredOutputError, or a
        GrammarTimeoutError. A cached spec comes back already resolved."""
        future: Future[CompiledGrammar] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is closed")
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                self._hits += 1
                _resolve(future, cached)
                return future
            self._misses += 1
            job = self._in_flight.get(spec)
            if job is None:
                job = self._in_flight[spec] = _Job(spec, [])
                self._compiles += 1
                self._jobs.put(job)
            job.waiters.append(future)
            message = (f"the {spec.describe()} did not compile within "
                       f"{self.compile_timeout_s:g} s (compile_timeout_s)")
            heapq.heappush(self._deadlines, (time.monotonic() + self.compile_timeout_s,
                                             next(self._deadline_seq), future, message))
            self._deadline_changed.notify()
        return future

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """compile_async, waited for (at most compile_timeout_s); raises its error."""
        return self.compile_async(spec).result()

    def cached(self, spec: StructuredOutput) -> CompiledGrammar | None:
        """The grammar if it is cached already (a refusal or a miss: None); not counted."""
        with self._lock:
            outcome = self._cache.get(spec)
        return outcome if isinstance(outcome, CompiledGrammar) else None

    def stats(self) -> GrammarCacheStats:
        with self._lock:
            return GrammarCacheStats(
                hits=self._hits, misses=self._misses, num_compiles=self._compiles,
                num_refused=self._refused, num_timeouts=self._timeouts,
                num_evictions=self._evictions, compile_s=self._compile_s,
                num_cached=len(self._cache), cache_size=self.cache_size,
                num_in_flight=len(self._in_flight))

    def close(self) -> None:
        """Stop the threads; compiles still queued are refused as timed out."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._deadline_changed.notify()
        for _ in self._workers:
            self._jobs.put(None)

    # ------------------------------------------------------------------ the workers

    @staticmethod
    def _start(target: Any, name: str, stack_bytes: int) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        # threading.stack_size applies to threads started after it: set it around our start.
        with _thread_start_lock:
            previous = threading.stack_size(stack_bytes) if stack_bytes else None
            try:
                thread.start()
            finally:
                if previous is not None:
                    threading.stack_size(previous)
        return thread

    def _work(self) -> None:
        scratch = np.zeros((1, num_bitmask_words(self.vocab_size)), dtype=np.int32)
        while (job := self._jobs.get()) is not None:
            start = time.perf_counter()
            try:
                outcome: _Outcome = self._build(job.spec, scratch)
            except Exception as exc:  # a bug (ours or the library's): not cached
                log.exception("compiling a %s failed", job.spec.describe())
                self._finish(job, None, exc, time.perf_counter() - start)
                continue
            self._finish(job, outcome, None, time.perf_counter() - start)

    def _build(self, spec: StructuredOutput, scratch: np.ndarray) -> _Outcome:
        start = time.perf_counter()
        try:
            grammar = to_grammar(spec, self.limits)
        except StructuredOutputError as e:
            return e
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                        limits=self._parser_limits)
        if template.is_error():
            return library_refusal(template.get_error(), spec.describe(), self.limits)
        # The first mask, on a copy: llguidance builds its lexer lazily, and a grammar whose
        # first step runs out of a step budget is refused here rather than mid-request.
        probe = template.deep_copy()
        llguidance.numpy.fill_next_token_bitmask(probe, scratch, 0)
        if probe.is_error():
            return library_refusal(probe.get_error(), spec.describe(), self.limits)
        return CompiledGrammar(spec, self.vocab_size, time.perf_counter() - start, template)

    def _finish(self, job: _Job, outcome: _Outcome | None, bug: Exception | None,
                seconds: float) -> None:
        with self._lock:
            del self._in_flight[job.spec]
            self._compile_s += seconds
            if outcome is not None:
                if isinstance(outcome, StructuredOutputError):
                    self._refused += 1
                self._cache[job.spec] = outcome
                self._cache.move_to_end(job.spec)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
                    self._evictions += 1
            waiters = job.waiters
        for future in waiters:
            if outcome is not None:
                _resolve(future, outcome)
            else:
                assert bug is not None
                _settle(future, exception=bug)

    def _watch_deadlines(self) -> None:
        closed = False
        while not closed:
            expired: list[tuple[Future[CompiledGrammar], str]] = []
            with self._lock:
                while True:
                    now = time.monotonic()
                    while self._deadlines and (self._closed or self._deadlines[0][0] <= now):
                        _, _, future, message = heapq.heappop(self._deadlines)
                        if not future.done():
                            expired.append((future, message))
                    closed = self._closed
                    if expired or closed:
                        break
                    timeout = self._deadlines[0][0] - now if self._deadlines else None
                    self._deadline_changed.wait(timeout)
            # Outside the lock: a future's callbacks may call compile_async.
            num_timeouts = sum(_settle(future, exception=GrammarTimeoutError(message))
                               for future, message in expired)
            with self._lock:
                self._timeouts += num_timeouts


def _resolve(future: Future[CompiledGrammar], outcome: _Outcome) -> None:
    if isinstance(outcome, StructuredOutputError):
        _settle(future, exception=outcome.clone())
    else:
        _settle(future, result=outcome)


def _settle(future: Future[CompiledGrammar], *, result: CompiledGrammar | None = None,
            exception: BaseException | None = None) -> bool:
    """Resolve `future` unless its deadline (or its owner, cancelling) got there first."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            assert result is not None
            future.set_result(result)
    except InvalidStateError:
        return False
    return True
