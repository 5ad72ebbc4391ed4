"""A decode loop for grammar matchers: B rows, each a request constrained by one case.

Each step fills the B rows' bitmask, applies it to a [B, V] float32 logits tensor, picks one
token per row by argmax and advances every matcher by it, timing each part. The logits are
random noise plus, for a row that follows its reference document (a valid document of the
case, tokenized by the model's tokenizer), a large bonus on that document's next token: the
mask must allow it. Any row may deviate (probability `deviate_p` per step): from then on
its bonus goes to tokens that end a string and its object or array (`"}`), then to those
that end a string, then to `}` or `]`, and to EOS, while whitespace-only tokens are
penalized, so that the mask alone decides its document, which still ends soon. A row that
emits EOS (or reaches `max_doc_tokens`) has its document decoded and checked; a fresh
request of the same case takes its place, so the batch stays full.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

from bench.grammar.backends import GrammarBackend, TorchBitmaskApply, ms_since
from bench.grammar.cases import GrammarCase
from bench.harness.workload import percentile
from engine.core.detokenizer import TokenTexts

_FOLLOW_BONUS = 1e4
# A deviated row's bonus of a token by (it holds `"`, it holds `}` or `]`): `"}` ends a
# string and its object where allowed.
_CLOSING_BONUS = {(True, True): 6.0, (True, False): 4.0, (False, True): 2.0, (False, False): 0.0}
_EOS_BONUS = 8.0
_WHITESPACE_PENALTY = -8.0
_NOISE_POOL = 8
_MAX_FAILURES = 5
T = TypeVar("T")


@dataclass(slots=True)
class Stats:
    """Milliseconds over n samples."""

    n: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float

    @classmethod
    def of(cls, samples_ms: list[float]) -> Stats:
        ordered = sorted(samples_ms)
        return cls(len(ordered), percentile(ordered, 50), percentile(ordered, 99),
                   ordered[-1] if ordered else float("nan"),
                   statistics.fmean(ordered) if ordered else float("nan"))


@dataclass(slots=True)
class Document:
    case: str
    kind: str  # the case's kind: "json_schema" | "json_object" | "regex"
    text: str
    num_tokens: int  # EOS not counted
    deviated: bool  # some of its tokens were picked by the mask alone
    finished: bool  # ended with EOS within max_doc_tokens
    error: str | None  # None: a valid document of its case


@dataclass(slots=True)
class Overlap:
    """Mask filling in a thread while the main thread runs a decode-sized matmul."""

    matmul_shape: str
    fill_alone: Stats
    matmul_alone: Stats
    fill_in_thread: Stats  # the fill's own duration while the matmul ran
    matmul_overlapped: Stats  # the matmul's duration while the fill ran
    wall_overlapped: Stats  # thread start to join: ~max(fill, matmul) if both run at once


@dataclass(slots=True)
class BatchRun:
    library: str
    workload: str  # "mixed" (rows over every case) or one case's name
    round: int  # mixed runs alternate the libraries round by round
    batch_size: int
    num_steps: int
    fill: Stats  # the library's batch call, one step = all rows
    accept: Stats  # advancing every row's matcher by its token
    apply_torch: Stats  # TorchBitmaskApply on [B, V] float32
    apply_library: Stats  # the library's own helper on the same tensor
    fill_serial: Stats | None = None  # one matcher at a time from Python (mixed only)
    rollback: Stats | None = None  # every unfinished row by one token (mixed only)
    forced: Stats | None = None  # jump-forward query of every row (mixed only)
    forced_rows_pct: float | None = None  # rows where the grammar forced a continuation
    overlap: Overlap | None = None  # mixed only
    num_rejected_reference: int = 0  # the mask refused a valid document's next token
    num_rejected_accept: int = 0  # the matcher refused a token its own mask allowed
    num_apply_mismatch: int = 0  # steps where the library helper and ours disagreed
    documents: list[Document] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # the first few, for the table


@dataclass(slots=True)
class _Row:
    case: GrammarCase
    compiled: Any
    matcher: Any
    reference: list[int]  # a valid document's tokens, then EOS
    generated: list[int] = field(default_factory=list)
    deviated: bool = False


@dataclass(slots=True)
class DriveOptions:
    batch_size: int = 32
    num_steps: int = 256
    deviate_p: float = 0.03
    max_doc_tokens: int = 512
    seed: int = 0
    extras: bool = False  # serial fill, rollback, jump-forward, overlap with a matmul
    matmul_hidden: int = 576  # the overlap's [B, H] x [H, V]


class Driver:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_id: int) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos = eos_token_id
        texts, special = TokenTexts(hf_tokenizer), set(hf_tokenizer.all_special_ids)
        # Each token's bytes; None for special tokens.
        self.token_bytes = [None if t in special else texts.token_bytes(t)
                            for t in range(vocab_size)]
        # NOTE: whitespace is legal between any two JSON tokens, so a deviated row without
        # the penalty can loop on it until max_doc_tokens.
        closing = torch.zeros(vocab_size)
        for token_id, piece in enumerate(self.token_bytes):
            if piece is not None:
                ends = (b'"' in piece, b"}" in piece or b"]" in piece)
                closing[token_id] = _CLOSING_BONUS[ends] if piece.strip() else _WHITESPACE_PENALTY
        closing[eos_token_id] = _EOS_BONUS
        self.closing_bias = closing  # [V]

    def decode(self, tokens: list[int]) -> tuple[str, str | None]:
        """The text, and why it is no document (a special token, bad UTF-8) or None."""
        pieces = [self.token_bytes[t] for t in tokens]
        if any(p is None for p in pieces):
            return "", "holds a special token"
        raw = b"".join(p for p in pieces if p is not None)
        try:
            return raw.decode(), None
        except UnicodeDecodeError as e:
            return raw.decode(errors="replace"), f"not UTF-8: {e}"

    def _new_row(self, case: GrammarCase, compiled: Any, backend: GrammarBackend,
                 rng: random.Random) -> _Row:
        assert case.make_document is not None
        reference = self.hf_tokenizer.encode(case.make_document(rng), add_special_tokens=False)
        return _Row(case, compiled, backend.new_matcher(compiled), [*reference, self.eos])

    def run(self, backend: GrammarBackend, workload: str, cases: list[GrammarCase],
            options: DriveOptions, round_: int = 0) -> BatchRun:
        """`cases[i % len(cases)]` constrains row i; each case compiled once (cached).

        After `num_steps` timed steps the rows still open run on, untimed and not replaced,
        until each has ended, so that every mask of the run has its document checked."""
        rng = random.Random(options.seed)
        generator = torch.Generator().manual_seed(options.seed)
        batch, vocab = options.batch_size, self.vocab_size
        compiled = {case.name: backend.compile(case) for case in cases}
        rows: list[_Row | None] = [
            self._new_row(cases[i % len(cases)], compiled[cases[i % len(cases)].name],
                          backend, rng) for i in range(batch)]
        noise = [torch.randn((batch, vocab), generator=generator) for _ in range(_NOISE_POOL)]
        bitmask = torch.zeros((batch, (vocab + 31) // 32), dtype=torch.int32)  # [B, W]
        spare = torch.zeros_like(bitmask)
        apply_torch = TorchBitmaskApply(batch, vocab)
        hidden = torch.randn((batch, options.matmul_hidden), generator=generator)  # [B, H]
        head = torch.randn((options.matmul_hidden, vocab), generator=generator)  # [H, V]
        times: defaultdict[str, list[float]] = defaultdict(list)  # milliseconds
        empty = Stats.of([])
        run = BatchRun(backend.name, workload, round_, batch, options.num_steps,
                       fill=empty, accept=empty, apply_torch=empty, apply_library=empty)
        forced_rows = 0

        step = 0
        while any(row is not None for row in rows):
            timed = step < options.num_steps
            extras = timed and options.extras
            live = [i for i, row in enumerate(rows) if row is not None]
            open_rows = [row for row in rows if row is not None]
            matchers = [row.matcher for row in open_rows]
            # Untimed (draining) steps time into a scratch dict.
            log = times if timed else defaultdict(list)
            if timed:
                _timed(times["fill"], backend.fill, matchers, bitmask)
            else:
                # Draining: the loop, as the batch calls' thread pools stall on a busy machine.
                backend.fill_serial(matchers, bitmask)
            if extras:
                _timed(times["fill_serial"], backend.fill_serial, matchers, spare)
                self._overlap(backend, matchers, spare, hidden, head, times)

            # A random roll of pooled noise: fresh enough that deviated rows do not cycle.
            shift = rng.randrange(vocab)
            logits = noise[step % _NOISE_POOL][: len(open_rows)].roll(shift, 1)  # [R, V]
            deviated = [i for i, row in enumerate(open_rows) if row.deviated]
            following = [i for i, row in enumerate(open_rows) if not row.deviated]
            logits[deviated] += self.closing_bias
            logits[following, [open_rows[i].reference[len(open_rows[i].generated)]
                               for i in following]] = _FOLLOW_BONUS
            by_library = logits.clone() if timed else None
            mask = bitmask[: len(open_rows)]
            _timed(log["apply_torch"], apply_torch, logits, mask)
            if by_library is not None:
                _timed(times["apply_library"], backend.apply_bitmask, by_library, mask)
                if not torch.equal(torch.isinf(logits), torch.isinf(by_library)):
                    run.num_apply_mismatch += 1
            tokens: list[int] = logits.argmax(dim=-1).tolist()

            for i, row in enumerate(open_rows):
                if not row.deviated and tokens[i] != row.reference[len(row.generated)]:
                    run.num_rejected_reference += 1
                    _note(run, f"{row.case.name}: mask refused reference token "
                               f"{row.reference[len(row.generated)]} at {len(row.generated)}")
                    row.deviated = True
            accepted = _timed(log["accept"], backend.accept, matchers, tokens)

            if extras:
                going = [i for i, t in enumerate(tokens) if t != self.eos and accepted[i]]
                start = time.perf_counter()
                backend.rollback([matchers[i] for i in going], 1)
                times["rollback"].append(ms_since(start))
                again = backend.accept([matchers[i] for i in going], [tokens[i] for i in going])
                assert all(again), "a matcher refused a token it accepted before its rollback"
                start = time.perf_counter()
                forced_rows += sum(backend.forced_tokens(matchers[i]) > 0 for i in going)
                times["forced"].append(ms_since(start))

            for j, (i, row) in enumerate(zip(live, open_rows, strict=True)):
                if self._advance(run, row, tokens[j], accepted[j], options, rng):
                    # Past the timed steps, ended rows are not replaced: the batch drains.
                    rows[i] = self._new_row(row.case, row.compiled, backend, rng) if timed \
                        else None
            step += 1

        run.fill, run.accept = Stats.of(times["fill"]), Stats.of(times["accept"])
        run.apply_torch = Stats.of(times["apply_torch"])
        run.apply_library = Stats.of(times["apply_library"])
        if options.extras:
            run.fill_serial = Stats.of(times["fill_serial"])
            run.rollback, run.forced = Stats.of(times["rollback"]), Stats.of(times["forced"])
            run.forced_rows_pct = 100 * forced_rows / (batch * options.num_steps)
            run.overlap = Overlap(
                f"[{batch}, {options.matmul_hidden}] x [{options.matmul_hidden}, {vocab}]",
                run.fill, *(Stats.of(times[key]) for key in (
                    "matmul_alone", "fill_in_thread", "matmul_overlapped", "wall")))
        for doc in run.documents:
            if doc.error is not None:
                _note(run, f"{doc.case}: {doc.error}: {doc.text[:80]!r}")
        return run

    def _advance(self, run: BatchRun, row: _Row, token: int, accepted: bool,
                 options: DriveOptions, rng: random.Random) -> bool:
        """The row's matcher took `token` (or refused it); True when the row is done."""
        if not accepted:
            run.num_rejected_accept += 1
            _note(run, f"{row.case.name}: matcher refused its mask's token {token}")
            return True
        if token == self.eos or len(row.generated) + 1 >= options.max_doc_tokens:
            run.documents.append(self._document(row, token))
            return True
        row.generated.append(token)
        if not row.deviated and rng.random() < options.deviate_p:
            row.deviated = True
        return False

    def _document(self, row: _Row, last_token: int) -> Document:
        finished = last_token == self.eos
        tokens = row.generated if finished else [*row.generated, last_token]
        text, error = self.decode(tokens)
        if error is None:
            error = row.case.check(text) if finished else "no EOS within max_doc_tokens"
        return Document(row.case.name, row.case.kind, text, len(tokens), row.deviated,
                        finished, error)

    @staticmethod
    def _overlap(backend: GrammarBackend, matchers: list[Any], bitmask: Tensor,
                 hidden: Tensor, head: Tensor, times: dict[str, list[float]]) -> None:
        _timed(times["matmul_alone"], torch.mm, hidden, head)
        thread = threading.Thread(target=_timed, args=(times["fill_in_thread"], backend.fill,
                                                       matchers, bitmask))
        start = time.perf_counter()
        thread.start()
        torch.mm(hidden, head)
        times["matmul_overlapped"].append(ms_since(start))
        thread.join()
        times["wall"].append(ms_since(start))


def _timed(samples: list[float], call: Callable[..., T], *args: Any) -> T:
    """`call(*args)`, its milliseconds appended to `samples`."""
    start = time.perf_counter()
    result = call(*args)
    samples.append(ms_since(start))
    return result


def _note(run: BatchRun, failure: str) -> None:
    if len(run.failures) < _MAX_FAILURES:
        run.failures.append(failure)
