"""The receiving end of weight sync as a rollout server's event loop runs it: joining a trainer's group
within a deadline, receiving an update in a thread that is given up once the trainer hangs up or stalls,
and serving a group's staged-update channel. weights/group.py's WeightReceiver moves the bytes; the
rollout service (server/service.py) decides what a received update does (the gate, the version, counters).

Invariant: every wait here ends within the group's timeout plus a slack, even when the thread under it is
stuck in a collective whose peer died (that thread is left behind, and its late outcome dropped).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from tandemrl.threads import in_daemon_thread
from tandemrl.weights import channel
from tandemrl.weights.group import WeightReceiver

log = logging.getLogger(__name__)
JOIN_SLACK_S = 5.0  # past the group's own timeout, the server stops waiting for torch's rendezvous
RECEIVE_SLACK_S = 2.0  # past the group's own timeout of no progress, the server gives up on a receive stuck in a collective
WATCH_S = 0.1  # how often a receive in flight is checked for a stall


async def join(receiver: WeightReceiver, spec: dict[str, Any]) -> socket.socket | None:
    """Joins the group `spec` announces (the last one closed first); returns its staged-update channel (CUDA
    IPC) or None. Every step of the rendezvous has the deadline, whatever torch does with a silent peer: a
    connect left behind (in a daemon thread) is dropped when it ends."""
    receiver.close()
    connect = in_daemon_thread(functools.partial(receiver.connect, spec), name="weight-sync-join")
    try:  # not wait_for, which on 3.11 swallows a cancel arriving as the rendezvous ends (the group then adopted)
        async with asyncio.timeout(spec["timeout_s"] + JOIN_SLACK_S):
            group = await connect
    except TimeoutError:
        raise TimeoutError(
            f"no weight-sync group at {spec['master_addr']}:{spec['master_port']} within {spec['timeout_s']:g} s "
            "(the peer is silent or gone)"
        ) from None
    receiver.adopt(spec["group_id"], group)
    return group.staged_channel


async def receive(receiver: WeightReceiver, hangup: Awaitable[Any] | None) -> list:
    """An update's tensors, received in a daemon thread. Given up (the group closed, which aborts its
    collectives, and the thread left behind) once the trainer hangs up or the receive has made no progress
    for the group's timeout + RECEIVE_SLACK_S: an NCCL collective whose peer died may never complete, nor
    return the thread that waits in it, and the server must not wait with it."""
    receiving = in_daemon_thread(receiver.receive, name="weight-sync-receive")
    watch = asyncio.ensure_future(_watch(receiver, hangup))
    try:
        await asyncio.wait({receiving, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not receiving.done():
            watch.result()  # raises why the receive is given up
        return receiving.result()
    except BaseException:
        receiving.cancel()  # a late outcome is dropped, never applied
        receiver.close()  # ends the receive's waits; aborts the group in a thread of its own
        raise
    finally:
        watch.cancel()


async def _watch(receiver: WeightReceiver, hangup: Awaitable[Any] | None) -> None:
    """Raises ConnectionError once the trainer hangs up, TimeoutError once the receive stalls."""
    gone = asyncio.ensure_future(hangup) if hangup is not None else None
    try:
        while True:
            if gone is not None and gone.done():
                raise ConnectionError("the trainer hung up mid-update (its process died or it gave up)")
            if receiver.stalled_s() > receiver.timeout_s + RECEIVE_SLACK_S:
                raise TimeoutError(f"no progress for {receiver.stalled_s():.0f} s (the trainer died or stalled)")
            await (asyncio.wait({gone}, timeout=WATCH_S) if gone is not None else asyncio.sleep(WATCH_S))
    finally:
        if gone is not None:
            gone.cancel()


async def serve_channel(group_id: str, conn: socket.socket, answer: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
    """Serves group `group_id`'s staged-update channel (weights/channel.py) until the trainer closes it or
    the group is dropped: each announcement line is answered with `answer(announcement)`, in order."""
    reader, writer = await asyncio.open_connection(sock=conn)
    try:
        while line := await reader.readline():
            writer.write(channel.encode(await answer(json.loads(line))))
            await writer.drain()
    except (ConnectionError, ValueError) as error:
        log.warning("the staged-update channel of weight-sync group %s failed: %s", group_id, error)
    finally:
        writer.close()
