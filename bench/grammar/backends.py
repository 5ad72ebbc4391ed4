"""The two grammar libraries `loraplex bench grammar` compares, behind one small interface.

Each backend compiles a case into a reusable grammar (from the cache, the library's or ours,
when the case was compiled before; `clear_cache` forgets every compile), makes matchers (one
per request) from it, fills rows 0..len(matchers)-1 of a [B, ceil(V/32)] int32 bitmask (`fill`
through the library's batch call, `fill_serial` one matcher at a time from Python), advances
matchers by one token, rolls them back, reports how many whole tokens the grammar forces next
(`forced_tokens`: jump-forward decoding), and masks logits with the library's own helper
(`apply_bitmask`: masked-out logits become -inf, in place). A compile error surfaces as
`GrammarError` with the library's own message.
"""

from __future__ import annotations

import os
import time
from typing import Any, TypeAlias

import torch
from torch import Tensor

from bench.grammar.cases import GrammarCase, HostileCase


class GrammarError(Exception):
    """The library refused a grammar; the message is the library's."""


def ms_since(start: float) -> float:
    """Milliseconds from `start` (time.perf_counter()) to now."""
    return (time.perf_counter() - start) * 1e3


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        start = time.perf_counter()
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer,
                                                                  vocab_size=vocab_size)
        self.tokenizer_info_ms = ms_since(start)  # imports excluded
        self._num_threads = os.cpu_count() or 1
        self.clear_cache()
        self._batch = xgr.BatchGrammarMatcher(max_threads=self._num_threads)

    def clear_cache(self) -> None:
        # NOTE: a fresh compiler, not GrammarCompiler.clear_cache(): that drops every cache
        # level, so a cold figure is what a never-seen schema costs.
        self._compiler = self._xgr.GrammarCompiler(self.tokenizer_info,
                                                   max_threads=self._num_threads)

    def compile(self, case: GrammarCase | HostileCase) -> Any:
        try:
            if case.kind == "regex":
                return self._compiler.compile_regex(case.spec)
            # strict_mode=False: the schemas say additionalProperties themselves, as
            # llguidance reads them; strict mode would also forbid unlisted keys (and make
            # {"type": "object"} the empty object only).
            return self._compiler.compile_json_schema(case.spec, strict_mode=False)
        except RuntimeError as e:
            raise GrammarError(str(e).strip()) from e

    def new_matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: Tensor) -> None:
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def fill_serial(self, matchers: list[Any], bitmask: Tensor) -> None:
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)

    def accept(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return self._xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def rollback(self, matchers: list[Any], num_tokens: int) -> None:
        self._xgr.BatchGrammarMatcher.batch_rollback(matchers, num_tokens)

    def forced_tokens(self, matcher: Any) -> int:
        return len(matcher.find_jump_forward_tokens())

    def apply_bitmask(self, logits: Tensor, bitmask: Tensor) -> None:
        self._xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidanceBackend:
    """llguidance has no compile cache: "cached" is ours, a template matcher per case that
    each request deep-copies (the copy shares the built lexer and parser tables)."""

    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        # NOTE: llguidance.numpy, not llguidance.torch: the torch module wraps its apply
        # helper in torch.compile (~1.5 s to import, ~12 s of inductor on the first call
        # on this CPU, then slower than TorchBitmaskApply); the fills are the same calls.
        self._llg = llguidance
        self.vocab_size = vocab_size
        self._llg_numpy = llguidance.numpy
        start = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.tokenizer_info_ms = ms_since(start)  # imports excluded
        self._executor = llguidance.LLExecutor(num_threads=os.cpu_count() or 1)
        self._templates: dict[tuple[str, str], Any] = {}

    def clear_cache(self) -> None:
        self._templates.clear()

    def compile(self, case: GrammarCase | HostileCase) -> Any:
        key = (case.kind, case.spec)
        if key in self._templates:
            return self._templates[key]
        matcher = self._llg.LLMatcher
        grammar = matcher.grammar_from_regex(case.spec) if case.kind == "regex" \
            else matcher.grammar_from_json_schema(case.spec)
        template = matcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error())
        self._templates[key] = template
        return template

    def new_matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list[Any], bitmask: Tensor) -> None:
        self._llg_numpy.fill_next_token_bitmask_par(
            self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask.numpy())

    def fill_serial(self, matchers: list[Any], bitmask: Tensor) -> None:
        array = bitmask.numpy()
        for i, matcher in enumerate(matchers):
            self._llg_numpy.fill_next_token_bitmask(matcher, array, i)

    def accept(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return [m.consume_token(t) for m, t in zip(matchers, tokens, strict=True)]

    def rollback(self, matchers: list[Any], num_tokens: int) -> None:
        for matcher in matchers:
            matcher.rollback(num_tokens)

    def forced_tokens(self, matcher: Any) -> int:
        return len(matcher.compute_ff_tokens())

    def apply_bitmask(self, logits: Tensor, bitmask: Tensor) -> None:
        self._llg_numpy.apply_token_bitmask_inplace(logits.numpy(), bitmask.numpy())


GrammarBackend: TypeAlias = XGrammarBackend | LLGuidanceBackend


_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)  # [32]


class TorchBitmaskApply:
    """Plain torch ops, what our sampler would run: bit j of word w of row i allows token
    32 * w + j of logits row i; the rest become -inf in place.

    NOTE: single-threaded, into buffers kept between calls. A few hundred microseconds of
    work split over two threads stalls on their barrier (~30 ms) whenever another process
    holds the second core, as engine/lora/layers.py found for small LoRA segments; and a
    fresh [B, W, 32] temporary per step costs page faults."""

    def __init__(self, batch_size: int, vocab_size: int) -> None:
        words = (vocab_size + 31) // 32
        self._bits = torch.empty((batch_size, words, 32), dtype=torch.int32)  # [B, W, 32]
        self._refused = torch.empty((batch_size, words, 32), dtype=torch.bool)

    def __call__(self, logits: Tensor, bitmask: Tensor) -> None:
        rows, vocab = logits.shape  # [R, V] float32, R <= B
        assert bitmask.shape == (rows, (vocab + 31) // 32) and bitmask.dtype == torch.int32
        bits, refused = self._bits[:rows], self._refused[:rows]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            torch.bitwise_and(bitmask.unsqueeze(-1), _BITS, out=bits)
            torch.eq(bits, 0, out=refused)
            logits.masked_fill_(refused.view(rows, -1)[:, :vocab], float("-inf"))
        finally:
            torch.set_num_threads(threads)


def make_backends(hf_tokenizer: Any, vocab_size: int,
                  names: tuple[str, ...]) -> list[GrammarBackend]:
    kinds: dict[str, type[GrammarBackend]] = {"xgrammar": XGrammarBackend,
                                              "llguidance": LLGuidanceBackend}
    return [kinds[name](hf_tokenizer, vocab_size) for name in names]
