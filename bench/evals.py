"""What an adapter eval costs the tenants beside it: short chat requests' time to first
token at a fixed rate, without an eval and while one runs (the same requests, the same
server), as the ratio of the two p99s.

The app runs in process (httpx's ASGI transport, SQLite) with its real engine; each chat
request asks for one token, so its latency is its time to first token through the whole
app. The eval runs on an uploaded adapter's version and the base model, as
`loraplex admin adapters eval` starts it (batch tier priority, four sequences at a time).
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.options import opt
from bench.harness.report import print_row, report_header, write_report
from bench.lora import TARGET_SETS, _percentiles, resolve_model
from engine.config import EngineConfig

QUESTIONS = ("What is the capital of Italy?", "Name three fruits.", "How do I cook rice?",
             "Who invented the telephone?", "What is a good name for a dog?")


@dataclass(slots=True)
class EvalImpactOptions:
    model: str = "default"
    eval_items: int = opt(500, "items in the eval set (generation items, 16 tokens each)")
    requests: int = opt(40, "short chat requests per phase")
    rate: float = opt(2.0, "chat requests per second (open loop)")
    seed: int = 0
    output: Path | None = None


def run_eval_impact(opts: EvalImpactOptions) -> dict[str, Any]:
    return asyncio.run(_eval_impact(opts))


async def _eval_impact(opts: EvalImpactOptions) -> dict[str, Any]:
    import httpx

    from app.audit import AuditContext
    from app.core.config import Settings
    from app.main import create_app
    from app.server_options import start_engine
    from bench.harness.adapters import write_random_adapter

    model_dir, config = resolve_model(opts.model)
    report = report_header("eval_impact", opts)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        engine = await start_engine(EngineConfig(model=str(model_dir), data_dir=tmp / "data"))
        try:
            app = create_app(engine, Settings(data_dir=tmp / "data", no_auth=True))
            async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://bench", timeout=600,
            ) as client:
                state = app.state.loraplex
                adapter = write_random_adapter(tmp / "tuned", config, rank=16, alpha=32,
                                               targets=TARGET_SETS["attention"], seed=1)
                view = await state.registry.upload(adapter, name="tuned", tenant_id=None,
                                                   by=AuditContext(actor="bench"))
                await asyncio.to_thread(state.directory.refresh)

                async def chat(question: str) -> float:
                    start = time.perf_counter()
                    r = await client.post("/v1/chat/completions", json={
                        "model": "tuned", "max_tokens": 1, "temperature": 0,
                        "messages": [{"role": "user", "content": question}]})
                    assert r.status_code == 200, r.text
                    return time.perf_counter() - start

                async def phase() -> list[float]:
                    rng = random.Random(opts.seed)
                    tasks = []
                    for i in range(opts.requests):
                        tasks.append(asyncio.create_task(chat(QUESTIONS[i % len(QUESTIONS)])))
                        await asyncio.sleep(rng.expovariate(opts.rate))
                    return list(await asyncio.gather(*tasks))

                await chat(QUESTIONS[0])  # warm-up
                alone = await phase()
                items = [{"prompt": f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]}",
                          "expected": "x", "match": "contains", "max_tokens": 16}
                         for i in range(opts.eval_items)]
                data = "\n".join(json.dumps(item) for item in items).encode()
                started = await state.evals.start(view.adapter_id, data, version=None,
                                                  by=AuditContext(actor="bench"))
                during = await phase()
                progress = state.evals.get_eval(started.id)
                report["eval_done_items_during_phase"] = progress.done_items
                report["background_steps_cut"] = engine.stats().num_steps_cut
                await state.evals.stop()  # what is left of it: not measured
        finally:
            await engine.shutdown()
    report["without_eval_s"] = _percentiles(alone)
    report["during_eval_s"] = _percentiles(during)
    report["p99_ratio"] = round(report["during_eval_s"]["p99"] / report["without_eval_s"]["p99"],
                                3)
    for key in ("without_eval_s", "during_eval_s", "p99_ratio",
                "eval_done_items_during_phase", "background_steps_cut"):
        print_row(key, report[key])
    write_report(report, opts.output)
    return report
