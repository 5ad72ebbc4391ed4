"""A TCP forwarder to put between a client and a server (Redis, PostgreSQL, ...) and
break on purpose: `cut()` drops every connection and refuses new ones, `stall()` keeps
connections open but forwards nothing (a hung server), `restore()` heals both;
`throttle(bytes_per_s)` slows every connection down (a slow link), so that a test can
act while a transfer is surely under way.

It runs its own event loop in a thread, so sync and async tests use it alike::

    with TcpProxy("127.0.0.1", 6379) as proxy:
        client = redis.Redis(port=proxy.port)
        proxy.cut()
        ...
        proxy.restore()
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")
_CHUNK = 64 * 1024


class TcpProxy:
    def __init__(
        self, target_host: str, target_port: int, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.host = host
        self.port = port  # 0: any free port, fixed at start() and kept across cut/restore
        self.accepted = 0  # connections accepted so far
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._flowing: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._bytes_per_s: float | None = None

    # ------------------------------------------------------------------ control

    def start(self) -> TcpProxy:
        assert self._thread is None, "already started"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._init())
        self._call(self._listen())
        return self

    def cut(self) -> None:
        """Close every connection and refuse new ones (connection refused)."""
        self._call(self._cut())

    def stall(self) -> None:
        """Keep accepting and keep connections open, but forward no byte either way."""
        self._call(self._set_flowing(False))

    def throttle(self, bytes_per_s: float | None) -> None:
        """Forward at most this many bytes per second each way on each connection (None:
        as fast as they come)."""
        assert bytes_per_s is None or bytes_per_s > 0
        self._bytes_per_s = bytes_per_s

    def restore(self) -> None:
        """Accept and forward again, on the same port."""
        self._call(self._restore())

    def close(self) -> None:
        if self._loop is None or self._thread is None:
            return
        self._call(self._cut())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
        self._loop = self._thread = None

    @property
    def open_connections(self) -> int:
        return len(self._writers) // 2

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None, "start() the proxy first"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    # ------------------------------------------------------------------ in the loop

    async def _init(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, self.host, self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _set_flowing(self, flowing: bool) -> None:
        assert self._flowing is not None
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._writers.clear()

    async def _restore(self) -> None:
        await self._set_flowing(True)
        if self._server is None:
            await self._listen()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer)),
            asyncio.ensure_future(self._pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        try:
            # Either side closing ends the pair: close both.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
                self._tasks.discard(task)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._flowing is not None
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                await self._flowing.wait()
                data = await reader.read(_CHUNK)
                if not data:
                    return
                # A stall that began while this chunk was in flight holds it back too.
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
                if (rate := self._bytes_per_s) is not None:
                    await asyncio.sleep(len(data) / rate)
