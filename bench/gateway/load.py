"""Open- and closed-loop HTTP load for the gateway benchmark, with latency samples.

Two interchangeable clients: `RawClient`, a minimal HTTP/1.1 keep-alive client on
asyncio streams (the default), and `HttpxClient` (httpx.AsyncClient).

NOTE: the load generator shares this machine's two cores with the server. httpx costs
~2 ms of client CPU per request here, and its pool's cost grows with the requests
queued in it, so under load it, not the server, sets the pace; the raw client costs
a few hundred microseconds and leaves the cores to the server.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.harness import loops

# Idle keep-alive connections older than this are closed, not reused: uvicorn closes
# them after 5 s, and a request sent as the server closes would fail for the client's
# reasons, not the server's.
_MAX_IDLE_S = 2.0
_Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass(slots=True)
class Probe:
    """One kind of request, and where its 200 responses' ids go."""

    method: str
    path: str
    body: dict[str, Any] | None
    headers: dict[str, str]
    ok_ids: set[str] | None = None  # generation requests: collect response ids


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes


class RawClient:
    """HTTP/1.1 with keep-alive: a connection per request in flight, reused afterwards.

    Only what these servers answer: Content-Length bodies (no chunked responses)."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._idle: list[tuple[_Connection, float]] = []  # (connection, idle since), LIFO
        self._encoded: dict[int, bytes] = {}  # id(probe) -> its request bytes

    def _encode(self, probe: Probe) -> bytes:
        data = self._encoded.get(id(probe))
        if data is None:
            body = b"" if probe.body is None else json.dumps(probe.body).encode()
            lines = [f"{probe.method} {probe.path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                     f"Content-Length: {len(body)}"]
            if probe.body is not None:
                lines.append("Content-Type: application/json")
            lines += [f"{k}: {v}" for k, v in probe.headers.items()]
            data = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
            self._encoded[id(probe)] = data
        return data

    async def _checkout(self) -> _Connection:
        now = asyncio.get_running_loop().time()
        while self._idle:
            (reader, writer), idle_since = self._idle.pop()
            if not reader.at_eof() and now - idle_since < _MAX_IDLE_S:
                return reader, writer
            writer.close()
        return await asyncio.open_connection(self.host, self.port)

    async def send(self, probe: Probe) -> Reply:
        reader, writer = await self._checkout()
        try:
            writer.write(self._encode(probe))
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            status_line, *header_lines = head[:-4].split("\r\n")
            headers = {}
            for line in header_lines:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if "content-length" not in headers:
                raise ValueError(f"no Content-Length in the response: {status_line}")
            body = await reader.readexactly(int(headers["content-length"]))
        except BaseException:
            writer.close()
            raise
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            self._idle.append(((reader, writer), asyncio.get_running_loop().time()))
        return Reply(int(status_line.split(" ", 2)[1]), body)

    async def aclose(self) -> None:
        for (_, writer), _ in self._idle:
            writer.close()
        self._idle.clear()


class HttpxClient:
    def __init__(self, base_url: str, max_connections: int) -> None:
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections)
        self._client = httpx.AsyncClient(base_url=base_url, limits=limits, timeout=30)

    async def send(self, probe: Probe) -> Reply:
        response = await self._client.request(probe.method, probe.path, json=probe.body,
                                              headers=probe.headers)
        return Reply(response.status_code, response.content)

    async def aclose(self) -> None:
        await self._client.aclose()


LoadClient = RawClient | HttpxClient


def make_client(kind: str, base_url: str, *, max_connections: int) -> LoadClient:
    if kind == "httpx":
        return HttpxClient(base_url, max_connections)
    assert kind == "raw", kind
    host, _, port = base_url.removeprefix("http://").partition(":")
    return RawClient(host, int(port))


@dataclass(slots=True)
class Samples:
    latencies_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the first few
    num_errors: int = 0
    wall_s: float = 0.0

    def add(self, probe: Probe, latency_s: float, reply: Reply | str) -> None:
        if isinstance(reply, str) or reply.status != 200:
            self.num_errors += 1
            if len(self.errors) < 5:
                self.errors.append(reply if isinstance(reply, str) else
                                   f"{reply.status}: {reply.body[:200]!r}")
            return
        self.latencies_s.append(latency_s)
        if probe.ok_ids is not None:
            probe.ok_ids.add(json.loads(reply.body)["id"])


async def _send(client: LoadClient, probe: Probe, timeout_s: float) -> Reply | str:
    try:
        return await asyncio.wait_for(client.send(probe), timeout_s)
    except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError,
            httpx.HTTPError) as exc:
        return f"{type(exc).__name__}: {exc}"


async def open_loop(client: LoadClient, probe: Probe, rate: float, duration_s: float,
                    *, timeout_s: float = 30.0) -> Samples:
    """Requests sent on a fixed schedule, latency counted from the scheduled time (see
    harness.loops.open_loop's NOTE)."""
    samples = Samples()

    async def one(index: int, due: float) -> None:
        reply = await _send(client, probe, timeout_s)
        samples.add(probe, time.perf_counter() - due, reply)

    arrivals = [i / rate for i in range(max(1, round(rate * duration_s)))]
    samples.wall_s = await loops.open_loop(arrivals, one)
    return samples


async def closed_loop(client: LoadClient, probe: Probe, concurrency: int, duration_s: float,
                      *, timeout_s: float = 30.0) -> Samples:
    """`concurrency` workers, each sending its next request when the last one answered."""
    samples = Samples()

    async def one() -> None:
        sent = time.perf_counter()
        reply = await _send(client, probe, timeout_s)
        samples.add(probe, time.perf_counter() - sent, reply)

    _, samples.wall_s = await loops.closed_loop(one, concurrency, duration_s)
    return samples
