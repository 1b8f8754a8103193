"""The rollout server's logic, apart from HTTP: admission, async requests by id, versioned weight
updates, sleep/wake, readiness and metrics, over any Generator.

Invariants: no request reaches the generator while a drain-mode update or sleep holds the gate, and
neither holds it past drain_timeout_s (then it reopens: the update is refused, the server stays awake); a
weight update is received whole into staging before one `update_weights` call makes it live; a failed
sync keeps the previous version and the server keeps serving; a receive ends within the group's
timeout (sooner when the trainer hangs up), even when its thread is stuck in a collective; one
/weights/init runs at a time (another is a 409 at once), and sleep and wake never wait for its
rendezvous with the trainer (an NCCL one's excepted: its device set-up).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tandemrl.generation.base import LocalGenerator
from tandemrl.server.gate import Busy, Gate, Undrained
from tandemrl.server.metrics import ServerMetrics
from tandemrl.server.wire import Result, per_sample
from tandemrl.types import Completion, SamplingParams
from tandemrl.weights import inbox
from tandemrl.weights.group import NotStaged, WeightReceiver

log = logging.getLogger(__name__)



def _check_finite(named: list) -> None:
    """Raises ValueError naming the first tensor holding inf or NaN: a server that went live on one answered
    every request 200 with null logprobs. One pass over each tensor and one host sync, not one per tensor."""
    floats = [(name, t) for name, t in named if t.is_floating_point()]
    if not floats:
        return
    tensors = [t for _, t in floats]
    if tensors[0].is_cuda:
        totals = torch._foreach_norm(tensors, 2, dtype=torch.float32)  # one fused kernel over all of them
    else:
        totals = [t.sum(dtype=torch.float32) for t in tensors]  # on CPU 5-20x faster than torch's foreach norm
    if bool(torch.stack(totals).isfinite().all()):  # inf or NaN anywhere makes its tensor's total so
        return
    bad = next((name for name, t in floats if not bool(t.isfinite().all())), None)  # else a total of finite values overflowed
    if bad is not None:
        raise ValueError(f"tensor {bad} holds inf or NaN")


class JoinInProgress(Exception):
    """A /weights/init while another is in flight: answered 409 at once."""


@dataclass
class _Entry:
    task: asyncio.Task
    finished_at: float = 0.0


@dataclass
class Counters:
    requests: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0})
    prompt_tokens: int = 0
    generated_tokens: int = 0
    weight_syncs: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})
    last_sync_s: float = 0.0


class RolloutService:
    def __init__(self, generator: LocalGenerator, *, model_name: str, max_model_len: int, max_pending_requests: int, result_ttl_s: float, drain_timeout_s: float, receiver: WeightReceiver | None, device_uuid: str | None):
        self.generator = generator
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_pending_requests = max_pending_requests
        self.result_ttl_s = result_ttl_s
        self.drain_timeout_s = drain_timeout_s
        self.receiver = receiver
        self.device_uuid = device_uuid
        self.gate = Gate()
        self.counters = Counters()
        self.update_in_progress = False
        self.asleep = False
        self._entries: dict[str, _Entry] = {}
        self._update_lock = asyncio.Lock()
        self._joining: str | None = None  # the group id of the /weights/init in flight
        self.metrics = ServerMetrics(self)
        self._num_in_flight = 0  # generations started and not finished, admitted or not (async ones included)
        self._channel_tasks: set[asyncio.Task] = set()  # serve_staged_updates of each group's channel (kept from collection)

    # --- generation -------------------------------------------------------------------------

    @property
    def streams_tokens(self) -> bool:
        """Whether `generate(..., on_token=f)` calls f with each token as it is sampled (the engine does)."""
        return bool(getattr(self.generator, "streams_tokens", False))

    def start(self, jobs: list[tuple[list[int], SamplingParams]], *, on_token: Callable[[int, int], None] | None = None) -> list[asyncio.Task]:
        """Starts a completion of every (prompt ids, params) through the gate, or none (Busy): the check and the
        slots they take are one step, so no other request passes the check on slots these already hold.
        Cancelling a task aborts its generation (the engine frees it). `on_token(job index, token id)` is called
        by a generator that streams tokens, and ignored by one that does not."""
        self.check_capacity(len(jobs))
        stream = on_token if self.streams_tokens else None
        return [self._start(self._generate(ids, p, None if stream is None else functools.partial(stream, i))) for i, (ids, p) in enumerate(jobs)]

    @property
    def awaiting_weights(self) -> bool:
        """After a level-2 sleep (the engine dropped its weights, no copy kept), until a weight update refills them."""
        return bool(getattr(self.generator, "awaiting_weights", False))

    def check_weights(self) -> None:
        """Raises Busy (503) while the generator has no weights: a request would wait for an update nobody may send."""
        if self.awaiting_weights:
            raise Busy(
                "no weights: /sleep level 2 dropped them and no weight update has refilled them yet; "
                "push weights (POST /weights/init, then /weights/update: tandem train does) or restart the server"
            )

    def check_capacity(self, num_requests: int) -> None:
        """Raises Busy (503, retry later) unless `num_requests` more fit under max_pending_requests; every
        kind of request counts (blocking, batch and async ones: an async one used to bypass the limit)."""
        self.check_weights()
        limit = self.max_pending_requests
        if num_requests > limit:
            raise Busy(f"{num_requests} more do not fit, now or ever: this server takes {limit} requests at once; send at most {limit} "
                       "in one request, or restart it with a larger --max_pending_requests", max_pending_requests=limit)  # fmt: skip
        if self._num_in_flight + num_requests > limit:
            raise Busy(f"{self._num_in_flight} of {limit} requests pending (--max_pending_requests); {num_requests} more do not fit; retry later", max_pending_requests=limit)

    async def _generate(self, prompt_ids: list[int], params: SamplingParams, on_token: Callable[[int], None] | None = None) -> Completion:
        start = time.perf_counter()
        if on_token is not None:
            on_token = self._timing_first_token(on_token, start)
        try:
            async with self.gate.admit():
                self.check_weights()  # held at the gate by a level-2 sleep: refused, not held again in the engine
                if on_token is None:
                    completion = await self.generator.generate(prompt_ids, params)
                else:
                    completion = await self.generator.generate(prompt_ids, params, on_token=on_token)  # type: ignore[call-arg]
        except asyncio.CancelledError:
            self.counters.requests["abort"] += 1
            raise
        except Exception:
            self.counters.requests["error"] += 1
            raise
        self.counters.requests[completion.finish_reason] += 1
        self.counters.prompt_tokens += len(prompt_ids)
        self.counters.generated_tokens += len(completion.token_ids)
        self.metrics.request_latency.observe(time.perf_counter() - start)
        self.metrics.finished(len(completion.token_ids))
        return completion

    def _timing_first_token(self, on_token: Callable[[int], None], start: float) -> Callable[[int], None]:
        """`on_token` that also observes the time to the first token."""
        seen = False

        def timed(token_id: int) -> None:
            nonlocal seen
            if not seen:
                seen = True
                self.metrics.time_to_first_token.observe(time.perf_counter() - start)
            on_token(token_id)

        return timed

    def start_batch(self, items: list[tuple[str, list[int], SamplingParams]]) -> dict[str, asyncio.Task]:
        """Starts every (request id, prompt ids, params) in this tick, or none (Busy), so the generator
        batches them together. An id that already runs here is aborted: a retried item never runs
        twice on this server. The ids stay abortable until `forget`."""
        tasks = dict(zip((request_id for request_id, _, _ in items), self.start([(ids, params) for _, ids, params in items])))
        for request_id, task in tasks.items():
            if request_id in self._entries:
                self._entries[request_id].task.cancel()
            self._entries[request_id] = _Entry(task)
        return tasks

    def _start(self, generation: Any) -> asyncio.Task:
        """A task of `generation`, counted in flight until it is done (cancelled before it ran included)."""
        self._num_in_flight += 1
        task = asyncio.create_task(generation)
        task.add_done_callback(self._one_done)
        return task

    def _one_done(self, _: asyncio.Task) -> None:
        self._num_in_flight -= 1

    def forget(self, tasks: dict[str, asyncio.Task]) -> None:
        """Drops the ids of a finished batch, unless a later batch took them over."""
        for request_id, task in tasks.items():
            entry = self._entries.get(request_id)
            if entry is not None and entry.task is task:
                del self._entries[request_id]

    def submit(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[str]:
        """Starts `n` samples, or none (Busy); returns their request ids at once."""
        self._forget_expired()
        ids = [uuid.uuid4().hex for _ in range(n)]
        for request_id, task in zip(ids, self.start([(prompt_ids, p) for p in per_sample(params, n)])):
            entry = self._entries[request_id] = _Entry(task)
            task.add_done_callback(lambda _, e=entry: setattr(e, "finished_at", time.monotonic()))
        return ids

    @property
    def num_async_results_held(self) -> int:
        return len(self._entries)

    def known(self, request_ids: list[str]) -> list[str]:
        """The ids among `request_ids` this server does not know (never issued, collected or expired)."""
        return [i for i in request_ids if i not in self._entries]

    async def collect(self, request_ids: list[str], timeout_s: float) -> tuple[list[Result], list[str]]:
        """Waits up to `timeout_s` for all; returns (finished results, now forgotten; pending ids)."""
        tasks = [self._entries[i].task for i in request_ids]
        if timeout_s > 0:
            await asyncio.wait(tasks, timeout=timeout_s)
        results, pending = [], []
        for request_id, task in zip(request_ids, tasks):
            if task.done():
                results.append(self.result(request_id, task))
                self._entries.pop(request_id, None)
            else:
                pending.append(request_id)
        return results, pending

    def abort(self, request_ids: list[str]) -> list[str]:
        """Cancels each; returns those that had already finished: a cancel cannot undo them, their results stand."""
        return [request_id for request_id in request_ids if not self._entries[request_id].task.cancel()]

    def result(self, request_id: str, task: asyncio.Task) -> Result:
        if task.cancelled():
            return Result(request_id=request_id, finish_reason="abort")
        if task.exception() is not None:
            return Result(request_id=request_id, finish_reason="error", error=str(task.exception()) or repr(task.exception()))
        c: Completion = task.result()
        return Result(
            request_id=request_id, token_ids=c.token_ids, logprobs=c.logprobs, policy_versions=c.policy_versions,
            top_logprobs=c.top_logprobs, finish_reason=c.finish_reason, routes=None if c.routes is None else base64.b64encode(c.routes).decode(),
            logit_floors=c.logit_floors,
        )  # fmt: skip

    async def expire_results(self) -> None:
        """Forever: forgets uncollected results past result_ttl_s (they piled up until the next submit)."""
        while True:
            await asyncio.sleep(min(self.result_ttl_s / 2, 30.0))
            self._forget_expired()

    def _forget_expired(self) -> None:
        horizon = time.monotonic() - self.result_ttl_s
        expired = [i for i, e in self._entries.items() if 0 < e.finished_at < horizon]  # 0: its done-callback has not run yet
        for request_id in expired:
            del self._entries[request_id]

    # --- weights, sleep ---------------------------------------------------------------------

    async def join_weight_group(self, spec: dict[str, Any]) -> None:
        if self.receiver is None:
            raise ValueError("this server has no weight receiver")
        if self._joining is not None:  # they queued on the lock, each its whole deadline: 5 inits of 5 s took 50 s
            raise JoinInProgress(
                f"an init is in progress (weight-sync group {self._joining}; answered within its timeout_s + {inbox.JOIN_SLACK_S:g} s); "
                "retry once it is answered"
            )
        self._joining = spec["group_id"]
        try:
            async with self._update_lock:  # an update in flight ends first; none starts once the group is left (409)
                self.receiver.close()
            # the rendezvous holds no lock (/sleep and /wake waited behind a silent peer), but NCCL's: it sets up its
            # communicator on the device, which must not overlap a wake's CUDA-graph capture (gloo, ipc: no device work)
            async with self._update_lock if spec["transport"] == "nccl" else contextlib.nullcontext():
                staged_channel = await inbox.join(self.receiver, spec)
        finally:
            self._joining = None
        if staged_channel is not None:  # served until the trainer closes it or this group is dropped
            task = asyncio.create_task(self.serve_staged_updates(spec["group_id"], staged_channel))
            self._channel_tasks.add(task)
            task.add_done_callback(self._channel_tasks.discard)
        log.info("joined weight-sync group %s as rank %d of %d (%s)", spec["group_id"], spec["rank"], spec["world_size"], spec["transport"])

    async def update_weights(self, *, version: int, mode: str, hangup: Awaitable[Any] | None = None, staged: str = "") -> tuple[int, int, float]:
        """Receives a whole update, then makes `version` live. Returns (tensors, bytes, seconds).

        On a failed transfer the staging is dropped, the previous version stays live, and the error is raised.
        `hangup` completes when the trainer that announced the update hangs up (its process died): the
        receive is then given up at once. `staged` (CUDA IPC, announced on the group's channel): the update is
        already in the staging buffer, laid out as the last one (this digest); NotStaged (a ValueError) when not.
        """
        assert self.receiver is not None
        async with self._update_lock:
            self.update_in_progress = True
            start = time.perf_counter()
            try:
                try:
                    staging = self.receiver.take_staged(staged) if staged else await inbox.receive(self.receiver, hangup)
                except NotStaged:
                    raise
                except Exception as error:
                    self.counters.weight_syncs["failed"] += 1
                    log.error("weight sync to version %d failed (%s); keeping version %d and serving", version, error, self.generator.version)
                    raise
                received = time.perf_counter()
                try:
                    _check_finite(staging)
                    await self._apply(staging, version=version, mode=mode)
                except (ValueError, Undrained) as error:  # inf or NaN, a tensor not of this model's (name, shape), checked before any copy; or a drain past its deadline
                    self.counters.weight_syncs["failed"] += 1
                    log.error("weight update to version %d refused (%s); keeping version %d and serving", version, error, self.generator.version)
                    raise
                self.receiver.settle()  # CUDA IPC: the staging buffer read before the trainer hears "live"
            finally:
                self.update_in_progress = False
            seconds = (done := time.perf_counter()) - start
            self.counters.weight_syncs["ok"] += 1
            self.counters.last_sync_s = seconds
            self.metrics.weight_sync.observe(seconds)
            num_bytes = sum(t.numel() * t.element_size() for _, t in staging)
            # logged in the loop's next turn: the caller answers first (the staged-update channel's trainer waits for it)
            asyncio.get_running_loop().call_soon(
                self._log_live, version, len(staging), num_bytes, seconds, received - start, done - received, self.receiver.phases, mode
            )
            return len(staging), num_bytes, seconds

    @staticmethod
    def _log_live(version: int, num_tensors: int, num_bytes: int, seconds: float, receive_s: float, apply_s: float, phases: dict, mode: str) -> None:
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in phases.items())
        log.info("policy version %d live (%d tensors, %.1f MB, %.4f s: receive %.1f ms [%s], apply %.1f ms; %s)", version, num_tensors,
                 num_bytes / 2**20, seconds, receive_s * 1e3, parts, apply_s * 1e3, mode)  # fmt: skip

    async def serve_staged_updates(self, group_id: str, conn: socket.socket) -> None:
        """Serves group `group_id`'s staged-update channel (CUDA IPC): each announcement makes its version
        live through update_weights, as a full update's request does (weights/inbox.py serves the socket)."""
        await inbox.serve_channel(group_id, conn, functools.partial(self._staged_update, group_id))

    async def _staged_update(self, group_id: str, request: dict[str, Any]) -> dict[str, Any]:
        """The answer to one staged update's announcement: the live version, or why it is not live."""
        version, mode = request["version"], request["mode"]
        if self.receiver is None or self.receiver.group_id != group_id:
            return {"not_staged": True, "error": f"not in weight-sync group {group_id}"}
        try:
            num_tensors, num_bytes, seconds = await self.update_weights(version=version, mode=mode, staged=request["layout"])
        except NotStaged as error:
            return {"not_staged": True, "error": str(error)}
        except (RuntimeError, OSError, ValueError) as error:
            return {"error": f"weight sync to version {version} failed: {error}; kept version {self.generator.version}"}
        return {"policy_version": self.generator.version, "num_tensors": num_tensors, "num_bytes": num_bytes, "seconds": seconds}

    async def _apply(self, staging: list, *, version: int, mode: str) -> None:
        if mode == "pause":  # the generator freezes its running requests between decode steps
            await self.generator.update_weights(staging, version=version)
            return
        try:
            await self.gate.close(self.drain_timeout_s)
        except Undrained as error:
            raise Undrained(f"a drain-mode update waits for the running requests: {error}; --update_mode pause updates while they run") from None
        try:
            await self.generator.update_weights(staging, version=version)
        finally:
            self.gate.reopen()

    async def sleep(self, level: int) -> None:
        if level >= 2 and getattr(self.generator, "adapter_rank", 0):
            raise ValueError("/sleep level 2 would drop the base this server applies LoRA adapters beside (--max_lora_rank), and adapter pushes do not resend it; use level 1")
        async with self._update_lock:
            if self.asleep:
                return
            try:
                await self.gate.close(self.drain_timeout_s)
            except Undrained as error:
                raise Undrained(f"not asleep: {error}; the server stays awake and serving: sleep once they end, or raise --drain_timeout_s") from None
            self.asleep = True
            await self.generator.sleep(level)

    async def wake(self) -> None:
        async with self._update_lock:
            if not self.asleep:
                return
            await self.generator.wake()
            self.asleep = False
            self.gate.reopen()

    # --- observability ----------------------------------------------------------------------

    def readiness(self) -> dict[str, Any]:
        return dict(
            ready=not self.awaiting_weights,
            awaiting_weights=self.awaiting_weights,
            model=self.model_name,
            policy_version=self.generator.version,
            num_running=self.gate.num_running,
            num_queued=self.gate.num_queued,
            update_in_progress=self.update_in_progress,
            asleep=self.asleep,
            max_model_len=self.max_model_len,
            max_pending_requests=self.max_pending_requests,
            device_uuid=self.device_uuid,
            weight_group=self.receiver.group_id if self.receiver else None,
            max_lora_rank=getattr(self.generator, "adapter_rank", 0),
        )

    async def heartbeat(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            c = self.counters
            log.info(
                "heartbeat: version %d, running %d, queued %d, done %d, generated %d tokens%s",
                self.generator.version, self.gate.num_running, self.gate.num_queued, sum(c.requests.values()),
                c.generated_tokens, ", updating weights" if self.update_in_progress else "",
            )
