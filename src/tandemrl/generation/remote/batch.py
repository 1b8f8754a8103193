"""The generate path of RolloutClient: the calls of one event-loop tick leave as one POST
/generate_batch per server (split by fewest in flight), so a server's engine steps them together as
the in-process engine would; results come back as NDJSON lines, each resolving its call at once.

Invariants: each call resolves once; no server is sent more calls at once than its queue takes (its
--max_pending_requests, read off /ready or a 503): the calls that fit nowhere wait, oldest first, for
calls to end; a retry (connection error, 503, a cut answer) resends only the unresolved items under
their ids, so a server aborts a superseded run instead of running it twice; a cancelled call is
aborted on its server; no call waits on its server past request_timeout_s from its first send, nor
past rollout_server_silence_s of a server's silence (liveness.py: its calls go to another server, or
fail), and one waiting for room waits only on calls that each have those deadlines.
"""

from __future__ import annotations

import base64
import asyncio
import collections
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote.liveness import Liveness, SilentServer
from tandemrl.generation.tick import TickBatcher
from tandemrl.types import MAX_BATCH_ITEMS
from tandemrl.types import NO_FLOOR, Completion

log = logging.getLogger(__name__)
BACKOFF_S = 0.25
MAX_ABORT_IDS = 4096


class ServerError(RuntimeError):
    """A rollout server answered with an error status (the message is the server's)."""

    def __init__(self, url: str, status: int, detail: str):
        super().__init__(f"rollout server {url} answered {status}: {detail}")
        self.status = status


@dataclass(eq=False, slots=True)
class Call:
    """One generate call: its wire item (request_id included), its future, the server it is on ("" while it
    waits for room), its sends that ended in a problem to retry, its deadline (set at its first send)."""

    item: dict[str, Any]
    future: asyncio.Future[Completion]
    url: str = ""
    tries: int = 0
    deadline: float = 0.0


class Batcher:
    def __init__(self, http: httpx.AsyncClient, urls: list[str], config: RemoteConfig, liveness: Liveness):
        self._http, self.urls, self.config, self._liveness = http, urls, config, liveness
        self.capacity: dict[str, int | None] = dict.fromkeys(urls)  # each server's --max_pending_requests (None: not said, no limit)
        self._in_flight = dict.fromkeys(urls, 0)
        self._down_until = dict.fromkeys(urls, 0.0)
        self._turn = itertools.count()
        self._waiting: collections.deque[Call] = collections.deque()  # calls no server has room for yet, oldest first
        self._this_tick: TickBatcher[Call] = TickBatcher(self._queue)
        self._ended: TickBatcher[Call] = TickBatcher(lambda _: self._dispatch())  # the calls of a tick that ended: their room refilled at once
        self._aborts: TickBatcher[tuple[str, str]] = TickBatcher(self._flush_aborts)  # (url, request id)
        self._tasks: set[asyncio.Task] = set()  # strong references to the sends in flight

    def add(self, item: dict[str, Any]) -> asyncio.Future[Completion]:
        """Queues one call for this tick's batch; cancelling the future aborts it on its server."""
        loop = asyncio.get_running_loop()
        call = Call(item, loop.create_future())
        call.future.add_done_callback(lambda _: self._settled(call))
        self._this_tick.add(call)
        return call.future

    def learn_capacity(self, url: str, response: httpx.Response) -> None:
        """Keeps `url`'s --max_pending_requests from its /ready or 503 answer; a server that does not say it keeps none."""
        try:
            size = response.json().get("max_pending_requests")
        except (ValueError, AttributeError):  # not JSON, or not an object
            return
        if isinstance(size, int) and size >= 1:
            self.capacity[url] = size

    def _queue(self, calls: list[Call]) -> None:
        self._waiting.extend(calls)
        self._dispatch()

    def _dispatch(self) -> None:
        """Places the waiting calls, oldest first, each on the server with room that has the fewest in flight, until
        none has room; each server's share leaves as one request (of at most MAX_BATCH_ITEMS items)."""
        by_url: dict[str, list[Call]] = {}
        while self._waiting:
            if self._waiting[0].future.done():
                self._waiting.popleft()
                continue
            url = self._pick()
            if url is None:
                break
            call = self._waiting.popleft()
            call.url = url
            self._in_flight[url] += 1
            by_url.setdefault(url, []).append(call)
        for group in by_url.values():
            for start in range(0, len(group), MAX_BATCH_ITEMS):
                self._spawn(self._send(group[start : start + MAX_BATCH_ITEMS]))

    def _pick(self) -> str | None:
        """The server with room with the fewest calls in flight, skipping ones that just failed; ties rotate.
        None when every server's queue is full of this client's calls."""
        now, turn = time.monotonic(), next(self._turn)
        n = len(self.urls)
        room = [u for u in self.urls if self.capacity[u] is None or self._in_flight[u] < self.capacity[u]]
        return min(room, key=lambda u: (self._down_until[u] > now, self._in_flight[u], (self.urls.index(u) - turn) % n), default=None)

    def _settled(self, call: Call) -> None:
        if not call.url:
            return
        self._in_flight[call.url] -= 1
        if call.future.cancelled():
            self._aborts.add((call.url, call.item["request_id"]))
        if self._waiting:
            self._ended.add(call)

    def _flush_aborts(self, cancelled: list[tuple[str, str]]) -> None:
        aborts: dict[str, list[str]] = {}
        for url, request_id in cancelled:
            aborts.setdefault(url, []).append(request_id)
        for url, ids in aborts.items():
            for start in range(0, len(ids), MAX_ABORT_IDS):
                self._spawn(self._abort(url, ids[start : start + MAX_ABORT_IDS]))

    async def _abort(self, url: str, request_ids: list[str]) -> None:
        try:  # best effort: an id that already finished is not an error, a server that went away aborted it
            await self._http.post(url + "/abort", json={"request_ids": request_ids}, timeout=10.0)
        except httpx.TransportError as error:
            log.debug("abort of %d requests on %s failed: %r", len(request_ids), url, error)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, calls: list[Call]) -> None:
        """Streams `calls` from their server; after a connection error, 503 or a cut answer, the unresolved ones
        wait their backoff and are placed again (another server, or split where one has less room), within
        max_retries and their request_timeout_s."""
        try:
            problem = await self._post(calls)
            if problem is not None:
                await self._retry(calls, problem)
        except asyncio.CancelledError:  # the client closing: the calls left fail rather than wait forever
            _fail(calls, RuntimeError("the rollout client closed before the server answered"))
            raise
        except Exception as error:  # noqa: BLE001 - a garbled answer or a bug: the calls left fail, saying it (no task holds it)
            _fail(calls, RuntimeError(f"the rollout server's answer could not be read ({type(error).__name__}: {error})"))

    async def _post(self, calls: list[Call]) -> str | None:
        """One POST of the unresolved `calls` to their server: the problem to retry them after, or None when each
        is resolved or failed. The request's deadline is its calls' first; past it those calls fail, the others retry."""
        live = [c for c in calls if not c.future.done()]
        if not live:
            return None
        url, now = live[0].url, time.monotonic()
        for call in live:
            call.deadline = call.deadline or now + self.config.request_timeout_s
        deadline = min(c.deadline for c in live)
        try:
            async with asyncio.timeout(max(0.1, deadline - now)):
                return await self._liveness.watch(url, self._stream(url, live, deadline))
        except SilentServer as error:  # elsewhere if another server is up, else the calls fail now
            self._down_until[url] = time.monotonic() + self.config.rollout_server_silence_s
            if all(until > time.monotonic() for until in self._down_until.values()):
                _fail(live, error)
            return str(error)
        except (TimeoutError, httpx.TimeoutException):
            _fail([c for c in live if c.deadline <= deadline], TimeoutError(f"rollout server {url} gave no answer within request_timeout_s={self.config.request_timeout_s}"))
            return f"rollout server {url} gave no answer before another call's deadline"
        except httpx.TransportError as error:
            self._down_until[url] = time.monotonic() + BACKOFF_S * 2 ** max(c.tries for c in live)
            return f"cannot reach rollout server {url}: {error!r}"
        except ServerError as error:
            _fail(live, error)
            return None

    async def _retry(self, calls: list[Call], problem: str) -> None:
        """Fails the unresolved `calls` past max_retries or their deadline; the others wait their backoff, then queue
        again ahead of the calls that never left (they count on their server until then)."""
        live = [c for c in calls if not c.future.done()]
        if not live:
            return
        pause = BACKOFF_S * 2 ** max(c.tries for c in live)
        for call in live:
            if call.tries >= self.config.max_retries or time.monotonic() + pause > call.deadline:
                call.future.set_exception(ConnectionError(f"{problem} (gave up after {call.tries + 1} tries)"))
            call.tries += 1
        if all(c.future.done() for c in live):
            return
        log.warning("%s; retrying in %.2f s", problem, pause)
        await asyncio.sleep(pause)
        again = [c for c in live if not c.future.done()]
        for call in again:
            self._in_flight[call.url] -= 1
            call.url = ""
        self._waiting.extendleft(reversed(again))
        self._dispatch()

    async def _stream(self, url: str, calls: list[Call], deadline: float) -> str | None:
        """One POST /generate_batch; resolves each call as its line arrives. Returns the problem to
        retry (503, an answer that ended early), or None when every call got its line."""
        by_id = {c.item["request_id"]: c for c in calls}
        body = {"items": [c.item for c in calls]}
        async with self._http.stream("POST", url + "/generate_batch", json=body, timeout=max(0.1, deadline - time.monotonic())) as response:
            if response.status_code != 200:
                await response.aread()
                if response.status_code == 503:
                    self.learn_capacity(url, response)
                    return f"rollout server {url} is busy: {response.text[:200]}"
                json_or_raise(url, response)
            async with contextlib.aclosing(_ndjson(response)) as results:  # closed here, not by the loop's finalizer
                async for result in results:
                    call = by_id.pop(result["request_id"], None)
                    if call is not None and not call.future.done():
                        _resolve(call.future, url, result)
        return f"the answer of rollout server {url} ended with {len(by_id)} of {len(calls)} results missing" if by_id else None


async def _ndjson(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON lines of a streamed answer, split on b"\\n" only: aiter_lines would also split on the
    U+2028 or U+0085 that a sampled text may hold (JSON leaves them unescaped)."""
    pending = b""
    async with contextlib.aclosing(response.aiter_bytes()) as chunks:  # a garbled line ends it, closed at once
        async for chunk in chunks:
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line:
                    yield json.loads(line)


def _resolve(future: asyncio.Future[Completion], url: str, result: dict[str, Any]) -> None:
    if result.get("status", 200) >= 400:
        future.set_exception(ServerError(url, result["status"], result.get("error") or ""))
        return
    top, routes, floors = result.get("top_logprobs"), result.get("routes"), result.get("logit_floors")
    future.set_result(Completion(
        token_ids=result["token_ids"], logprobs=result["logprobs"], finish_reason=result["finish_reason"], policy_versions=result["policy_versions"],
        top_logprobs=None if top is None else [{int(i): v for i, v in row.items()} for row in top],
        routes=None if routes is None else base64.b64decode(routes),
        logit_floors=None if floors is None else [NO_FLOOR if f is None else f for f in floors],  # null: JSON's -inf (nothing excluded)
    ))  # fmt: skip


def _fail(calls: list[Call], error: Exception) -> None:
    for call in calls:
        if not call.future.done():
            call.future.set_exception(error)


def json_or_raise(url: str, response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise ServerError(url, response.status_code, str(detail)[:500])
    return response.json()
