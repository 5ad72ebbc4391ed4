"""Multi-LoRA benchmarks: adapter scaling, against Hugging Face PEFT, LoRA overhead per
step, and cold adapter loads. Every figure comes with its baseline measured in the same
run; docs/BENCHMARKS.md records the ratios.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.adapters import ALL_LINEAR, ATTENTION, write_random_adapter
from bench.harness.options import opt
from bench.harness.report import print_row, report_header, write_report
from bench.harness.server import model_name, running_server
from bench.harness.workload import BenchRequest, LoadResult, make_requests, percentile, run_load
from bench.hf_baseline import HFResult, load_hf_model, run_one_at_a_time, run_static_batches
from engine.config import EngineConfig, default_data_dir
from engine.models.loader import ModelConfig, load_model_config, resolve_model_dir

TARGET_SETS: dict[str, tuple[str, ...]] = {
    "qv": ("q_proj", "v_proj"),
    "attention": ATTENTION,
    "all-linear": ALL_LINEAR,
}
ADAPTER_ROOT = Path("bench/results/adapters")


@dataclass(slots=True)
class LoRABenchOptions:
    model: str = "default"
    num_adapters: int = 32
    num_requests: int = 32
    rank: int = 16
    targets: str = opt("attention", choices=("qv", "attention", "all-linear"))
    prompt_len: tuple[int, int] = opt((32, 256), "min-max tokens")
    output_len: tuple[int, int] = opt((64, 128), "min-max tokens")
    zipf_alpha: float = 1.0
    seed: int = 0
    repeats: int = opt(2, "alternating rounds")
    # Streams (per-token SSE) cost the load generator, which shares the CPU with the
    # server here; throughput figures use plain responses unless asked.
    stream: bool = opt(False, "send requests as SSE streams (TTFT/TPOT figures, more client work)")
    hf_batch_size: int = 8  # lora-vs-peft
    loads: int = 20  # lora-cold-load
    # lora-cold-load: also each adapter's fetch from an object store (the AWS_* settings
    # reach it), and a burst of that many adapters fetched at once.
    store: str | None = opt(None, "s3://bucket/prefix to time fetches from", metavar="URL")
    store_burst: int = 32
    serve_args: list[str] = opt([], "extra flag for `serve`", flag="--serve-arg")
    output: Path | None = None


# ---------------------------------------------------------------------------- helpers


def resolve_model(name: str) -> tuple[Path, ModelConfig]:
    """The converted model's directory and its config."""
    model_dir = resolve_model_dir(name, default_data_dir())
    return model_dir, load_model_config(model_dir)


def engine_core(model_dir: Path, **config: Any) -> Any:
    """An in-process EngineCore (no HTTP) on the model at `model_dir`."""
    from engine.core.engine_core import EngineCore

    return EngineCore(EngineConfig(model=str(model_dir), **config))


def load_peft_model(model_dir: Path, adapters: dict[str, Path]) -> Any:
    from bench.hf_baseline import load_peft

    return load_peft(load_hf_model(model_dir), adapters)


def _write_adapter(path: Path, config: ModelConfig, rank: int, targets: str, seed: int) -> Path:
    return write_random_adapter(
        path, config, rank=rank, alpha=2 * rank, targets=TARGET_SETS[targets], seed=seed
    )


def make_adapters(
    root: Path, config: ModelConfig, count: int, *, rank: int, targets: str, seed: int = 0
) -> dict[str, Path]:
    """`count` random adapters named lora-0 .. lora-{count-1}, written once under root."""
    folder = root / f"{targets}-r{rank}-s{seed}"
    adapters = {f"lora-{i}": folder / f"lora-{i}" for i in range(count)}
    for i, path in enumerate(adapters.values()):
        if not (path / "adapter_config.json").exists():
            _write_adapter(path, config, rank, targets, seed * 100_000 + i)
    return adapters


def zipf_choices(names: Sequence[str], n: int, alpha: float, seed: int) -> list[str]:
    """n draws from names with P(i) proportional to 1 / (i + 1) ** alpha."""
    weights = [1.0 / (i + 1) ** alpha for i in range(len(names))]
    return random.Random(seed).choices(list(names), weights=weights, k=n)


def _requests(
    opts: LoRABenchOptions, config: ModelConfig, models: Sequence[str | None]
) -> list[BenchRequest]:
    """The options' seeded requests, the i-th on models[i] (None: the base model)."""
    requests = make_requests(
        opts.num_requests, vocab_size=config.vocab_size, prompt_len=opts.prompt_len,
        output_len=opts.output_len, seed=opts.seed,
    )
    for request, model in zip(requests, models, strict=True):
        request.model = model
    return requests


@contextlib.contextmanager
def _lora_server(
    opts: LoRABenchOptions, adapters: dict[str, Path], prompt: list[int], *flags: str
) -> Iterator[tuple[str, str]]:
    """A server with every adapter, each warmed into its slot by one short request (the
    steady state is measured, not first loads); yields its URL and base model."""
    serve = ["--model", opts.model, "--max-loras", str(opts.num_adapters),
             "--max-num-seqs", str(max(opts.num_requests, 1)), *flags,
             *(flag for name, path in adapters.items() for flag in ("--lora", f"{name}={path}")),
             *opts.serve_args]
    with running_server(serve) as base_url:
        base_model = model_name(base_url)
        warm = [BenchRequest(prompt[:8], 2, name) for name in adapters]
        asyncio.run(run_load(base_url, base_model, warm, len(warm)))
        yield base_url, base_model


# ---------------------------------------------------------------------------- scaling


def run_scaling(opts: LoRABenchOptions) -> dict[str, Any]:
    """N concurrent requests all on one adapter vs on N distinct adapters (uniform) vs
    Zipf popularity over the same N adapters; one server, rounds alternate."""
    _, config = resolve_model(opts.model)
    adapters = make_adapters(
        ADAPTER_ROOT, config, opts.num_adapters, rank=opts.rank, targets=opts.targets
    )
    names = list(adapters)
    mixes: dict[str, list[str | None]] = {
        "single": [names[0]] * opts.num_requests,
        "uniform": [names[i % len(names)] for i in range(opts.num_requests)],
        "zipf": list(zipf_choices(names, opts.num_requests, opts.zipf_alpha, opts.seed)),
    }
    report = report_header("lora_scaling", opts)
    report["distinct_adapters"] = {k: len(set(v)) for k, v in mixes.items()}
    workloads = {mix: _requests(opts, config, models) for mix, models in mixes.items()}
    runs: dict[str, list[LoadResult]] = {k: [] for k in mixes}
    # NOTE: no prefix caching: every round sends the same prompts, and a mix whose
    # requests share adapters with an earlier run would otherwise skip their prefills.
    prompt = workloads["single"][0].prompt_token_ids
    with _lora_server(opts, adapters, prompt, "--no-enable-prefix-caching") as (url, model):
        for round_index in range(opts.repeats):
            # The order rotates every round, so no mix always runs first or last.
            order = list(mixes)
            order = order[round_index % len(order) :] + order[: round_index % len(order)]
            for mix in order:
                result = asyncio.run(
                    run_load(url, model, workloads[mix], opts.num_requests, stream=opts.stream)
                )
                runs[mix].append(result)
                print_row(f"{mix} #{round_index}", result.summary())
    best = {mix: max(rs, key=lambda r: r.output_tokens_per_s) for mix, rs in runs.items()}
    report["best"] = {mix: r.summary() for mix, r in best.items()}
    report["runs"] = {mix: [r.summary() for r in rs] for mix, rs in runs.items()}
    single = best["single"].output_tokens_per_s
    report["ratios"] = {
        "uniform_vs_single": round(best["uniform"].output_tokens_per_s / single, 3),
        "zipf_vs_single": round(best["zipf"].output_tokens_per_s / single, 3),
    }
    print("best of each:", json.dumps(report["ratios"]), flush=True)
    write_report(report, opts.output)
    return report


# ---------------------------------------------------------------------------- vs PEFT


def run_vs_peft(opts: LoRABenchOptions) -> dict[str, Any]:
    """num_requests over num_adapters (one each, round robin): the server vs PEFT
    one-at-a-time (set_adapter) and in static mixed batches (adapter_names)."""
    model_dir, config = resolve_model(opts.model)
    adapters = make_adapters(
        ADAPTER_ROOT, config, opts.num_adapters, rank=opts.rank, targets=opts.targets
    )
    names = list(adapters)
    requests = _requests(opts, config, [names[i % len(names)] for i in range(opts.num_requests)])
    report = report_header("lora_vs_peft", opts)
    runs: dict[str, list[LoadResult | HFResult]] = {
        "engine": [], "peft_one_at_a_time": [], "peft_static_batches": []
    }
    peft = load_peft_model(model_dir, adapters)
    for round_index in range(opts.repeats):
        with _lora_server(opts, adapters, requests[0].prompt_token_ids) as (url, model):
            runs["engine"].append(asyncio.run(
                run_load(url, model, requests, opts.num_requests, stream=opts.stream)
            ))
        print_row(f"engine #{round_index}", runs["engine"][-1].summary())
        if round_index == 0:
            warm_peft = [BenchRequest(requests[0].prompt_token_ids[:8], 2, requests[0].model)]
            run_one_at_a_time(peft, warm_peft, peft=True)
        runs["peft_one_at_a_time"].append(run_one_at_a_time(peft, requests, peft=True))
        print_row(f"peft one-at-a-time #{round_index}", runs["peft_one_at_a_time"][-1].summary())
        static = run_static_batches(peft, requests, opts.hf_batch_size, peft=True)
        runs["peft_static_batches"].append(static)
        print_row(f"peft static x{opts.hf_batch_size} #{round_index}", static.summary())
    best = {k: max(rs, key=lambda r: r.output_tokens_per_s) for k, rs in runs.items()}
    report.update({k: r.summary() for k, r in best.items()})
    report["runs"] = {k: [r.summary() for r in rs] for k, rs in runs.items()}
    engine, single, static_rate = (r.output_tokens_per_s for r in best.values())
    report["ratios"] = {
        "engine_vs_best_peft": round(engine / max(single, static_rate), 2),
        "engine_vs_peft_one_at_a_time": round(engine / single, 2),
        "engine_vs_peft_static": round(engine / static_rate, 2),
    }
    print("best of each:", json.dumps(report["ratios"]), flush=True)
    write_report(report, opts.output)
    return report


# ---------------------------------------------------------------------------- overhead


def _step_time(core: Any, requests: list[Any]) -> tuple[float, int]:
    """Mean seconds per step running `requests` to completion, and the number of steps."""
    for r in requests:
        core.add_request(r)
    steps = 0
    start = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    return (time.perf_counter() - start) / steps, steps


def run_overhead(opts: LoRABenchOptions) -> dict[str, Any]:
    """The same requests on the base model and all on one adapter, in one in-process
    engine (no HTTP): mean step time of each, best of `repeats` alternating rounds."""
    from bench.gpu.engine_throughput import engine_requests

    model_dir, config = resolve_model(opts.model)
    adapters = make_adapters(ADAPTER_ROOT, config, 1, rank=opts.rank, targets=opts.targets)
    core = engine_core(model_dir, max_num_seqs=opts.num_requests, max_loras=1)
    core.add_adapter("lora-0", adapters["lora-0"])
    workloads = {
        label: _requests(opts, config, [adapter] * opts.num_requests)
        for label, adapter in (("base", None), ("lora", "lora-0"))
    }
    report = report_header("lora_overhead", opts)
    _step_time(core, engine_requests(workloads["lora"][:2], "warm", ignore_eos=True))
    rounds: dict[str, list[float]] = {label: [] for label in workloads}
    steps: dict[str, int] = {}
    for round_index in range(opts.repeats):
        for label, workload in workloads.items():
            # A distinct tag per round: no prefix-cache hits between rounds.
            requests = engine_requests(workload, f"{label}{round_index}", ignore_eos=True)
            seconds, n = _step_time(core, requests)
            rounds[label].append(seconds)
            steps[label] = n
            print_row(f"{label} #{round_index}", {"step_ms": round(seconds * 1000, 2), "steps": n})
    best = {label: min(values) for label, values in rounds.items()}
    report["steps"] = steps
    report["step_ms"] = {k: [round(v * 1000, 2) for v in vs] for k, vs in rounds.items()}
    report["best_step_ms"] = {k: round(v * 1000, 2) for k, v in best.items()}
    report["ratios"] = {"lora_vs_base_step_time": round(best["lora"] / best["base"], 3)}
    print("best of each:", json.dumps(report["ratios"]), flush=True)
    write_report(report, opts.output)
    return report


# ---------------------------------------------------------------------------- cold load


def run_cold_load(opts: LoRABenchOptions) -> dict[str, Any]:
    """An adapter from disk to ready: read + validate + host copy (add_adapter), then the
    device-slot install its first request pays; PEFT's `load_adapter` of the same files
    on the same machine is the baseline."""
    from bench.gpu.engine_throughput import engine_requests

    model_dir, config = resolve_model(opts.model)
    core = engine_core(model_dir, max_loras=1, max_cpu_loras=1)
    peft = load_peft_model(
        model_dir,
        make_adapters(ADAPTER_ROOT, config, 1, rank=opts.rank, targets=opts.targets, seed=9),
    )
    report = report_header("lora_cold_load", opts)
    to_host: list[float] = []
    to_ready: list[float] = []
    peft_load: list[float] = []
    size_bytes = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(opts.loads):
            # A fresh directory each time, written before the clock starts. NOTE: the page
            # cache still holds it; a load from a cold disk adds the read time of
            # size_bytes.
            name = f"cold-{i}"
            path = _write_adapter(Path(tmp) / name, config, opts.rank, opts.targets, 1000 + i)
            start = time.perf_counter()
            size_bytes = core.add_adapter(name, path).size_bytes
            loaded = time.perf_counter()
            probe = engine_requests([BenchRequest([1000, 1001], 1, name)], f"r{i}",
                                    ignore_eos=False)
            core.add_request(probe[0])
            while core.has_unfinished_requests():
                core.step()  # the first step installs the adapter in a device slot
            assert core.runner.lora is not None
            to_host.append(loaded - start)
            to_ready.append((loaded - start) + core.runner.lora.last_install_s)
            core.remove_adapter(name)
            start = time.perf_counter()
            peft.load_adapter(str(path), adapter_name=name)
            peft_load.append(time.perf_counter() - start)
            peft.delete_adapter(name)
        fetches = _store_fetches(opts, config, Path(tmp)) if opts.store else {}
    report["size_bytes"] = size_bytes
    for key, label, values in (
        ("add_adapter_s", "add_adapter", to_host),
        ("disk_to_ready_s", "disk to ready", to_ready),
        ("peft_load_adapter_s", "peft load_adapter", peft_load),
        *(("store_fetch_s", "store fetch", fetches.get("one", [])),
          ("store_burst_s", f"{opts.store_burst} fetched at once", fetches.get("burst", []))),
    ):
        if not values:
            continue
        report[key] = _percentiles(values)
        print_row(label, report[key])
    report["ratios"] = {
        "peft_vs_ours_p50": round(statistics.median(peft_load) / statistics.median(to_ready), 2)
    }
    write_report(report, opts.output)
    return report


def _store_fetches(opts: LoRABenchOptions, config: ModelConfig, tmp: Path
                   ) -> dict[str, list[float]]:
    """Adapters of the same shape put in the object store, then fetched hash-checked into
    a node's empty cache (AdapterStore.ensure): one at a time (`loads`), and `store_burst`
    at once on as many threads (the burst's wall time)."""
    from concurrent.futures import ThreadPoolExecutor

    from app.registry.archive import directory_digest
    from app.registry.object_store import ObjectStore
    from app.registry.store import AdapterStore

    assert opts.store is not None
    remote = ObjectStore(opts.store)
    digests = []
    for i in range(opts.loads + opts.store_burst):
        path = _write_adapter(tmp / f"stored-{i}", config, opts.rank, opts.targets, 5000 + i)
        digest = directory_digest(path, 1 << 40)
        assert digest is not None
        remote.upload(digest, path)
        digests.append(digest)
    node = AdapterStore(tmp / "node", remote=remote)
    one = []
    for digest in digests[: opts.loads]:
        start = time.perf_counter()
        node.ensure(digest)
        one.append(time.perf_counter() - start)
    start = time.perf_counter()
    with ThreadPoolExecutor(opts.store_burst) as pool:
        list(pool.map(node.ensure, digests[opts.loads:]))
    return {"one": one, "burst": [time.perf_counter() - start]}


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": round(percentile(ordered, 50), 4),
        "p99": round(percentile(ordered, 99), 4),
        "mean": round(statistics.fmean(ordered), 4),
        "n": len(ordered),
    }


# ------------------------------------------------------------- cold adapters, served


def run_cold_ttft(opts: LoRABenchOptions) -> dict[str, Any]:
    """A request's time to its first token (`max_tokens: 1`, through the whole app: auth,
    planning, the engine) for an adapter in a device slot, one the replica must load from
    its local disk, and one it must first fetch from the object store (`--store`); the
    base model is the baseline. Then `store_burst` requests at once, each for another
    adapter none of which the replica holds. The app runs in process (httpx's ASGI
    transport, no sockets), on SQLite, with its real engine."""
    return asyncio.run(_cold_ttft(opts))


async def _cold_ttft(opts: LoRABenchOptions) -> dict[str, Any]:
    import httpx

    from app.audit import AuditContext
    from app.core.config import Settings
    from app.main import create_app
    from app.server_options import start_engine

    model_dir, config = resolve_model(opts.model)
    report = report_header("lora_cold_ttft", opts)
    burst = opts.store_burst if opts.store else 0
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        engine = await start_engine(EngineConfig(
            model=str(model_dir), data_dir=tmp / "data",
            max_loras=max(8, burst), max_cpu_loras=max(64, 2 * burst + 2 * opts.loads + 1),
        ))
        try:
            app = create_app(engine, Settings(
                data_dir=tmp / "data", no_auth=True, adapter_store=opts.store or "",
            ))
            async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://bench",
                timeout=600,
            ) as client:
                state = app.state.loraplex
                names = ["warm", *(f"disk-{i}" for i in range(opts.loads))]
                if opts.store:
                    names += [f"store-{i}" for i in range(opts.loads)]
                    names += [f"burst-{i}" for i in range(burst)]
                refs = {}
                for i, name in enumerate(names):
                    path = _write_adapter(tmp / "adapters" / name, config, opts.rank,
                                          opts.targets, 7000 + i)
                    await state.registry.upload(path, name=name, tenant_id=None,
                                                by=AuditContext(actor="bench"))
                await asyncio.to_thread(state.directory.refresh)
                for name in names:
                    refs[name] = state.directory.resolve_adapter(None, name)
                    assert refs[name] is not None, name

                async def first_token(model: str) -> float:
                    start = time.perf_counter()
                    r = await client.post("/v1/completions", json={
                        "model": model, "prompt": COLD_PROMPT, "max_tokens": 1,
                        "temperature": 0})
                    assert r.status_code == 200, r.text
                    return time.perf_counter() - start

                async def forget(name: str, *, local_copy: bool) -> None:
                    """Out of the engine (and the node's cache): as a replica that has
                    just learnt of the version finds it."""
                    ref = refs[name]
                    await engine.remove_adapter(ref.engine_name)
                    if local_copy:
                        store = state.registry.store
                        with store.locked():
                            store.remove(ref.sha256)

                await first_token(engine.model_id)  # warm-up
                await first_token("warm")  # now in a device slot
                rows: dict[str, list[float]] = {"base": [], "warm": [], "disk": [],
                                                "store": []}
                for i in range(opts.loads):
                    rows["base"].append(await first_token(engine.model_id))
                    rows["warm"].append(await first_token("warm"))
                    await forget(f"disk-{i}", local_copy=False)
                    rows["disk"].append(await first_token(f"disk-{i}"))
                    if opts.store:
                        await forget(f"store-{i}", local_copy=True)
                        rows["store"].append(await first_token(f"store-{i}"))
                for key, values in rows.items():
                    if values:
                        report[f"{key}_s"] = _percentiles(values)
                        print_row(key, report[f"{key}_s"])
                if burst:
                    batch = [f"burst-{i}" for i in range(burst)]
                    for name in batch:
                        await forget(name, local_copy=True)
                    start = time.perf_counter()
                    each = await asyncio.gather(*(first_token(n) for n in batch))
                    report["burst_s"] = {**_percentiles(list(each)),
                                         "wall": round(time.perf_counter() - start, 4)}
                    print_row(f"{burst} cold at once", report["burst_s"])
        finally:
            await engine.shutdown()
    write_report(report, opts.output)
    return report


# A short prompt: the figures are about the adapter, not the prefill.
COLD_PROMPT = "Write one word about the sea."
