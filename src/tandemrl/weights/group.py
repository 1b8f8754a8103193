"""The weight-sync group: trainer rank 0 broadcasts buckets (buckets.py) to the rollout servers over a
torch.distributed group (gloo on CPU, NCCL across GPUs, CUDA IPC handles over a gloo group when both
sit on one GPU). WeightSender is the trainer's side, WeightReceiver a server's.

Invariants: every collective has a deadline (--weight_sync_timeout_s), so a dead peer is an error,
never a hang; a receiver returns every tensor of an update or raises, never a part. Groups are built
from a TCPStore directly (no default process group), so they coexist with the trainer's FSDP group and
an engine's tensor-parallel group, and can be re-formed when a server restarts.

Wire of one bucket, broadcast from rank 0: header int64[2] = (meta bytes, payload bytes), (0, 0) ends
the update; meta = UTF-8 JSON {"tensors": [{name, dtype, shape, offset}], "ipc": handle?}; payload =
uint8[payload bytes] (absent for ipc: the server maps the trainer's bucket, then all ranks barrier).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tandemrl.weights import ipc
from tandemrl.weights.base import DistributedSyncConfig
from tandemrl.weights.buckets import Named, pack_buckets, unpack_bucket

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)


NCCL_GROUP_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # CleanUpOnly: abort the communicator, raise in the waiter
    "TORCH_NCCL_ENABLE_MONITORING": "0",  # no std::abort from the heartbeat monitor some minutes after a timeout
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",  # a dead peer is expected here: no flight-recorder dump to disk
}


@contextlib.contextmanager
def nccl_errors_raise() -> Iterator[None]:
    """ProcessGroupNCCL objects built inside this block survive a dead peer: a failed or timed-out
    collective aborts their communicator and raises in the waiting thread, instead of torch's defaults
    taking the whole process down (the watchdog at once, mode 3; or the heartbeat monitor a heartbeat
    timeout after the flight-recorder dump). A dead trainer must not kill a rollout server, nor a dead
    server its trainer. torch reads these variables when a group is built, so only our groups are affected.
    Caveat: torch's dump signal is process-wide and served by the process's first NCCL group; today that
    is ours (neither the trainer nor the server builds another), but a process whose first group is built
    elsewhere with torch's defaults (a future multi-GPU trainer) would be aborted by that group's monitor
    some minutes after one of our collectives failed, unless it too turns monitoring or dumping off."""
    previous = {name: os.environ.get(name) for name in NCCL_GROUP_ENV}
    os.environ.update(NCCL_GROUP_ENV)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _Group:
    """One process group whose every collective waits at most `timeout_s`."""

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, transport: str, timeout_s: float, device: torch.device):
        self.transport = transport
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device if transport == "nccl" else torch.device("cpu")  # where wire tensors live
        if transport == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            with nccl_errors_raise():
                self.pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)

    def broadcast(self, tensor: Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            self.pg.broadcast([tensor], options).wait(self.timeout)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Frees an NCCL communicator stuck on a dead peer (a broken group is never reused)."""
        abort = getattr(self.pg, "abort", None) if self.transport == "nccl" else None
        if abort is not None:
            try:
                abort()
            except Exception as error:  # noqa: BLE001 - the collective's own error is the one to raise
                log.warning("aborting the weight-sync NCCL group failed: %s", error)

    def barrier(self) -> None:
        self.pg.barrier(dist.BarrierOptions()).wait(self.timeout)

    def send_bytes(self, data: bytes) -> None:
        self.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device))

    def recv_bytes(self, num_bytes: int) -> bytes:
        buffer = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        self.broadcast(buffer)
        return buffer.cpu().numpy().tobytes()


class WeightSender:
    """Trainer rank 0's side: owns the rendezvous store (for its whole life) and the current group."""

    def __init__(self, config: DistributedSyncConfig):
        self.config = config
        self.group_id: str | None = None
        self._store: dist.TCPStore | None = None
        self._group: _Group | None = None
        self._world_size = 0
        self._transport = ""

    def plan(self, *, num_servers: int, transport: str, master_addr: str) -> list[dict[str, Any]]:
        """Starts a new group; returns what each server must be told to join it (ranks 1..N)."""
        if self._store is None:
            timeout = timedelta(seconds=self.config.weight_sync_timeout_s)
            self._store = dist.TCPStore(master_addr, self.config.weight_sync_port, None, True, timeout, wait_for_workers=False)
        self.close_group()
        self.group_id, self._world_size, self._transport = uuid.uuid4().hex[:12], num_servers + 1, transport
        return [
            dict(
                master_addr=master_addr,
                master_port=self._store.port,
                rank=rank,
                world_size=self._world_size,
                transport=transport,
                group_id=self.group_id,
                timeout_s=self.config.weight_sync_timeout_s,
            )
            for rank in range(1, num_servers + 1)
        ]

    def connect(self, device: torch.device) -> None:
        """Blocks until every server joined the planned group (or the deadline passed)."""
        assert self._store is not None and self.group_id is not None
        store = dist.PrefixStore(f"tandem/{self.group_id}", self._store)
        self._group = _Group(
            store, rank=0, world_size=self._world_size, transport=self._transport, timeout_s=self.config.weight_sync_timeout_s, device=device
        )

    def send(self, weights: Iterable[tuple[str, Tensor]]) -> tuple[int, int]:
        """Broadcasts every tensor, bucket by bucket, then the end mark. Returns (tensors, bytes)."""
        group = self._group
        assert group is not None, "send() before connect()"
        bucket_bytes = max(1, int(self.config.weight_sync_bucket_mb * 2**20))
        wire_device = None if group.transport == "ipc" else group.device
        num_tensors = num_bytes = 0
        for meta, flat in pack_buckets(weights, bucket_bytes, wire_device):
            header: dict[str, Any] = {"tensors": meta}
            if group.transport == "ipc":
                torch.cuda.current_stream(flat.device).synchronize()
                header["ipc"] = ipc.share(flat)
            data = json.dumps(header).encode()
            payload = 0 if group.transport == "ipc" else flat.numel()
            group.broadcast(torch.tensor([len(data), payload], dtype=torch.int64, device=group.device))
            group.send_bytes(data)
            if group.transport == "ipc":
                group.barrier()  # every server copied the bucket: its memory may be reused
            else:
                group.broadcast(flat)
            num_tensors, num_bytes = num_tensors + len(meta), num_bytes + flat.numel()
        group.broadcast(torch.zeros(2, dtype=torch.int64, device=group.device))
        return num_tensors, num_bytes

    def close_group(self) -> None:
        self._group = None
        self.group_id = None

    def close(self) -> None:
        self.close_group()
        self._store = None


class WeightReceiver:
    """A rollout server's side: joins the trainer's group and receives whole updates into staging."""

    def __init__(self, device: torch.device):
        self.device = device
        self.group_id: str | None = None
        self._group: _Group | None = None

    def join(self, spec: dict[str, Any]) -> None:
        """Blocks until the trainer and every other server joined (or the deadline passed)."""
        self.close()
        self.adopt(spec["group_id"], self.connect(spec))

    def connect(self, spec: dict[str, Any]) -> _Group:
        """The group of `spec`, formed (blocking); not yet this receiver's. The caller bounds the wait:
        a peer that accepts the connection and never speaks holds some of torch's steps past their timeout."""
        timeout = timedelta(seconds=spec["timeout_s"])
        client = dist.TCPStore(spec["master_addr"], spec["master_port"], None, False, timeout)
        store = dist.PrefixStore(f"tandem/{spec['group_id']}", client)
        return _Group(
            store, rank=spec["rank"], world_size=spec["world_size"], transport=spec["transport"], timeout_s=spec["timeout_s"], device=self.device
        )

    def adopt(self, group_id: str, group: _Group) -> None:
        self._group, self.group_id = group, group_id

    def receive(self) -> Named:
        """Every tensor of one update, staged apart from the live weights. On any failure the group is
        dropped (a broken collective cannot be resumed) and the error raised; nothing partial escapes."""
        group = self._group
        assert group is not None, "receive() outside a group"
        staging: Named = []
        try:
            while True:
                header = torch.zeros(2, dtype=torch.int64, device=group.device)
                group.broadcast(header)
                meta_len, payload_len = header.tolist()
                if meta_len == 0:
                    return staging
                meta = json.loads(group.recv_bytes(meta_len))
                if group.transport == "ipc":
                    flat = ipc.open_shared(meta["ipc"], self.device).clone()
                    torch.cuda.current_stream(self.device).synchronize()
                    group.barrier()
                else:
                    flat = torch.empty(payload_len, dtype=torch.uint8, device=group.device)
                    group.broadcast(flat)
                staging += unpack_bucket(meta["tensors"], flat)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._group = None
        self.group_id = None
