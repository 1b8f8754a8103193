"""Noticing a rollout server that stops answering (SIGSTOPped, hung, cut off by the network) while calls
to it are in flight: its `/health` is probed, and once it has answered nothing for `silence_s` every
call watching it fails at once with one clear error (SilentServer), whatever that call's own timeout.

Invariant: a call to a server that answers nothing ends within `silence_s` of the later of the call's
start and the server's last answer to a probe. A live server's long call (a long generation, a large weight update) is never
cut: its /health answers from the event loop while the work runs in threads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import httpx

T = TypeVar("T")
PROBE_INTERVAL_S = 1.0  # between a server's answered probes (capped at a quarter of silence_s)


class SilentServer(TimeoutError):
    """A rollout server answered nothing (not even /health) for silence_s."""


class Liveness:
    """Per server, one prober while calls to it are watched; its verdict is shared by those calls."""

    def __init__(self, http: httpx.AsyncClient, silence_s: float) -> None:
        self._http, self.silence_s = http, silence_s
        self._probes: dict[str, asyncio.Task] = {}
        self._num_watching: dict[str, int] = {}

    async def watch(self, url: str, work: Awaitable[T]) -> T:
        """`work` (a call to `url`), or SilentServer once `url` has answered nothing for silence_s."""
        task = asyncio.ensure_future(work)
        task.add_done_callback(_retrieved)
        probe = self._probes.get(url)
        if probe is None or probe.done():  # a server found silent earlier is probed afresh (it may be back)
            probe = self._probes[url] = asyncio.ensure_future(self._probe(url))
            probe.add_done_callback(_retrieved)
        self._num_watching[url] = self._num_watching.get(url, 0) + 1
        try:
            await asyncio.wait({task, probe}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            raise probe.exception() or SilentServer(url)
        finally:
            if not task.done():
                task.cancel()
            self._num_watching[url] -= 1
            if not self._num_watching[url] and self._probes.get(url) is probe:
                del self._probes[url]
                probe.cancel()

    async def _probe(self, url: str) -> None:
        """Returns only by raising SilentServer: GET /health until silence_s pass without an answer."""
        last_answer = time.monotonic()
        while True:
            left = last_answer + self.silence_s - time.monotonic()
            if left <= 0:
                raise SilentServer(
                    f"rollout server {url} answered nothing for {self.silence_s:g} s, not even /health (stopped, hung or "
                    "cut off); restart it, or raise --rollout_server_silence_s if it is only slow"
                )
            try:  # httpx's timeout and asyncio's (a transport that enforces none is bounded all the same); not wait_for,
                async with asyncio.timeout(left):  # which on 3.11 swallows a cancel arriving as the probe's answer does
                    await self._http.get(url + "/health", timeout=left)
            except (httpx.HTTPError, TimeoutError):  # no answer in time, or none at all (refused, reset): silence
                await asyncio.sleep(min(PROBE_INTERVAL_S, max(0.0, last_answer + self.silence_s - time.monotonic())))
                continue
            last_answer = time.monotonic()  # any status is an answer: the server's loop runs
            await asyncio.sleep(min(PROBE_INTERVAL_S, self.silence_s / 4))


def _retrieved(task: asyncio.Task) -> None:
    """Marks `task`'s error as seen: a call given up (its caller cancelled, or its server found silent) may
    fail later, and its error, which nobody awaits any more, is not asyncio's "never retrieved" traceback."""
    if not task.cancelled():
        task.exception()
