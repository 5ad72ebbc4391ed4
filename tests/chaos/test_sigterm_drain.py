"""SIGTERM to a real `loraplex serve` (tiny model, PostgreSQL) in the middle of its load:
the streams in flight finish with [DONE], whatever arrives after the signal is refused
(503 with Retry-After while the listener is still open, connection refused after), the
usage row of every served response is in the database, and the process exits 0."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx

from tests.chaos.load import Outcome, Tenant, check_usage_matches, plain, stream, usage_rows
from tests.utils.databases import migrated_database
from tests.utils.processes import ServeProcess, serve_process
from tests.utils.saas import ADMIN_KEY, SECRET_KEY, create_key, create_tenant

NUM_STREAMS = 6
STREAM_TOKENS = 160
NUM_LATE = 10


def test_sigterm_drains_streams_flushes_usage_and_exits_0(
    tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama_gqa")
    with ExitStack() as stack:
        database_url = stack.enter_context(migrated_database("postgresql", tmp_path))
        env = {
            "LORAPLEX_DATA_DIR": str(tmp_path / "data"),
            "DATABASE_URL": database_url,
            "LORAPLEX_ADMIN_KEY": ADMIN_KEY,
            "LORAPLEX_SECRET_KEY": SECRET_KEY,
            "OMP_NUM_THREADS": "1",
        }
        server = stack.enter_context(serve_process(
            # Two sequences at a time: the others wait in the engine when the signal comes.
            ["--model", str(model_dir), "--device", "cpu", "--kv-cache-tokens", "4096",
             "--max-num-seqs", "2"],
            env, tmp_path / "serve.log",
        ))
        with httpx.Client(base_url=server.base_url, timeout=30) as admin:
            tenant_id = create_tenant(admin, "acme", rpm=10_000, max_concurrency=32)["id"]
            tenant = Tenant("acme", create_key(admin, tenant_id)["key"])

        streams, late, chunks_at_signal = asyncio.run(_scenario(server, tenant, model_dir.name))
        exit_code = server.proc.wait(60)
        print(f"\nchunks per stream at SIGTERM {chunks_at_signal}; after it: "
              f"{[o.status for o in late]} (0: connection refused)")
        assert exit_code == 0, server.tail()

        # Mid-stream when the signal came, or still waiting in the engine.
        assert all(n < STREAM_TOKENS for n in chunks_at_signal), chunks_at_signal
        assert any(n > 1 for n in chunks_at_signal), chunks_at_signal  # past the role chunk
        for outcome in streams:
            assert (outcome.status, outcome.done) == (200, True), outcome
            assert outcome.usage is not None
            assert outcome.usage["completion_tokens"] == STREAM_TOKENS
        assert late and not any(o.served for o in late), late
        for outcome in late:
            if outcome.status:  # 0: connection refused, the listener had closed
                assert (outcome.status, outcome.code, outcome.retry_after) == (
                    503, "overloaded", "2"
                ), outcome
        check_usage_matches(tenant.outcomes, usage_rows(database_url))


async def _scenario(
    server: ServeProcess, tenant: Tenant, model: str
) -> tuple[list[Outcome], list[Outcome], list[int]]:
    limits = httpx.Limits(max_connections=NUM_STREAMS + 4)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as client:
        assert [(await plain(client, tenant, model)).status for _ in range(3)] == [200] * 3
        first_chunk = asyncio.Event()
        watched = [Outcome(tenant.name, "stream", 0, time.monotonic()) for _ in range(NUM_STREAMS)]
        tasks = [
            asyncio.create_task(stream(
                client, tenant, model, max_tokens=STREAM_TOKENS, on_first_chunk=first_chunk,
                outcome=outcome,
            ))
            for outcome in watched
        ]
        await asyncio.wait_for(first_chunk.wait(), 30)
        # Signal once a stream is past its role chunk (a token has come), not after a fixed
        # delay: on a loaded machine the first token took longer than 50 ms after the role
        # chunk, and the signal then came before any stream was under way.
        async def a_token_came() -> None:
            while not any(o.num_chunks > 1 for o in watched):
                await asyncio.sleep(0.005)

        await asyncio.wait_for(a_token_came(), 30)
        server.proc.send_signal(signal.SIGTERM)
        chunks_at_signal = [o.num_chunks for o in watched]
        signalled_at = time.monotonic()
        # A request each 0.1 s for a second, each on a connection of its own.
        late: list[Outcome] = []
        for _ in range(NUM_LATE):
            async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as fresh:
                late.append(await plain(fresh, tenant, model))
            await asyncio.sleep(0.1)
        assert time.monotonic() - signalled_at < 15
        streams = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return list(streams), late, chunks_at_signal
