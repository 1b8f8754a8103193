"""The staged-update channel (CUDA IPC): one TCP connection per server, from the server to the trainer's
address, opened when the group forms. The trainer announces a staged update on it (version, mode, the
layout's digest) once the update's bytes are in the servers' staging buffers, and each server answers on
it once the version is live (or why not). It replaces an HTTP request and a gloo mark per update.

Messages are one JSON object a line. Every wait has a deadline; a peer that dies closes its end, which
the other sees at once (end of stream), never a hang. A server that has no update to make live waits on
its end for as long as the group lives (no deadline: updates may be far apart).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import torch

MAX_LINE_BYTES = 64 * 1024


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode() + b"\n"


def listen(host: str) -> socket.socket:
    """The trainer's listening socket for one group's channels (a free port on `host`)."""
    return socket.create_server((host, 0))


def accept(listener: socket.socket, *, group_id: str, num_servers: int, timeout_s: float) -> list[socket.socket]:
    """Every server's channel of group `group_id`, in rank order (non-blocking sockets, for the trainer's
    event loop). A connection that names another group (a server of a group given up) is closed."""
    deadline = time.monotonic() + timeout_s
    by_rank: dict[int, socket.socket] = {}
    while len(by_rank) < num_servers:
        listener.settimeout(max(1e-3, deadline - time.monotonic()))
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            raise TimeoutError(f"{num_servers - len(by_rank)} server(s) did not open the staged-update channel within {timeout_s:g} s") from None
        conn.settimeout(max(1e-3, deadline - time.monotonic()))
        hello = json.loads(_read_line_blocking(conn))
        if hello.get("group_id") != group_id or not 1 <= hello.get("rank", 0) <= num_servers:
            conn.close()
            continue
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setblocking(False)
        by_rank[hello["rank"]] = conn
    return [by_rank[rank] for rank in sorted(by_rank)]


def connect(host: str, port: int, *, group_id: str, rank: int, timeout_s: float) -> socket.socket:
    """A server's end of its channel to the trainer (blocking mode off: the server's event loop reads it)."""
    conn = socket.create_connection((host, port), timeout=timeout_s)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(encode({"group_id": group_id, "rank": rank}))
    conn.setblocking(False)
    return conn


def _read_line_blocking(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(MAX_LINE_BYTES)
        if not chunk or len(data) > MAX_LINE_BYTES:
            raise ConnectionError("the peer closed the staged-update channel before its hello")
        data += chunk
    return data


async def exchange(channels: list[socket.socket], message: dict[str, Any], *, timeout_s: float) -> list[dict[str, Any]]:
    """Sends `message` to every server, then returns each one's answer (rank order). ConnectionError when a
    server closed its end (it died or left the group), TimeoutError when one stays silent past `timeout_s`."""
    loop = asyncio.get_running_loop()
    data = encode(message)
    async with asyncio.timeout(timeout_s):
        for conn in channels:
            await loop.sock_sendall(conn, data)
        if len(channels) == 1:  # the usual case: one server on the GPU, no task to gather
            return [await _read_line(loop, channels[0])]
        return list(await asyncio.gather(*(_read_line(loop, conn) for conn in channels)))


async def _read_line(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await loop.sock_recv(conn, MAX_LINE_BYTES)
        if not chunk:
            raise ConnectionError("a server closed the staged-update channel (it died or left the group)")
        data += chunk
    return json.loads(data)


async def written(event: torch.cuda.Event | None, *, timeout_s: float) -> None:
    """Returns once the device ran the copies recorded before `event` (None: nothing to wait for). Polled
    (yielding to the loop's other tasks), not a thread's wait: a hand-off to a thread and back costs about
    as much as the copy takes."""
    if event is None:
        return
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the staged update's copies did not finish within {timeout_s:g} s")
        await asyncio.sleep(0)
