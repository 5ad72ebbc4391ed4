"""`loraplex bench grammar`: xgrammar vs llguidance for grammar-constrained decoding.

For each library, with the model's own tokenizer (SmolLM2: vocabulary 49,152):

- the tokenizer info built from the Hugging Face tokenizer, once;
- compile time of every case in `bench/grammar/cases.py` (JSON schemas, JSON object mode,
  regexes): cold (caches dropped first) and cached (the same case again), p50/p99 over
  `compile_runs`, and the first mask of a fresh matcher after each (llguidance builds its
  lexer lazily, so part of its compile shows there);
- a decode loop (`bench/grammar/driver.py`, every document it finishes checked) of
  `batch_size` rows over every case at once ("mixed") and, unless `case_steps` is 0, of every
  case alone; the mixed run also times the serial fill, a one-token rollback, the
  jump-forward query, and the fill from a thread beside a decode-sized matmul (does the
  library release the GIL?);
- hostile grammars (`bench/grammar/hostile.py`), each in a worker subprocess under a
  deadline: compile time, or the library's error, or the timeout.
"""

from __future__ import annotations

import importlib.metadata
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from bench.grammar.backends import GrammarBackend, GrammarError, make_backends, ms_since
from bench.grammar.cases import CASES, GrammarCase, hostile_cases
from bench.grammar.driver import BatchRun, DriveOptions, Driver, Stats
from bench.grammar.hostile import HostileResult, run_hostile
from bench.harness.options import internal, opt
from bench.harness.report import ReportHead, machine_description, save_report
from engine.config import default_data_dir
from engine.models.loader import load_model_config, resolve_model_dir

LIBRARIES = ("xgrammar", "llguidance")


@dataclass(slots=True)
class GrammarOptions:
    model: str = "default"
    libraries: tuple[str, ...] = opt(LIBRARIES, flag="--library", choices=LIBRARIES)
    batch_size: int = 32
    steps: int = opt(256, "timed decode steps, mixed run")
    case_steps: int = opt(96, "timed decode steps of each case alone (0: none)")
    compile_runs: int = 10  # cold and cached compiles of each case
    repeats: int = opt(2, "mixed runs per library, alternating libraries")
    hostile_timeout_s: float = opt(
        30.0, "seconds per hostile grammar before its worker is killed")
    seed: int = 0
    # 16 mixed steps, one round, no per-case runs, 2 compile runs, three hostile cases with
    # 3 s each, run alongside the rest.
    quick: bool = opt(False, "a short run that checks everything works")
    output: Path | None = opt(None, "JSON report", shown="bench/results/grammar-<timestamp>.json")
    quiet: bool = internal(False)

    def effective(self) -> GrammarOptions:
        if not self.quick:
            return self
        return replace(self, steps=min(self.steps, 16), case_steps=0,
                       compile_runs=min(self.compile_runs, 2), repeats=1,
                       hostile_timeout_s=min(self.hostile_timeout_s, 3.0))


@dataclass(slots=True)
class LibraryInfo:
    name: str
    version: str
    requires: list[str]  # declared runtime dependencies, extras left out
    tokenizer_info_ms: float  # building its tokenizer info from the HF tokenizer

    @classmethod
    def of(cls, backend: GrammarBackend) -> LibraryInfo:
        requires = importlib.metadata.requires(backend.name) or []
        return cls(backend.name, importlib.metadata.version(backend.name),
                   [r for r in requires if "extra ==" not in r], backend.tokenizer_info_ms)


@dataclass(slots=True)
class CompileResult:
    library: str
    case: str
    kind: str
    cold: Stats | None = None  # None when the library refused the case
    cached: Stats | None = None
    first_mask_cold: Stats | None = None  # a fresh matcher's first mask after a cold compile
    first_mask_cached: Stats | None = None
    error: str | None = None


@dataclass(slots=True)
class GrammarReport(ReportHead):
    torch_threads: int
    vocab_size: int
    libraries: list[LibraryInfo]
    compiles: list[CompileResult]
    batches: list[BatchRun]
    hostile: list[HostileResult] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def measure_compiles(backend: GrammarBackend, case: GrammarCase, runs: int) -> CompileResult:
    bitmask = torch.zeros((1, (backend.vocab_size + 31) // 32), dtype=torch.int32)
    samples: dict[str, list[float]] = {k: [] for k in ("cold", "cached", "mask cold",
                                                       "mask cached")}
    for _ in range(runs):
        for state in ("cold", "cached"):
            if state == "cold":
                backend.clear_cache()
            start = time.perf_counter()
            try:
                compiled = backend.compile(case)
            except GrammarError as e:
                return CompileResult(backend.name, case.name, case.kind, error=str(e))
            samples[state].append(ms_since(start))
            matcher = backend.new_matcher(compiled)
            start = time.perf_counter()
            backend.fill([matcher], bitmask)
            samples[f"mask {state}"].append(ms_since(start))
    cold, cached, mask_cold, mask_cached = map(Stats.of, samples.values())
    return CompileResult(backend.name, case.name, case.kind, cold, cached, mask_cold, mask_cached)


def measure_hostile(options: GrammarOptions, model_dir: Path,
                    vocab_size: int) -> list[HostileResult]:
    """One worker per library: one library after the other, or in quick mode both at once."""
    cases = hostile_cases(options.quick)

    def one(name: str) -> list[HostileResult]:
        return run_hostile(name, model_dir, vocab_size, cases, options.hostile_timeout_s)

    if not options.quick:
        return [r for name in options.libraries for r in one(name)]
    with ThreadPoolExecutor(len(options.libraries)) as pool:
        return [r for results in pool.map(one, options.libraries) for r in results]


def run_grammar(options: GrammarOptions) -> GrammarReport:
    from transformers import AutoTokenizer

    options = options.effective()
    say = (lambda *_: None) if options.quiet else print
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S")
    model_dir = resolve_model_dir(options.model, default_data_dir())
    vocab_size = load_model_config(model_dir).vocab_size
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert len(hf_tokenizer) == vocab_size, (len(hf_tokenizer), vocab_size)

    # NOTE: in quick mode the hostile workers run alongside the rest, sharing its cores:
    # --quick checks that everything works, its figures are not for comparing.
    pool = ThreadPoolExecutor(1)
    hostile_future = pool.submit(measure_hostile, options, model_dir, vocab_size) \
        if options.quick else None
    backends = make_backends(hf_tokenizer, vocab_size, options.libraries)
    libraries = [LibraryInfo.of(backend) for backend in backends]
    for lib in libraries:
        say(f"{lib.name} {lib.version}: tokenizer info {lib.tokenizer_info_ms:.0f} ms")

    compiles = [measure_compiles(b, case, options.compile_runs) for b in backends
                for case in CASES]
    driver = Driver(hf_tokenizer, vocab_size, hf_tokenizer.eos_token_id)
    drive = DriveOptions(batch_size=options.batch_size, num_steps=options.steps,
                         seed=options.seed, extras=True)
    usable = {(c.library, c.case) for c in compiles if c.error is None}
    cases = {b.name: [c for c in CASES if (b.name, c.name) in usable] for b in backends}
    batches: list[BatchRun] = []
    for round_ in range(options.repeats):
        # Rotate the order, so neither library always runs right after the other.
        for backend in backends[round_ % 2:] + backends[: round_ % 2]:
            batches.append(driver.run(backend, "mixed", cases[backend.name], drive, round_))
            say(f"{backend.name}: mixed batch, round {round_ + 1} done")
    if options.case_steps:
        single = DriveOptions(batch_size=options.batch_size, num_steps=options.case_steps,
                              seed=options.seed)
        for backend in backends:
            batches.extend(driver.run(backend, c.name, [c], single) for c in cases[backend.name])

    hostile = hostile_future.result() if hostile_future is not None else \
        measure_hostile(options, model_dir, vocab_size)
    pool.shutdown()
    report = GrammarReport(
        options={k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
        machine=machine_description(), started_at=started_at,
        torch_threads=torch.get_num_threads(), vocab_size=vocab_size, libraries=libraries,
        compiles=compiles, batches=batches, hostile=hostile,
    )
    if not options.quiet:
        print_report(report)
    save_report(report.to_json(), "grammar", options.output, say=say)
    return report


# ------------------------------------------------------------------------ output


def _p(stats: Stats | None, digits: int = 2) -> str:
    return "-" if stats is None else f"{stats.p50_ms:.{digits}f} / {stats.p99_ms:.{digits}f}"


def print_report(report: GrammarReport) -> None:
    print(f"\n{report.machine}; torch threads {report.torch_threads}; vocab {report.vocab_size}")
    for lib in report.libraries:
        print(f"{lib.name} {lib.version}: tokenizer info {lib.tokenizer_info_ms:.0f} ms; "
              f"requires {', '.join(lib.requires) or 'nothing'}")
    print("\ncompile ms p50 / p99 (cold, cached) and first mask ms p50 / p99 (cold, cached)")
    print(f"{'case':<20}{'library':<12}{'cold':>18}{'cached':>18}{'mask cold':>18}"
          f"{'mask cached':>18}")
    for c in report.compiles:
        if c.error is not None:
            print(f"{c.case:<20}{c.library:<12} error: {c.error[:60]}")
            continue
        print(f"{c.case:<20}{c.library:<12}{_p(c.cold):>18}{_p(c.cached, 3):>18}"
              f"{_p(c.first_mask_cold):>18}{_p(c.first_mask_cached):>18}")
    print("\ndecode loop, ms per step p50 / p99 (one step = every row of the batch)")
    print(f"{'workload':<20}{'library':<12}{'fill':>16}{'apply torch':>16}{'apply lib':>16}"
          f"{'accept':>16}  documents valid/all (deviated)")
    for b in report.batches:
        valid = sum(d.error is None for d in b.documents)
        deviated = sum(d.deviated for d in b.documents)
        workload = f"{b.workload} r{b.round + 1}" if b.workload == "mixed" else b.workload
        print(f"{workload:<20}{b.library:<12}{_p(b.fill):>16}{_p(b.apply_torch):>16}"
              f"{_p(b.apply_library):>16}{_p(b.accept, 3):>16}  "
              f"{valid}/{len(b.documents)} ({deviated})")
        for failure in b.failures:
            print(f"    ! {failure}")
    print("\nmixed batch extras, ms p50 / p99")
    for b in report.batches:
        if b.overlap is None:
            continue
        o = b.overlap
        print(f"{b.library} r{b.round + 1}:")
        print(f"{'':<12} serial fill {_p(b.fill_serial)}, rollback 1 {_p(b.rollback, 3)}, "
              f"jump-forward query {_p(b.forced, 3)} ({b.forced_rows_pct:.0f}% rows forced)")
        print(f"{'':<12} overlap {o.matmul_shape}: fill alone {_p(o.fill_alone)}, matmul alone "
              f"{_p(o.matmul_alone)}; together wall {_p(o.wall_overlapped)} (fill "
              f"{_p(o.fill_in_thread)}, matmul {_p(o.matmul_overlapped)})")
    print("\nhostile grammars")
    for h in report.hostile:
        figures = (f"compile {h.compile_ms:.1f} ms" if h.compile_ms is not None else "")
        if h.first_mask_ms is not None:
            figures += f", first mask {h.first_mask_ms:.1f} ms"
        if h.probe_ms is not None:
            figures += f", probe {h.probe_tokens} tokens {h.probe_ms:.1f} ms"
        error = f" {h.error[:100]!r}" if h.error else ""
        print(f"{h.case:<24}{h.library:<12}{h.status:<8} {figures}{error}")
