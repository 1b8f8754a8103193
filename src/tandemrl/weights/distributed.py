"""Server placement weight sync: the trainer's new weights reach every rollout server over the
weight-sync group (group.py), in buckets (buckets.py), and each server makes the new version live.

This module owns the whole job: it picks the transport, forms the group with the servers (again after
a failure or a server restart) and pushes; the rollout client (generation/remote/client.py) only
carries the HTTP calls that tell the servers to join a group and to receive an update.

Invariant: a publish either makes `version` live on every server or raises one error naming the
version; after a failure the group is dropped and the next publish forms a new one. With CUDA IPC an
update laid out as the last one is staged (group.py) and announced on a channel of its own (channel.py),
not over HTTP; one laid out otherwise goes in full, and one a server does not take staged (it restarted or
left the group) goes in full in a group formed again.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import socket
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from tandemrl.generation.remote.liveness import SilentServer
from tandemrl.threads import in_daemon_thread
from tandemrl.weights import ipc
from tandemrl.weights.base import DistributedSyncConfig
from tandemrl.weights.group import NotStarted, WeightSender

if TYPE_CHECKING:
    from torch import Tensor

    from tandemrl.generation.remote import RolloutClient

log = logging.getLogger(__name__)
JOIN_SLACK_S = 5.0  # past the group's own timeout, the trainer stops waiting for torch's rendezvous
CANCEL_GRACE_S = 5.0  # how long a failed update waits for its send to notice the cancel


class DistributedSync:
    """WeightSync for server placement, through the trainer's RolloutClient."""

    def __init__(self, config: DistributedSyncConfig, client: RolloutClient):
        self.config = config
        self.client = client
        self.sender = WeightSender(config)

    async def publish(self, weights: Iterable[tuple[str, Tensor]], *, version: int) -> None:
        """Pushes every tensor to every server; `version` is live on all of them on return."""
        stream = iter(weights)
        first = next(stream, None)
        if first is None:
            raise ValueError("publish got no tensors")
        weights = itertools.chain([first], stream)
        try:
            if self.sender.group_id is None:
                await self._form_group(first[1])
            weights = await self._push_staged(weights, version)
            if weights is None:
                return
            try:  # a live group costs no readiness round trip: the update's first collective checks it
                await self._push(weights, version)
            except NotStarted as error:  # a server restarted or left the group since the last update; no tensor taken
                log.info("weight-sync group %s lost a server (%s); forming it again", self.sender.group_id, error)
                self.sender.close_group()
                await self._form_group(first[1])
                await self._push(weights, version)
        except Exception as error:
            self.sender.close_group()
            raise RuntimeError(f"weight sync of version {version} to {', '.join(self.client.urls)} failed: {error}") from error

    async def close(self) -> None:
        await asyncio.to_thread(self.sender.close)

    def transport(self, sample: Tensor, infos: list[dict[str, Any]]) -> str:
        """auto: gloo for CPU weights, CUDA IPC when every server shares the trainer's GPU, else nccl."""
        if self.config.weight_sync_backend != "auto":
            return self.config.weight_sync_backend
        uuid = ipc.device_uuid(sample.device)
        return "gloo" if uuid is None else "ipc" if all(i["device_uuid"] == uuid for i in infos) else "nccl"

    async def _form_group(self, sample: Tensor) -> None:
        """(Re)forms the group with every server: after start, a failure, or a server restart."""
        transport = self.transport(sample, await self.client.servers_ready())
        master_addr = self.config.weight_sync_host or local_address_to(self.client.urls[0])
        specs = self.sender.plan(num_servers=len(self.client.urls), transport=transport, master_addr=master_addr)
        joins = asyncio.ensure_future(self.client.join_weight_group(specs, timeout_s=self.config.weight_sync_timeout_s + 10))
        try:  # a server that dies while NCCL connects can hold torch's rendezvous past its timeout: bounded here, not by
            # wait_for, which on 3.11 swallows a cancel arriving as the rendezvous ends (the cancelled publish went on to push)
            connect = in_daemon_thread(functools.partial(self.sender.connect, sample.device), name="weight-sync-connect")
            async with asyncio.timeout(self.config.weight_sync_timeout_s + JOIN_SLACK_S):
                await connect
            await joins
        except Exception as error:
            raise ConnectionError(f"could not form the weight-sync group ({transport} at {master_addr}): {error}") from error
        finally:  # failed or cancelled: the servers' joins are not left running
            joins.cancel()
        log.info("weight-sync group %s formed with %d server(s) over %s", self.sender.group_id, len(self.client.urls), transport)

    async def _push_staged(self, weights: Iterable[tuple[str, Tensor]], version: int) -> Iterable[tuple[str, Tensor]] | None:
        """CUDA IPC, when the last update left the servers' buffers mapped: the update staged (written into
        them, then announced on each server's channel; no HTTP request, no collective); None once live.
        Otherwise the weights to send in full (none lost): in this group when they are laid out otherwise
        (the servers heard nothing), in a group formed again when a server did not take them staged."""
        if self.sender.staged_layout is None:
            return weights
        weights = list(weights)  # kept for the full send if it is refused (a staged layout is one window: <= 16 buckets)
        start = time.perf_counter()
        try:  # a write that fails half-way was never announced: the servers keep their version
            if not self.sender.write_staged(weights):
                return weights
            await self.sender.announce_staged(version=version, mode=self.config.update_mode)
        except Exception as error:  # noqa: BLE001 - any refusal: the full path says what is wrong, in a new group
            log.info("version %d was not taken staged (%s); sending it in full in a new group", version, error)
            self.sender.close_group()
            await self._form_group(weights[0][1])
            return weights
        self.sender.phases["live"] = time.perf_counter() - start
        return None

    async def _push(self, weights: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Sends every window while each server receives, then waits for each to make `version` live. A
        server that fails (its answer an error, or its connection gone) stops the send at once."""
        body = {"version": version, "mode": self.config.update_mode, "group_id": self.sender.group_id}
        updates = asyncio.ensure_future(self.client.announce_update(body, timeout_s=self.config.weight_sync_timeout_s))
        cancel = threading.Event()
        send = in_daemon_thread(functools.partial(self.sender.send, weights, cancel=cancel), name="weight-sync-send")
        try:
            await asyncio.wait({send, updates}, return_when=asyncio.FIRST_EXCEPTION)
            if updates.done() and updates.exception() is not None:
                cancel.set()
                # the send polls `cancel`; one stuck in a collective on the dead server is left behind (the
                # group is aborted by the caller). A silent server says nothing more: no grace, no new group
                if not isinstance(updates.exception(), SilentServer):
                    await asyncio.wait({send}, timeout=CANCEL_GRACE_S)
                    if send.done() and isinstance(send.exception(), NotStarted):
                        raise send.exception()  # the server's answer (not in this group): form it again
                send.cancel()
                updates.result()
            await send
            await updates
        finally:
            cancel.set()
            updates.cancel()


def local_address_to(url: str) -> str:
    """The local address that routes to `url`'s host (what a server uses to reach this trainer)."""
    host = urlparse(url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]
