"""Hostile grammars, each compiled in a worker subprocess under a deadline.

A worker (`python -m bench.grammar.hostile LIBRARY MODEL_DIR VOCAB_SIZE`, the cases as
JSON on stdin) builds one library's tokenizer, prints `ready`, then one JSON line per case:
compile time, first mask time, the probe string fed token by token, or the library's error.
The parent waits for each line at most `timeout_s`; a worker past it is killed, the case
recorded as a timeout, and a fresh worker takes the cases left.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch

from bench.grammar.backends import GrammarBackend, GrammarError, make_backends, ms_since
from bench.grammar.cases import HostileCase

SETUP_TIMEOUT_S = 120.0
_ERROR_CHARS = 400


@dataclass(slots=True)
class HostileResult:
    library: str
    case: str
    status: str  # "ok" | "error" (the library refused it) | "timeout" | "crashed"
    compile_ms: float | None = None
    first_mask_ms: float | None = None
    probe_tokens: int = 0  # probe tokens the grammar accepted
    probe_ms: float | None = None  # mask + accept for each of them, in all
    error: str | None = None  # the library's message (cut), or why the worker stopped


def run_hostile(library: str, model_dir: Path, vocab_size: int, cases: list[HostileCase],
                timeout_s: float) -> list[HostileResult]:
    results: list[HostileResult] = []
    while len(results) < len(cases):  # each worker measures the next cases, in order
        results += _run_worker(library, model_dir, vocab_size, cases[len(results):], timeout_s)
    return results


def _run_worker(library: str, model_dir: Path, vocab_size: int, cases: list[HostileCase],
                timeout_s: float) -> list[HostileResult]:
    """Results for a prefix of `cases`: up to the first that times out or crashes."""
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.grammar.hostile", library, str(model_dir),
             str(vocab_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps([asdict(c) for c in cases]))
        proc.stdin.close()
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
        results: list[HostileResult] = []
        try:
            if lines.get(timeout=SETUP_TIMEOUT_S) != "ready":
                raise RuntimeError(f"{library} worker did not start: {_tail(proc, stderr)}")
            for case in cases:
                try:
                    line = lines.get(timeout=timeout_s)
                except queue.Empty:
                    results.append(HostileResult(library, case.name, "timeout",
                                                 error=f"no result within {timeout_s:g} s"))
                    break
                if line is None:
                    results.append(HostileResult(library, case.name, "crashed",
                                                 error=_tail(proc, stderr)))
                    break
                results.append(HostileResult(**json.loads(line)))
        finally:
            proc.kill()
            proc.wait()
        return results


def _read_lines(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.strip())
    lines.put(None)


def _tail(proc: subprocess.Popen[str], stderr: IO[str]) -> str:
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
    stderr.seek(0)
    return f"exit code {proc.poll()}: {stderr.read()[-_ERROR_CHARS:].strip()}"


# -------------------------------------------------------------------- the worker


def _measure(backend: GrammarBackend, case: HostileCase, hf_tokenizer: Any) -> HostileResult:
    start = time.perf_counter()
    try:
        compiled = backend.compile(case)
    except GrammarError as e:
        return HostileResult(backend.name, case.name, "error", compile_ms=ms_since(start),
                             error=str(e)[:_ERROR_CHARS])
    compile_ms = ms_since(start)
    matcher = backend.new_matcher(compiled)
    bitmask = torch.zeros((1, (backend.vocab_size + 31) // 32), dtype=torch.int32)
    start = time.perf_counter()
    backend.fill([matcher], bitmask)
    first_mask_ms = ms_since(start)
    tokens: list[int] = hf_tokenizer.encode(case.probe, add_special_tokens=False)
    accepted = 0
    start = time.perf_counter()
    for token in tokens:
        if not backend.accept([matcher], [token])[0]:
            break
        accepted += 1
        backend.fill([matcher], bitmask)
    probe_ms = ms_since(start) if tokens else None
    return HostileResult(backend.name, case.name, "ok", compile_ms=compile_ms,
                         first_mask_ms=first_mask_ms, probe_tokens=accepted, probe_ms=probe_ms)


def _worker(library: str, model_dir: str, vocab_size: int) -> None:
    from transformers import AutoTokenizer

    cases = [HostileCase(**c) for c in json.loads(sys.stdin.read())]
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    (backend,) = make_backends(hf_tokenizer, vocab_size, (library,))
    print("ready", flush=True)
    for case in cases:
        print(json.dumps(asdict(_measure(backend, case, hf_tokenizer))), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
