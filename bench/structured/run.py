"""`loraplex bench structured`: what grammar-constrained rows cost a shared step, what a
grammar costs to compile, and whether SmolLM2 under a grammar answers valid documents.

- Step time: a `loraplex serve` with `num_adapters` random rank-`rank` adapters preloaded;
  `num_requests` concurrent streamed chat requests over them, every other group of
  `num_adapters` constrained by a nested JSON schema (strict), all greedy with ignore_eos
  and `max_tokens`; the same load with no constraint, alternating, `repeats` rounds each.
  Per-token figures (a grammar may end its row early): TPOT p50 of each load, of each
  half of the constrained load, and the client-side gap between consecutive tokens (the
  step time the streams see; the engine exports no step-time series).
- Compile: `engine.structured.GrammarCompiler` on the model's tokenizer, in process: cold
  (a new spec each run: one property renamed) and cached (the same spec again).
- Validity: a server with the demo adapters (trained once by `loraplex demo`, reused
  from its cache, or trained here), `schema_requests` strict json_schema requests over
  the shapes of `bench/structured/cases.py` and `tool_requests` `tool_choice: "required"`
  calls over its tool sets, sampled (temperature 0.8, a seed each); every answer is
  parsed and validated with jsonschema; failures are listed with their output.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.harness.options import internal, opt
from bench.harness.report import ReportHead, machine_description, save_report
from bench.harness.server import clean_env, loraplex_serve
from bench.harness.workload import percentile
from bench.lora import make_adapters
from bench.structured.cases import (
    LOAD_PROMPTS,
    LOAD_SCHEMA,
    chat_body,
    compile_schema,
    schema_format,
)
from bench.structured.load import ChatCall, LoadSummary, scrape_counter, send_all, stream_chat
from bench.structured.validity import Validity, run_validity, validity_adapters
from engine.config import default_data_dir
from engine.models.loader import load_model_config, resolve_model_dir

TPOT_TARGET = 1.15  # constrained / free TPOT p50 the feature is held to
_STRUCTURED = "loraplex_structured_requests_total"


@dataclass(slots=True)
class StructuredOptions:
    model: str = "default"
    num_adapters: int = opt(8, "random adapters of the step-time load (--max-loras the same)")
    rank: int = 16
    num_requests: int = opt(
        32, "concurrent streams of each load; half of the first load constrained")
    max_tokens: int = opt(64, "per stream, ignore_eos")
    repeats: int = opt(3, "rounds of each load, alternating which goes first")
    compile_runs: int = 20
    schema_requests: int = 50
    tool_requests: int = 50
    validity_concurrency: int = 8
    validity_max_tokens: int = 384
    # PEFT directories of the validity run's adapters (one sub-directory each); None: the
    # demo adapters from the demo's cache under the data directory, trained if missing.
    adapters_dir: Path | None = opt(
        None, "PEFT adapters for the validity checks",
        shown="the demo adapters, trained once if not cached",
        path={"file_okay": False, "exists": True})
    seed: int = 0
    quick: bool = opt(False, "a short run that checks everything works")
    output: Path | None = opt(
        None, "JSON report", shown="bench/results/structured-<timestamp>.json")
    quiet: bool = internal(False)

    def effective(self) -> StructuredOptions:
        if not self.quick:
            return self
        return replace(self, num_adapters=min(self.num_adapters, 2),
                       num_requests=min(self.num_requests, 8),
                       max_tokens=min(self.max_tokens, 16), repeats=1,
                       compile_runs=min(self.compile_runs, 3),
                       schema_requests=min(self.schema_requests, 4),
                       tool_requests=min(self.tool_requests, 3),
                       validity_max_tokens=min(self.validity_max_tokens, 256))


@dataclass(slots=True)
class LoadRun:
    load: str  # "constrained" | "free"
    round: int
    summary: LoadSummary
    constrained_rows: LoadSummary | None  # the constrained load's halves
    free_rows: LoadSummary | None
    structured_requests: int  # loraplex_structured_requests_total during the run


@dataclass(slots=True)
class CompileFigures:
    how: str
    tokenizer_info_ms: float  # building the compiler (llguidance's tokenizer) once
    cold_ms: dict[str, float]  # wall time of compile(), new spec each run
    cold_worker_ms: dict[str, float]  # the compile itself (CompiledGrammar.compile_s)
    cached_ms: dict[str, float]  # wall time of compile() of the same spec again


@dataclass(slots=True)
class StructuredReport(ReportHead):
    load_average_before: list[float]
    load_average_after: list[float]
    runs: list[LoadRun]
    tpot_ratio_best: float  # best constrained TPOT p50 / best free TPOT p50
    tpot_ratio_median: float  # of the medians over rounds
    # Each round's constrained / free TPOT p50 (the two ran back to back), and their
    # median: what load other work puts on a shared machine changes less within a round.
    tpot_ratio_rounds: list[float]
    tpot_ratio_paired: float
    gap_ratio_median: float
    compile: CompileFigures
    validity: Validity

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["validity"]["ok"] = self.validity.ok
        return out


# ------------------------------------------------------------------------ step time


def load_calls(opts: StructuredOptions, adapters: list[str], constrained: bool
               ) -> list[ChatCall]:
    """Request i runs on adapter i % n; groups of n alternate constrained and free, so
    every adapter has as many constrained rows as free ones."""
    calls = []
    for i in range(opts.num_requests):
        body = chat_body(adapters[i % len(adapters)], LOAD_PROMPTS[i % len(LOAD_PROMPTS)],
                          opts.max_tokens, temperature=0, ignore_eos=True)
        label = "free"
        if constrained and (i // len(adapters)) % 2 == 0:
            body["response_format"] = schema_format("profile", LOAD_SCHEMA)
            label = "constrained"
        calls.append(ChatCall(body, label))
    return calls


def run_step_time(opts: StructuredOptions, base_url: str, names: list[str],
                  say: Any) -> list[LoadRun]:
    loads = {"constrained": load_calls(opts, names, True), "free": load_calls(opts, names, False)}
    runs: list[LoadRun] = []
    # Every adapter into its slot and the schema compiled: steady state is measured.
    warm = [ChatCall(chat_body(n, "Hi", 2, temperature=0), "warm") for n in names]
    warm.append(ChatCall(chat_body(names[0], "Hi", 2, temperature=0,
                                    response_format=schema_format("p", LOAD_SCHEMA)), "warm"))
    send_all(base_url, warm, len(warm), stream_chat)
    for round_ in range(opts.repeats):
        order = ["constrained", "free"] if round_ % 2 == 0 else ["free", "constrained"]
        for load in order:
            before = scrape_counter(base_url, _STRUCTURED)
            results, wall = send_all(base_url, loads[load], opts.num_requests, stream_chat)
            after = scrape_counter(base_url, _STRUCTURED)
            halves = {label: LoadSummary.of([r for r in results if r.label == label], wall)
                      for label in ("constrained", "free") if load == "constrained"}
            run = LoadRun(load, round_, LoadSummary.of(results, wall), halves.get("constrained"),
                          halves.get("free"), int(after - before))
            runs.append(run)
            say(f"{load:>12} round {round_ + 1}: TPOT p50 "
                f"{run.summary.tpot_p50_s * 1e3:.1f} ms, gap p50 "
                f"{run.summary.gap_p50_s * 1e3:.1f} ms, "
                f"{run.summary.mean_output_tokens:.0f} tokens/request")
    return runs


def ratios(runs: list[LoadRun]) -> dict[str, Any]:
    """The report's tpot_ratio_* and gap_ratio_median fields."""
    def of(load: str, key: str) -> list[float]:
        return [getattr(r.summary, key) for r in runs if r.load == load]

    constrained, free = of("constrained", "tpot_p50_s"), of("free", "tpot_p50_s")
    rounds = [round(c / f, 3) for c, f in zip(constrained, free, strict=True)]
    return {
        "tpot_ratio_best": round(min(constrained) / min(free), 3),
        "tpot_ratio_median": round(statistics.median(constrained) / statistics.median(free), 3),
        "tpot_ratio_rounds": rounds,
        "tpot_ratio_paired": round(statistics.median(rounds), 3),
        "gap_ratio_median": round(statistics.median(of("constrained", "gap_p50_s"))
                                  / statistics.median(of("free", "gap_p50_s")), 3),
    }


# ------------------------------------------------------------------------ compile


def _stats(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(s * 1e3 for s in samples_s)
    return {"n": len(ordered), "p50": round(percentile(ordered, 50), 3),
            "p99": round(percentile(ordered, 99), 3), "max": round(ordered[-1], 3)}


def run_compiles(opts: StructuredOptions, model_dir: Path) -> CompileFigures:
    from transformers import AutoTokenizer

    from engine.structured import GrammarCompiler, StructuredOutput

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = load_model_config(model_dir).vocab_size
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab_size=vocab_size)
    info_ms = (time.perf_counter() - start) * 1e3
    cold, worker, cached = [], [], []  # seconds
    try:
        for i in range(opts.compile_runs):
            spec = StructuredOutput.json_schema(compile_schema(i), strict=True)
            start = time.perf_counter()
            grammar = compiler.compile(spec)
            cold.append(time.perf_counter() - start)
            worker.append(grammar.compile_s)
            start = time.perf_counter()
            again = compiler.compile(spec)
            cached.append(time.perf_counter() - start)
            assert again is grammar
    finally:
        compiler.close()
    return CompileFigures(
        how="engine.structured.GrammarCompiler in process, the model's tokenizer; cold: "
            "the load schema with one property renamed per run; cached: the same spec again",
        tokenizer_info_ms=round(info_ms, 1), cold_ms=_stats(cold),
        cold_worker_ms=_stats(worker), cached_ms=_stats(cached))


# ------------------------------------------------------------------------ the run


def run_structured(options: StructuredOptions) -> StructuredReport:
    opts = options.effective()
    say = (lambda *_: None) if opts.quiet else (lambda *a: print(*a, flush=True))
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S")
    load_before = [round(x, 2) for x in os.getloadavg()]
    model_dir = resolve_model_dir(opts.model, default_data_dir())
    compile_figures = run_compiles(opts, model_dir)
    say(f"compile: cold p50 {compile_figures.cold_ms['p50']:.1f} ms, cached p50 "
        f"{compile_figures.cached_ms['p50']:.3f} ms")
    load_adapters = make_adapters(Path("bench/results/adapters"), load_model_config(model_dir),
                                  opts.num_adapters, rank=opts.rank, targets="attention",
                                  seed=opts.seed)
    demo, source = validity_adapters(opts.adapters_dir, model_dir, say)
    clash = set(load_adapters) & set(demo)
    if clash:
        raise SystemExit(f"adapter names used twice: {sorted(clash)}")
    # NOTE: one server for both parts (a start costs tens of seconds on a busy CPU). The
    # validity adapters are preloaded too, but the load's warm-up puts its own adapters
    # in the --max-loras slots and the load never names the others.
    flags = [f for name, path in {**load_adapters, **demo}.items()
             for f in ("--lora", f"{name}={path}")]
    serve = ["--max-loras", str(opts.num_adapters),
             "--max-num-seqs", str(max(opts.num_requests, opts.validity_concurrency)),
             "--no-enable-prefix-caching", *flags]  # fmt: skip
    # The server's database, spool and adapter store: a temporary directory.
    with tempfile.TemporaryDirectory(prefix="loraplex-structured-") as data_dir, \
            loraplex_serve(["--model", str(model_dir), *serve],
                           env=clean_env(LORAPLEX_DATA_DIR=data_dir),
                           log_path=Path(data_dir) / "serve.log") as server:
        runs = run_step_time(opts, server.base_url, list(load_adapters), say)
        validity = run_validity(
            server.base_url, demo, source, schema_requests=opts.schema_requests,
            tool_requests=opts.tool_requests, concurrency=opts.validity_concurrency,
            max_tokens=opts.validity_max_tokens, seed=opts.seed)
    report = StructuredReport(
        options={k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        machine=machine_description(), started_at=started_at,
        load_average_before=load_before,
        load_average_after=[round(x, 2) for x in os.getloadavg()],
        runs=runs, **ratios(runs), compile=compile_figures, validity=validity)
    if not opts.quiet:
        print_report(report)
    save_report(report.to_json(), "structured", opts.output, say=say)
    return report


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def print_report(report: StructuredReport) -> None:
    o = report.options
    print(f"\n{report.machine}; load average {report.load_average_before} -> "
          f"{report.load_average_after}")
    print(f"\nstep time: {o['num_requests']} streamed chat requests over {o['num_adapters']} "
          f"rank-{o['rank']} adapters, max_tokens {o['max_tokens']} (ignore_eos)")
    print(f"{'load':<14}{'round':>6}{'TPOT p50 ms':>13}{'p90 ms':>9}{'gap p50 ms':>12}"
          f"{'TTFT p50 s':>12}{'tokens/req':>12}{'structured':>12}")
    for r in report.runs:
        rows = [(r.load, r.summary)]
        if r.constrained_rows is not None and r.free_rows is not None:
            rows += [("  its schema", r.constrained_rows), ("  its free", r.free_rows)]
        for label, s in rows:
            print(f"{label:<14}{r.round + 1:>6}{_ms(s.tpot_p50_s):>13}{_ms(s.tpot_p90_s):>9}"
                  f"{_ms(s.gap_p50_s):>12}{s.ttft_p50_s:>12.2f}{s.mean_output_tokens:>12.1f}"
                  f"{r.structured_requests if label == r.load else '':>12}")
    print(f"constrained / free TPOT p50: per round {report.tpot_ratio_rounds}, their median "
          f"{report.tpot_ratio_paired:.3f}x; best of each {report.tpot_ratio_best:.3f}x, "
          f"median of each {report.tpot_ratio_median:.3f}x (target <= {TPOT_TARGET}x); "
          f"token gap p50 median {report.gap_ratio_median:.3f}x")
    c = report.compile
    print(f"\ncompile ms ({c.how}); tokenizer info {c.tokenizer_info_ms:.0f} ms")
    for label, stats in (("cold", c.cold_ms), ("cold, worker", c.cold_worker_ms),
                         ("cached", c.cached_ms)):
        print(f"{label:<14} p50 {stats['p50']:>9.3f}  p99 {stats['p99']:>9.3f}  "
              f"max {stats['max']:>9.3f}  n {stats['n']:.0f}")
    v = report.validity
    print(f"\nvalidity ({v.adapters_source}; adapters {', '.join(v.adapters)}):")
    print(f"  strict json_schema: {v.schema_valid}/{v.schema_requests} valid")
    print(f"  tool_choice required: {v.tool_valid}/{v.tool_requests} valid")
    for f in v.failures:
        print(f"  ! {f.check} {f.case} on {f.adapter} ({f.prompt!r}, seed {f.seed}): {f.error}")
        print(f"      output: {f.output[:400]!r}")
