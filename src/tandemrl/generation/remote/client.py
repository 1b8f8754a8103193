"""The client of `tandem rollout` servers (RolloutClient): generation, readiness, admin, and the HTTP
calls that announce a weight update (the tensors travel in weights/, which uses them).

The client owns an event loop on a daemon thread, so sync callers get `concurrent.futures.Future`s and
async callers await the same work. The calls submitted together leave together (batch.py: one
request per server, split by fewest in flight, none past a server's queue); connection errors are
retried with backoff within the deadline, then raised as one clear error; nothing waits forever, and
no call waits on a server that has answered nothing (not even /health) for rollout_server_silence_s
(liveness.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import httpx

from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote.batch import Batcher, ServerError, json_or_raise
from tandemrl.generation.remote.liveness import Liveness
from tandemrl.types import Completion, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")
__all__ = ["RolloutClient", "ServerError"]


class RolloutClient:
    def __init__(self, config: RemoteConfig, *, transport: httpx.AsyncBaseTransport | None = None):
        """`transport`: httpx's, for tests (default: the network)."""
        if not config.urls:
            raise ValueError("no rollout server given; pass --rollout_server_urls http://HOST:PORT [...]")
        self.config = config
        self.urls = [u.rstrip("/") for u in config.urls]
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._ready = False
        self._waiting: asyncio.Future[None] | None = None  # the one readiness wait all calls share
        self.version = 0  # the policy version the servers last made live through this client
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True)
        self._thread.start()
        self._http: httpx.AsyncClient = self._run(self._open(transport)).result()
        self._liveness = Liveness(self._http, config.rollout_server_silence_s)
        self._batcher = Batcher(self._http, self.urls, config, self._liveness)

    async def _open(self, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        timeout = httpx.Timeout(self.config.request_timeout_s, pool=None)
        return httpx.AsyncClient(headers=self._headers, limits=limits, timeout=timeout, transport=transport)

    def _run(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # --- public API -------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> concurrent.futures.Future[Completion]:
        """Starts one completion on the least-loaded server; returns at once. Cancelling it aborts it."""
        return self.submit_many([(prompt_ids, params)])[0]

    def submit_many(self, calls: Sequence[tuple[list[int], SamplingParams]]) -> list[concurrent.futures.Future[Completion]]:
        """Starts completions that leave together (one request per server, so each engine steps them
        together); returns at once. Cancelling one aborts it alone."""
        futures: list[concurrent.futures.Future[Completion]] = [concurrent.futures.Future() for _ in calls]
        self._loop.call_soon_threadsafe(self._start, list(calls), futures)  # one callback: one tick
        return futures

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        return self.submit(prompt_ids, params).result()

    def wait_ready(self) -> None:
        """Blocks until every server answers /ready, or raises one clear error after rollout_server_timeout."""
        self._run(self._ensure_ready()).result()

    def readiness(self) -> list[dict[str, Any]]:
        """Each server's /ready answer (model, policy_version, queue depth and size, update in progress)."""
        return self._run(self._readiness()).result()

    def post_all(self, path: str, body: dict[str, Any] | None = None) -> list[Any]:
        """POSTs `body` to `path` on every server (e.g. /sleep, /wake); their JSON answers."""
        return self._run(self._post_all(path, body or {})).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._shut_down()).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    async def _shut_down(self) -> None:
        """Cancels what is still in flight (e.g. a batch retrying a dead server), then closes the connections;
        a task left pending when the loop closes would be destroyed with asyncio's error line."""
        pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)
        await self._http.aclose()

    # --- generation -------------------------------------------------------------------------

    def _start(self, calls: list[tuple[list[int], SamplingParams]], futures: list[concurrent.futures.Future[Completion]]) -> None:
        for (prompt_ids, params), future in zip(calls, futures):
            if not future.cancelled():
                _chain(self._loop.create_task(self._generate(prompt_ids, params)), future)

    async def _generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        item = _wire_item(prompt_ids, params)
        await self._ensure_ready()
        return await self._batcher.add(item)

    # --- readiness --------------------------------------------------------------------------

    async def _ensure_ready(self) -> None:
        """One shared wait: the calls that wait for it resume in one tick (and so leave in one batch)."""
        if self._ready:
            return
        if self._waiting is None or self._waiting.done():  # done here means failed: wait afresh
            self._waiting = asyncio.ensure_future(self._wait_ready())
        await asyncio.shield(self._waiting)

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.rollout_server_timeout
        waiting, last_error = list(self.urls), ""
        while waiting:
            for url in list(waiting):
                try:
                    response = await self._http.get(url + "/ready", timeout=5.0)
                    if response.status_code == 200 or _awaits_weights(response):  # up: the trainer's push will serve it
                        self._batcher.learn_capacity(url, response)
                        waiting.remove(url)
                        continue
                    last_error = f"{url} answered {response.status_code}: {response.text[:200]}"
                    if response.status_code == 401:
                        raise ServerError(url, 401, "wrong or missing API key; pass --api_key (tandem train and tandem rollout both take it) or set TANDEM_API_KEY")
                except httpx.TransportError as error:
                    last_error = f"{url}: {error!r}"
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(
                    f"rollout server(s) {', '.join(waiting)} not ready after {self.config.rollout_server_timeout:.0f} s "
                    f"(last: {last_error}); start them with `tandem rollout --model ...` or raise --rollout_server_timeout"
                )
            if waiting:
                await asyncio.sleep(0.5)
        self._ready = True

    async def _readiness(self) -> list[dict[str, Any]]:
        async def one(url: str) -> dict[str, Any]:
            try:
                response = await self._liveness.watch(url, self._http.get(url + "/ready", timeout=10.0))
                return response.json() if _awaits_weights(response) else json_or_raise(url, response)
            except httpx.TransportError as error:
                raise ConnectionError(f"cannot reach rollout server {url}: {error!r}") from None

        return list(await asyncio.gather(*(one(u) for u in self.urls)))

    async def _post_all(self, path: str, body: dict[str, Any], timeout_s: float | None = None) -> list[Any]:
        async def one(url: str) -> Any:
            try:
                post = self._http.post(url + path, json=body, timeout=timeout_s or self.config.request_timeout_s)
                response = await self._liveness.watch(url, post)
            except httpx.TransportError as error:  # e.g. the server died during a weight update: say which one
                raise ConnectionError(f"cannot reach rollout server {url}: {error!r}") from None
            return json_or_raise(url, response)

        return list(await asyncio.gather(*(one(u) for u in self.urls)))

    # --- weight-sync announcements (weights/distributed.py moves the tensors) --------------------

    async def servers_ready(self) -> list[dict[str, Any]]:
        """Waits until every server is ready; each one's /ready answer (device_uuid, weight_group)."""
        return await self._on_loop(self._ready_then_readiness())

    async def join_weight_group(self, specs: list[dict[str, Any]], *, timeout_s: float) -> None:
        """Tells server i to join the weight-sync group as specs[i]; returns once every server joined."""
        await self._on_loop(self._join(specs, timeout_s))

    async def announce_update(self, body: dict[str, Any], *, timeout_s: float) -> None:
        """Tells every server to receive an update over its group; returns once each made body's
        version live (`timeout_s`: the transfer's deadline; the request's own is added)."""
        await self._on_loop(self._post_all("/weights/update", body, timeout_s + self.config.request_timeout_s))
        self.version = body["version"]

    async def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` on the client's loop and awaits it from the caller's; cancelling cancels it."""
        return await asyncio.wrap_future(self._run(coro))

    async def _ready_then_readiness(self) -> list[dict[str, Any]]:
        await self._ensure_ready()
        return await self._readiness()

    async def _join(self, specs: list[dict[str, Any]], timeout_s: float) -> None:
        async def one(url: str, spec: dict[str, Any]) -> None:
            json_or_raise(url, await self._liveness.watch(url, self._http.post(url + "/weights/init", json=spec, timeout=timeout_s)))

        await asyncio.gather(*(one(u, s) for u, s in zip(self.urls, specs)))


def _awaits_weights(response: httpx.Response) -> bool:
    """A 503 of /ready that says the server only lacks weights (after /sleep level 2): it takes a push."""
    try:
        return response.status_code == 503 and response.json().get("awaiting_weights") is True
    except ValueError:
        return False


def _wire_item(prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """The /generate_batch item of one call (SamplingParams is already legal for the server's schema)."""
    return {"prompt_ids": prompt_ids, **dataclasses.asdict(params), "request_id": uuid.uuid4().hex}


def _chain(task: asyncio.Task[T], future: concurrent.futures.Future[T]) -> None:
    """`task`'s outcome goes to `future`; cancelling `future` (from any thread) cancels `task`."""
    loop = task.get_loop()

    def copy(done: asyncio.Task[T]) -> None:
        if done.cancelled():
            future.cancel()
        elif future.set_running_or_notify_cancel():
            error = done.exception()
            future.set_exception(error) if error is not None else future.set_result(done.result())

    task.add_done_callback(copy)
    future.add_done_callback(lambda f: f.cancelled() and not loop.is_closed() and loop.call_soon_threadsafe(task.cancel))
