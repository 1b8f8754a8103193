"""Admission to the rollout server's generator: a gate that weight updates and sleep close, and the
503 answer of a full queue.

Invariants: nothing passes the gate while any holder keeps it closed; `close()` returns once nothing runs,
or reopens (for this holder) and raises Undrained once its deadline passes with requests still running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Busy(Exception):
    """Too many requests pending: answered 503, the client retries later. `max_pending_requests`: the queue's
    size, when the queue refused (the 503's field of that name, so a client sends batches that fit)."""

    def __init__(self, message: str, *, max_pending_requests: int | None = None):
        super().__init__(message)
        self.max_pending_requests = max_pending_requests


class Undrained(TimeoutError):
    """Requests still ran when a drain's deadline passed; the gate reopened for its closer. Answered 504."""


class Gate:
    """Admission to the generator. Closed by each holder of `close()`; open when none holds it."""

    def __init__(self) -> None:
        self.num_running = 0
        self.num_queued = 0
        self._closers = 0
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        self.num_queued += 1
        try:
            while not self._open.is_set():  # re-checked: a closer may have come between set() and wake-up
                await self._open.wait()
        finally:
            self.num_queued -= 1
        self.num_running += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.num_running -= 1
            if self.num_running == 0:
                self._idle.set()

    async def close(self, timeout_s: float) -> None:
        """Stops admitting and waits until nothing runs. Past `timeout_s` (or cancelled) it reopens for this
        closer, so the requests held meanwhile are admitted, and raises Undrained (or CancelledError)."""
        self._closers += 1
        self._open.clear()
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except BaseException as error:
            self.reopen()
            if isinstance(error, TimeoutError):
                raise Undrained(f"{self.num_running} request(s) still running after {timeout_s:g} s (--drain_timeout_s)") from None
            raise

    def reopen(self) -> None:
        self._closers -= 1
        if self._closers == 0:
            self._open.set()
