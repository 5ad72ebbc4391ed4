"""The validity half of `loraplex bench structured`: SmolLM2 with the demo adapters (or
any PEFT directories) under strict JSON schemas and required tool calls, every answer
parsed and validated."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.structured.cases import (
    SCHEMA_CASES,
    TOOL_CASES,
    chat_body,
    check_document,
    check_tool_calls,
    schema_format,
)
from bench.structured.load import ChatCall, post_chat, send_all
from engine.config import default_data_dir


@dataclass(slots=True)
class Failure:
    check: str  # "schema" | "tools"
    case: str
    adapter: str
    prompt: str
    seed: int  # the request's sampling seed: with the rest, enough to send it again
    error: str
    output: str


@dataclass(slots=True)
class Validity:
    adapters: dict[str, str]  # name -> directory
    adapters_source: str  # the demo cache, trained now (and how long), or --adapters-dir
    schema_requests: int
    schema_valid: int
    tool_requests: int
    tool_valid: int
    failures: list[Failure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.schema_valid == self.schema_requests
                and self.tool_valid == self.tool_requests)


def validity_adapters(adapters_dir: Path | None, model_dir: Path, say: Any
                      ) -> tuple[dict[str, Path], str]:
    """The adapters of the validity run (the PEFT directories under `adapters_dir`, or the
    demo adapters), and where they came from."""
    if adapters_dir is not None:
        found = {p.name: p for p in sorted(adapters_dir.iterdir())
                 if (p / "adapter_config.json").is_file()}
        if not found:
            raise SystemExit(f"no PEFT adapter directories under {adapters_dir}")
        return found, "--adapters-dir"
    from app.demo.cache import ensure_trained
    from app.demo.catalog import DEMO_ADAPTERS

    cache_dir = default_data_dir() / "demo" / "adapters"
    start = time.perf_counter()
    trained = ensure_trained(DEMO_ADAPTERS, model_dir, cache_dir, echo=say)
    seconds = time.perf_counter() - start
    adapters = {t.spec.name: t.path for t in trained}
    if all(t.cached for t in trained):
        return adapters, f"demo cache ({cache_dir})"
    return adapters, f"demo adapters trained now ({seconds:.0f} s) into {cache_dir}"


def run_validity(base_url: str, adapters: dict[str, Path], source: str, *,
                 schema_requests: int, tool_requests: int, concurrency: int, max_tokens: int,
                 seed: int) -> Validity:
    """Strict json_schema requests over SCHEMA_CASES and tool_choice "required" calls over
    TOOL_CASES, spread over `adapters`, sampled; every answer checked."""
    names = list(adapters)
    sampling = {"temperature": 0.8}
    schema_calls: list[tuple[ChatCall, int, str]] = []
    for i in range(schema_requests):
        case = SCHEMA_CASES[i % len(SCHEMA_CASES)]
        prompt = case.prompts[(i // len(SCHEMA_CASES)) % len(case.prompts)]
        adapter = names[i % len(names)]
        body = chat_body(adapter, prompt, max_tokens, seed=seed + i,
                          response_format=schema_format(f"case{i % len(SCHEMA_CASES)}",
                                                         case.schema), **sampling)
        schema_calls.append((ChatCall(body, case.name), i % len(SCHEMA_CASES), prompt))
    tool_calls: list[tuple[ChatCall, int, str]] = []
    for i in range(tool_requests):
        tool_case = TOOL_CASES[i % len(TOOL_CASES)]
        prompt = tool_case.prompts[(i // len(TOOL_CASES)) % len(tool_case.prompts)]
        adapter = names[(i // (len(TOOL_CASES) * 3)) % len(names)]
        body = chat_body(adapter, prompt, max_tokens, seed=seed + i,
                          tools=list(tool_case.tools), tool_choice="required",
                          parallel_tool_calls=False, **sampling)
        tool_calls.append((ChatCall(body, tool_case.name), i % len(TOOL_CASES), prompt))

    failures: list[Failure] = []
    for check, calls in (("schema", schema_calls), ("tools", tool_calls)):
        results, _ = send_all(base_url, [c for c, _, _ in calls], concurrency, post_chat)
        for (call, index, prompt), result in zip(calls, results, strict=True):
            content = result.message.get("content")
            error: str | None
            if result.status != 200:
                error = f"HTTP {result.status}: {result.error}"
            elif check == "schema":
                error = check_document(content, SCHEMA_CASES[index].schema, result.finish_reason)
            else:
                error = check_tool_calls(result.message, TOOL_CASES[index], result.finish_reason)
            if error is not None:
                output = str(content) if check == "schema" else json.dumps(result.message)
                failures.append(Failure(check, call.label, call.body["model"], prompt,
                                        call.body["seed"], error, output))
    num_schema_failed = sum(f.check == "schema" for f in failures)
    return Validity(
        adapters={k: str(v) for k, v in adapters.items()}, adapters_source=source,
        schema_requests=schema_requests,
        schema_valid=schema_requests - num_schema_failed,
        tool_requests=tool_requests,
        tool_valid=tool_requests - (len(failures) - num_schema_failed),
        failures=failures)
