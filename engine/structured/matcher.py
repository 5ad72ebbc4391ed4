"""Per-request grammar state, and the batch operation a step runs over the constrained rows.

A `GrammarMatcher` belongs to one request and is used by one thread at a time (the engine
loop's). `TokenMasker` fills the bitmask of a step's constrained rows in one llguidance
call (it releases the GIL, so it can run beside the forward pass) and applies it to just
those rows of the logits: refused tokens become -inf, and the rows of unconstrained
requests are left as they are, bit for bit.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import llguidance
import llguidance.numpy
import torch
from torch import Tensor

from engine.structured.limits import clean_message
from engine.structured.spec import StructuredOutput

assert sys.byteorder == "little", "the bitmask is read byte by byte as little-endian words"


def num_bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    """One spec's grammar, built once and shared read-only; every request that uses it
    gets its own matcher from `new_matcher`."""

    spec: StructuredOutput
    vocab_size: int
    compile_s: float  # building it: the worker's wall time, queueing excluded
    _template: llguidance.LLMatcher = field(repr=False)  # never advanced: only copied
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def new_matcher(self) -> GrammarMatcher:
        with self._lock:
            return GrammarMatcher(self._template.deep_copy(), self)


class GrammarMatcher:
    """Where one request's output stands in its grammar.

    llguidance never raises for a refused token or an exhausted budget: the matcher enters
    an error state (`error`), and from then on its mask allows EOS only, so a request whose
    matcher failed ends at its next token.
    """

    __slots__ = ("_matcher", "grammar", "num_tokens")

    def __init__(self, matcher: llguidance.LLMatcher, grammar: CompiledGrammar) -> None:
        self._matcher = matcher
        self.grammar = grammar
        self.num_tokens = 0  # tokens accepted and not rolled back

    @property
    def llg(self) -> llguidance.LLMatcher:
        """The library's matcher (for llguidance's batch calls)."""
        return self._matcher

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a refused token, a budget exhausted); None while fine."""
        if not self._matcher.is_error():
            return None
        return clean_message(self._matcher.get_error()) or "the grammar matcher failed"

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete document: EOS is allowed now."""
        return not self._matcher.is_error() and self._matcher.is_accepting()

    @property
    def is_finished(self) -> bool:
        """Complete, and nothing but EOS can follow (or EOS was accepted): the request can
        stop here without sampling."""
        return not self._matcher.is_error() and self._matcher.is_stopped()

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token (EOS included). False: the grammar refuses it and
        the matcher is now in its error state."""
        if self._matcher.consume_token(token_id):
            self.num_tokens += 1
            return True
        return False

    def accept_prefix(self, token_ids: Sequence[int]) -> int:
        """Advance by as many of `token_ids` as the grammar allows (draft tokens); returns
        how many. A refused token does not put the matcher in its error state."""
        accepted = self._matcher.try_consume_tokens(list(token_ids))
        self.num_tokens += accepted
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative tokens, text cut
        by a stop string)."""
        assert 0 <= num_tokens <= self.num_tokens, (
            f"cannot roll back {num_tokens} of {self.num_tokens} tokens")
        if num_tokens:
            ok = self._matcher.rollback(num_tokens)
            assert ok, self._matcher.get_error()
            self.num_tokens -= num_tokens

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, whatever the model says (jump-forward)."""
        return self._matcher.compute_ff_tokens()

    def fill_bitmask(self, bitmask: Tensor, row: int = 0) -> None:
        """Row `row` of an int32 CPU bitmask [B, ceil(V/32)]: bit j of word w allows token
        32 * w + j next."""
        assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask.numpy(), row)


def _refusal_table(device: torch.device) -> Tensor:
    """[256, 8] bool: bit b of byte value v is 0, i.e. that token is refused."""
    values = torch.arange(256, dtype=torch.int32)[:, None]
    bits = torch.arange(8, dtype=torch.int32)[None, :]
    return ((values >> bits) & 1).eq(0).to(device)


class TokenMasker:
    """The constrained rows of one step: their bitmask, filled in one batch call, and the
    logits they refuse set to -inf, in place.

    `num_threads`: llguidance's batch fill on a pool of that many threads (None: its
    default, 80% of the CPUs); 1: the matchers one after another on the calling thread.

    NOTE: on a small, busy machine the pool does not pay: on 2 shared cores, 16 fresh
    rows took 1.3 ms p50 through it against 1.1 ms one by one (docs/BENCHMARKS.md: the
    same for 32 rows of the benchmark's loop). It pays where cores are free.

    NOTE: our own unpacking rather than llguidance.torch's apply helper: that one masks
    whole batches, not chosen rows, and goes through torch.compile (seconds to import and
    to compile on the first call, then slower than this on the CPU; docs/BENCHMARKS.md).

    NOTE: the bitmask and the refusal buffers are kept between steps (sized for `max_rows`,
    grown if a step has more): a fresh [R, V] temporary per step costs page faults that
    are larger than the work.
    """

    def __init__(self, vocab_size: int, *, max_rows: int = 1, num_threads: int | None = None
                 ) -> None:
        assert vocab_size > 0 and max_rows > 0
        assert num_threads is None or num_threads >= 1
        self.vocab_size = vocab_size
        self.num_words = num_bitmask_words(vocab_size)
        self._executor = llguidance.LLExecutor(num_threads=num_threads) \
            if num_threads != 1 else None
        self._bitmask = torch.zeros((max_rows, self.num_words), dtype=torch.int32)  # [B, W]
        self._refused = torch.empty((max_rows, 32 * self.num_words), dtype=torch.bool)
        self._tables: dict[torch.device, Tensor] = {}

    def fill(self, matchers: Sequence[GrammarMatcher]) -> Tensor:
        """The bitmask of `matchers`, row i for matchers[i]: a [R, W] int32 CPU view of a
        buffer the next fill overwrites. Each matcher may appear once."""
        rows = len(matchers)
        if rows > self._bitmask.shape[0]:
            self._bitmask = torch.zeros((rows, self.num_words), dtype=torch.int32)
            self._refused = torch.empty((rows, 32 * self.num_words), dtype=torch.bool)
        bitmask = self._bitmask[:rows]
        if rows:
            assert len({id(m) for m in matchers}) == rows, "a matcher appears twice"
            assert all(m.grammar.vocab_size == self.vocab_size for m in matchers)
            array = bitmask.numpy()
            if self._executor is None:
                for i, matcher in enumerate(matchers):
                    llguidance.numpy.fill_next_token_bitmask(matcher.llg, array, i)
            else:
                llguidance.numpy.fill_next_token_bitmask_par(
                    self._executor, [(m.llg, i) for i, m in enumerate(matchers)], array)
        return bitmask

    def apply(self, logits: Tensor, rows: Sequence[int], bitmask: Tensor) -> None:
        """In place: logits[rows[i], t] = -inf for every token t that bitmask row i refuses,
        and for every column at or past the vocabulary (a model's padded logits). Other
        rows are not written.

        logits: [N, V] float, V >= vocab_size; bitmask: [len(rows), W] int32 from fill."""
        num_rows, width = logits.shape
        assert width >= self.vocab_size, f"logits have {width} columns, the vocabulary " \
                                         f"{self.vocab_size}"
        assert bitmask.shape == (len(rows), self.num_words) and bitmask.dtype == torch.int32
        if not rows:
            return
        assert len(set(rows)) == len(rows) and min(rows) >= 0 and max(rows) < num_rows
        if logits.device.type != "cpu":
            self._apply(logits, rows, bitmask)
            return
        # NOTE: one thread. The work is a few hundred microseconds; split over two threads
        # it stalls on their barrier (10-30 ms) whenever another process holds a core.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._apply(logits, rows, bitmask)
        finally:
            torch.set_num_threads(threads)

    def _apply(self, logits: Tensor, rows: Sequence[int], bitmask: Tensor) -> None:
        width, columns = logits.shape[1], self.vocab_size
        refused = self._unpack(bitmask, logits.device)  # [R, 32W] bool
        start = 0
        # One masked_fill_ per run of consecutive rows: a loop over rows, never over tokens.
        for end in range(1, len(rows) + 1):
            if end < len(rows) and rows[end] == rows[end - 1] + 1:
                continue
            first, last = rows[start], rows[end - 1] + 1
            block = logits[first:last]  # [run, V], a view
            block[:, :columns].masked_fill_(refused[start:end, :columns], float("-inf"))
            if width > columns:
                block[:, columns:] = float("-inf")
            start = end

    def __call__(self, logits: Tensor, rows: Sequence[int],
                 matchers: Sequence[GrammarMatcher]) -> None:
        """fill, then apply: matchers[i] constrains logits row rows[i]."""
        assert len(rows) == len(matchers)
        self.apply(logits, rows, self.fill(matchers))

    def _unpack(self, bitmask: Tensor, device: torch.device) -> Tensor:
        """[R, W] int32 -> [R, 32W] bool, True where the token is refused: byte k of word
        w holds tokens 32w + 8k ... 32w + 8k + 7 (little-endian), one table row per byte."""
        rows = bitmask.shape[0]
        table = self._tables.get(device)
        if table is None:
            table = self._tables[device] = _refusal_table(device)
        data = bitmask.contiguous().view(torch.uint8).view(-1)  # [R * 4W]
        index = data.to(device, non_blocking=True).int()
        if device.type == "cpu":
            if rows > self._refused.shape[0]:
                self._refused = torch.empty((rows, 32 * self.num_words), dtype=torch.bool)
            out = self._refused[:rows]
            torch.index_select(table, 0, index, out=out.view(-1, 8))
            return out
        return torch.index_select(table, 0, index).view(rows, -1)
