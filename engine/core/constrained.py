"""Structured outputs in the engine core: the grammar compiler, the matchers of the live
constrained requests, and what a step does for their rows.

A step with constrained rows masks them after the forward and before sampling (in place,
so the one-by-one sampling path after a sampling failure sees the masks too), samples,
then advances each row's matcher by its token. Rows of free requests are never written.

NOTE: callers test `live` before calling in: a step without constrained requests does no
per-row work and allocates nothing for them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from engine.config import EngineConfig
from engine.core.sampler import SampleResult
from engine.core.state import Request
from engine.structured import (
    CompiledGrammar,
    GrammarCacheStats,
    GrammarCompiler,
    GrammarMatcher,
    TokenMasker,
)

log = logging.getLogger("loraplex.engine")


class GrammarRefusedToken(RuntimeError):
    """The sampled token is one the request's grammar refuses: the mask and the matcher
    disagree (a bug), or the matcher had failed (a budget exhausted)."""


class ConstrainedDecoding:
    def __init__(self, config: EngineConfig, tokenizer: object, vocab_size: int,
                 eos_token_ids: Iterable[int]) -> None:
        """tokenizer: the model's Hugging Face tokenizer; vocab_size: the logits' width."""
        self.config = config
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = sorted(set(eos_token_ids))
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None
        self._masker: TokenMasker | None = None
        self.live: dict[str, Request] = {}  # constrained requests admitted, not finished
        self.num_admitted = 0  # constrained requests admitted, cumulative

    @property
    def has_compiler(self) -> bool:
        return self._compiler is not None

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on first use (half a second for a 50k vocabulary); any thread."""
        with self._lock:
            if self._compiler is None:
                config = self.config
                self._compiler = GrammarCompiler(
                    self._tokenizer, vocab_size=self.vocab_size,
                    eos_token_ids=self._eos_token_ids or None,
                    cache_size=config.grammar_cache_size,
                    compile_timeout_s=config.grammar_compile_timeout_s,
                    num_threads=config.grammar_compile_threads,
                )
            return self._compiler

    def stats(self) -> GrammarCacheStats | None:
        """None until the first structured request or check."""
        compiler = self._compiler
        return None if compiler is None else compiler.stats()

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()

    def bind(self, request: Request, grammar: CompiledGrammar | None = None) -> None:
        """Give a constrained request its own matcher. Without `grammar`, compile its spec
        (on the compiler's threads, waited for: raises StructuredOutputError)."""
        spec = request.sampling.structured
        if spec is None:
            return
        if grammar is None:
            grammar = self.compiler.compile(spec)
        assert grammar.spec == spec, "the grammar was compiled for another spec"
        request.matcher = grammar.new_matcher()
        self.live[request.request_id] = request
        self.num_admitted += 1

    def unbind(self, request: Request) -> None:
        if request.matcher is not None:
            self.live.pop(request.request_id, None)

    @property
    def masker(self) -> TokenMasker:
        if self._masker is None:
            self._masker = TokenMasker(self.compiler.vocab_size,
                                       max_rows=self.config.max_num_seqs,
                                       num_threads=self.config.grammar_mask_threads)
        return self._masker

    def mask(self, logits: Tensor, requests: Sequence[Request]
             ) -> list[tuple[Request, BaseException]]:
        """In place: each constrained row of logits [S, V] (row i: requests[i]) keeps only
        the tokens its grammar allows next. Returns the requests whose mask failed (their
        rows are left unmasked: their samples must be dropped)."""
        rows = [i for i, r in enumerate(requests) if r.matcher is not None]
        if not rows:
            return []
        matchers = [_matcher(requests[i]) for i in rows]
        # The runner's logits are inference tensors: only inference mode writes them.
        with torch.inference_mode():
            try:
                self.masker(logits, rows, matchers)
                return []
            except Exception as exc:
                log.warning("masking %d constrained rows failed, retrying one by one: %r",
                            len(rows), exc)
            failed: list[tuple[Request, BaseException]] = []
            for row, matcher in zip(rows, matchers, strict=True):
                try:
                    self.masker(logits, [row], [matcher])
                except Exception as exc:
                    failed.append((requests[row], exc))
        return failed

    def advance(self, requests: Sequence[Request], results: list[SampleResult | None],
                mask_failed: Sequence[tuple[Request, BaseException]] = ()
                ) -> list[tuple[Request, BaseException]]:
        """Feed each constrained request its sampled token. A request whose mask failed or
        whose token the grammar refuses gets its result dropped (set to None) and is
        returned with the error, to fail alone."""
        failed = list(mask_failed)
        unmasked = {id(request) for request, _ in mask_failed}
        for i, request in enumerate(requests):
            matcher, result = request.matcher, results[i]
            if matcher is None or result is None:
                continue
            if id(request) in unmasked:
                results[i] = None
                continue
            if not matcher.accept(result.token_id):
                results[i] = None
                reason = matcher.error or "the grammar refused it"
                failed.append((request, GrammarRefusedToken(
                    f"token {result.token_id} does not follow the structured output: "
                    f"{reason}")))
        return failed


def _matcher(request: Request) -> GrammarMatcher:
    assert request.matcher is not None
    return request.matcher
