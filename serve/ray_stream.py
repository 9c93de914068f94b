"""StreamCoalescer: an engine replica's items for one request, handed to its stream as lists at most every interval.

The engine's thread puts each item (an ``outputs.Delta`` or an ``engine_loop.RequestFailed``); the replica's
``generate`` stream awaits ``get()``, which returns every item that has come since the last list. With an interval
of 0 a list goes as soon as an item is there (whatever else came meanwhile rides along); with an interval of N
seconds a list goes at most every N seconds (the first one at once), so that a stream producing tokens faster than
that sends fewer, longer messages over Ray (each costs the replica, the ingress and the proxy the same CPU whatever
it carries). An item that ends a sequence (a finish reason) or the request (a failure) is never held back: the list
goes at once, with everything before it.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

from .engine_loop import RequestFailed


def ends_something(item: Any) -> bool:
    """Whether ``item`` ends a sequence (its last delta) or the request (a failure)."""
    return isinstance(item, RequestFailed) or item.finish_reason is not None


class StreamCoalescer:
    """One request's items between the engine's thread (``put``) and the replica's event loop (``get``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float) -> None:
        if not (interval_s >= 0 and math.isfinite(interval_s)):
            raise ValueError(f"the stream interval must be a finite number of seconds >= 0, got {interval_s}")
        self._loop = loop
        self._interval = interval_s
        self._lock = threading.Lock()
        self._pending: list[Any] = []
        self._urgent = False  # an item that must go at once is pending
        self._waiter: asyncio.Future | None = None
        self._last_sent = -math.inf

    def put(self, item: Any) -> None:
        """Add one item (from any thread). The event loop is woken for the first pending item and for one that ends
        something; the rest ride along."""
        urgent = ends_something(item)
        with self._lock:
            self._pending.append(item)
            wake = len(self._pending) == 1 or (urgent and not self._urgent)
            self._urgent = self._urgent or urgent
        if wake:
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _take(self) -> list[Any]:
        with self._lock:
            items, self._pending, self._urgent = self._pending, [], False
        self._last_sent = self._loop.time()
        return items

    async def get(self) -> list[Any]:
        """The items that have come since the last call, once the interval since then has passed (at once for one
        that ends something); waits for the first."""
        while True:
            with self._lock:
                pending, urgent = bool(self._pending), self._urgent
            timer = None
            if pending:
                due = self._last_sent + self._interval - self._loop.time()
                if urgent or due <= 0:
                    return self._take()
                timer = self._loop.call_later(due, self._wake)
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
