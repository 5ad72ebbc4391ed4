from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.utils.asyncio_watchdog import watch_event_loop

# Far beyond what any of these tests takes; well before pytest-timeout's 600 s.
WATCHDOG_S = 90.0


@pytest.fixture
async def event_loop_watchdog(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    async for _ in watch_event_loop(request.node.nodeid, WATCHDOG_S):
        yield
