"""Failed logins per client, in memory: after a few in a window, more attempts wait.

NOTE: per process, like the in-process rate limits: with several replicas an attacker
gets a few more tries per window, which the keys' 190 random bits make harmless. The
point is to keep a script from hammering the login form and filling the logs.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

MAX_FAILURES = 5
WINDOW_S = 300.0
# Clients remembered at most; the least recently failing are forgotten first.
MAX_CLIENTS = 10_000


class LoginThrottle:
    def __init__(
        self,
        *,
        max_failures: int = MAX_FAILURES,
        window_s: float = WINDOW_S,
        max_clients: int = MAX_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_clients = max_clients
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, client: str, now: float) -> deque[float] | None:
        times = self._failures.get(client)
        if times is None:
            return None
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if not times:
            del self._failures[client]
            return None
        return times

    def retry_after(self, client: str) -> float | None:
        """Seconds until `client` may try again; None: it may now."""
        now = self._clock()
        times = self._recent(client, now)
        if times is None or len(times) < self.max_failures:
            return None
        return max(0.0, times[0] + self.window_s - now)

    def failed(self, client: str) -> None:
        now = self._clock()
        times = self._recent(client, now)
        if times is None:
            times = self._failures[client] = deque(maxlen=self.max_failures)
        times.append(now)
        self._failures.move_to_end(client)
        while len(self._failures) > self.max_clients:
            self._failures.popitem(last=False)

    def succeeded(self, client: str) -> None:
        self._failures.pop(client, None)
