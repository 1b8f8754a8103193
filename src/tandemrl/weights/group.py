"""The weight-sync group: trainer rank 0 pushes windows (buckets.py) to the rollout servers. Metadata
and end marks travel over a gloo group (CPU); payload over NCCL across GPUs, over gloo on CPU, or, on
one shared GPU, by CUDA IPC: the trainer writes straight into each server's staging buffer.
WeightSender is the trainer's side, WeightReceiver a server's.

Wire of one window, all from rank 0: the metadata (one JSON message: names, dtypes, shapes, offsets,
buckets); then nccl/gloo: one broadcast per bucket, the trainer packing bucket k+1 while bucket k is on
the wire (two buffers); ipc: the servers' buffer handles gathered, the trainer writes the window into
each; then the end mark (gloo). An update is windows until one marked last.

CUDA IPC, an update laid out as the last one (one window) is staged, with no collective: the trainer
writes it into the servers' staging buffers mapped at that update (`WeightSender.write_staged`), then
announces it on each server's staged-update channel (channel.py: version, mode, the layout's digest;
`announce_staged`); each server makes its staging live (`WeightReceiver.take_staged`), and before it
answers on the channel that the version is live its copies out of the buffer have run (`settle`), so the
trainer may write the next update into it. A trainer that dies while writing never announces it: the
server keeps its version.

Invariants: every collective has a deadline (--weight_sync_timeout_s of no progress), and no thread
ever blocks inside an NCCL wait: completion is polled, so a dead peer is an error within the deadline
(at once where the gloo end mark sees the peer's socket close), never a hang, and no CUDA stream is
made to wait on a kernel that may never end; closing a group (from any thread) ends every wait in it,
and a server also gives up on a receive stuck elsewhere (service.py). A receiver returns every tensor
of an update or raises, never a part. A group is torn down in a daemon thread of its own: an NCCL communicator with a dead peer
can take long to abort, and that must never block a caller (a server's event loop). Groups are built
from a TCPStore directly (no default process group), so they coexist with the trainer's FSDP group and
an engine's tensor-parallel group, and are re-formed when a server restarts.
(Past 500 lines: sender and receiver are the two ends of one wire, full and staged, and read best
side by side; the window layout is already apart in buckets.py, the IPC buffers in ipc.py, the staged
updates' channel in channel.py.)
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tandemrl.weights import channel, ipc
from tandemrl.weights.base import DistributedSyncConfig
from tandemrl.weights.buckets import Named, Planner, Window, pack, unpack

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)

POLL_S = 5e-5  # between completion checks of a collective in flight
META_HEAD_BYTES = 64 * 1024  # the first metadata broadcast's fixed size (a 1.5B model's metadata is ~35 KB)
HANDLE_BYTES = 4096  # a server's CUDA IPC handle, JSON, padded
WINDOW_BUCKETS = 16  # a window spans at most this many buckets' bytes: what the trainer holds of a lazy producer


class NotStaged(ValueError):
    """A server has no staged update of the announced layout (CUDA IPC): the trainer sends it in full."""


class NotStarted(ConnectionError):
    """An update failed before the trainer took a tensor from its producer: a server is not in the group
    (restarted, or it left it); forming the group again and sending the same tensors is safe."""


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


class Phases:
    """Seconds spent in each named phase of one update (laps of one clock; a repeated phase adds up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


class _Group:
    """A gloo control group and the payload group (the same one unless NCCL) of one group id."""

    staged_channel: socket.socket | None = None  # a server's end of its channel (channel.py), set by connect; its server closes it

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, transport: str, timeout_s: float, device: torch.device):
        self.transport = transport
        self.timeout_s = timeout_s
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device if transport == "nccl" else torch.device("cpu")  # where payload buffers live
        self.closed = threading.Event()  # set by close(): every wait in this group ends with an error
        self.progress_at = time.monotonic()  # when a collective of this group last completed (or a wait began)
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world_size, self.timeout)
        self.payload = self.control
        if transport == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            with nccl_errors_raise():
                self.payload = dist.ProcessGroupNCCL(dist.PrefixStore("payload", store), rank, world_size, options)
            self.finish([self.broadcast(torch.zeros(1, device=device))])  # connects NCCL now, not inside the first update

    # --- collectives (root: the trainer) ---------------------------------------------------------------
    def broadcast(self, tensor: Tensor, *, group: Any = None) -> dist.Work:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return (group or self.payload).broadcast([tensor], options)

    def finish(self, works: Iterable[dist.Work], *, watch: dist.Work | None = None, cancel: threading.Event | None = None) -> None:
        """Returns once every work completed, polling: raises a work's error, TimeoutError after
        timeout_s without progress, the watch's error as soon as it fails (a gloo op whose peer died),
        or ConnectionError once `cancel` is set or the group is closed (by whoever gave up on the wait)."""
        pending = collections.deque(works)
        self.progress_at = last = time.monotonic()
        try:
            while pending:
                if pending[0].is_completed():
                    try:
                        pending.popleft().wait(self.timeout)  # raises the collective's error, else returns at once
                    except RuntimeError as error:  # gloo's own deadline (the same timeout_s) may pass before this loop's
                        if "timeout" in str(error).lower() or "timed out" in str(error).lower():
                            raise TimeoutError(f"no progress for {self.timeout_s:g} s (a peer died or stalled: {error})") from error
                        raise
                    self.progress_at = last = time.monotonic()
                    continue
                if watch is not None and watch.is_completed():
                    watch.wait(self.timeout)
                    watch = None
                if cancel is not None and cancel.is_set():
                    raise ConnectionError("cancelled: a server failed the update")
                if self.closed.is_set():
                    raise ConnectionError("cancelled: the weight-sync group was closed")
                if time.monotonic() - last > self.timeout_s:
                    raise TimeoutError(f"no progress for {self.timeout_s:g} s (a peer died or stalled)")
                time.sleep(POLL_S)
        except BaseException:
            pending.clear()  # the works die in this thread, not wherever the traceback is dropped (an event loop)
            if isinstance(works, (list, collections.deque)):
                works.clear()
            raise

    def hello(self, cancel: threading.Event | None = None) -> None:
        """Every member's first collective of an update (gloo, a few bytes): the trainer learns that each
        server is in this group before it takes a tensor (NotStarted if not); a server, that the trainer is."""
        mine = torch.zeros(1, dtype=torch.int64)
        everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(self.control.size())]
        try:
            self.finish([self.control.allgather([everyone], [mine])], cancel=cancel)
        except (RuntimeError, ConnectionError) as error:  # a peer gone (gloo saw its socket close) or cancelled; not a timeout
            raise NotStarted(f"a server is not in weight-sync group ({error})") from error

    def send_meta(self, data: bytes) -> None:
        head = torch.zeros(META_HEAD_BYTES, dtype=torch.uint8)
        head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        head[8 : 8 + len(data)] = torch.frombuffer(bytearray(data[: META_HEAD_BYTES - 8]), dtype=torch.uint8)
        self.finish([self.broadcast(head, group=self.control)])
        if len(data) > META_HEAD_BYTES - 8:
            self.finish([self.broadcast(torch.frombuffer(bytearray(data[META_HEAD_BYTES - 8 :]), dtype=torch.uint8), group=self.control)])

    def recv_meta(self) -> bytes:
        head = torch.zeros(META_HEAD_BYTES, dtype=torch.uint8)
        self.finish([self.broadcast(head, group=self.control)])
        size = int(head[:8].view(torch.int64))
        data = head[8 : 8 + size].numpy().tobytes()
        if size > META_HEAD_BYTES - 8:
            rest = torch.zeros(size - (META_HEAD_BYTES - 8), dtype=torch.uint8)
            self.finish([self.broadcast(rest, group=self.control)])
            data += rest.numpy().tobytes()
        return data

    def end_mark(self) -> dist.Work:
        """The window's end mark (gloo): the trainer posts it once its payload is out, a server before
        receiving, so that a dead trainer fails it at once."""
        return self.broadcast(torch.zeros(1, dtype=torch.int64), group=self.control)

    def gather_handles(self, handle: dict[str, Any] | None) -> list[dict[str, Any]]:
        """Every server's IPC handle (the trainer gives None)."""
        data = json.dumps(handle).encode()
        mine = torch.zeros(HANDLE_BYTES, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        everyone = [torch.zeros(HANDLE_BYTES, dtype=torch.uint8) for _ in range(self.control.size())]
        self.finish([self.control.allgather([everyone], [mine])])
        return [json.loads(t.numpy().tobytes().rstrip(b"\0")) for t in everyone[1:]]

    # --- teardown ---------------------------------------------------------------------------------------
    def close(self) -> threading.Thread:
        """Aborts (NCCL) and releases the process groups in a daemon thread, returned: only a process about
        to exit waits for it (torch's threads must be joined before the interpreter tears down)."""
        self.closed.set()
        if self.staged_channel is not None:
            with contextlib.suppress(OSError):  # shut down, not closed: the server's event loop owns the socket
                self.staged_channel.shutdown(socket.SHUT_RDWR)
        groups = [g for g in dict.fromkeys([self.payload, self.control]) if g is not None]
        self.payload = self.control = None
        thread = threading.Thread(target=_release, args=(groups, self.transport == "nccl"), name="weight-sync-release", daemon=True)
        thread.start()
        return thread


def digest(window: Window) -> str:
    """A window's layout (its metadata message), in a few bytes."""
    return hashlib.sha1(window.encode()).hexdigest()


def _record(flat: Tensor) -> torch.cuda.Event | None:
    """An event after this thread's stream's work so far (the copies into `flat`); None on CPU."""
    if not flat.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(flat.device))
    return event


def _settle(flat: Tensor) -> None:
    """Waits for this thread's stream's work (the copies into or out of `flat`) to finish; no-op on CPU."""
    if flat.is_cuda:
        torch.cuda.current_stream(flat.device).synchronize()


def _release(groups: list[Any], abort: bool) -> None:
    if abort:
        try:
            groups[0].abort()
        except Exception as error:  # noqa: BLE001 - nothing waits for this thread; the group is dropped anyway
            log.warning("aborting a weight-sync NCCL group failed: %s", error)
    groups.clear()  # the destructors (which join torch's watchdog thread) run here, not in the caller


class StagedTensors(list):
    """A server's staged update (CUDA IPC): (name, view into the staging buffer) of each tensor, made at the
    group's first update of a layout and handed over again, the same object never changed, for every
    update staged in that layout. Weak-referenceable, so the engine knows it again without a key."""

    __slots__ = ("__weakref__",)


class WeightSender:
    """Trainer rank 0's side: owns the rendezvous store (for its whole life) and the current group."""

    def __init__(self, config: DistributedSyncConfig):
        self.config = config
        self.group_id: str | None = None
        self._store: dist.TCPStore | None = None
        self._group: _Group | None = None
        self._world_size = 0
        self._transport = ""
        self._buffers: list[Tensor | None] = [None, None]  # the two bucket buffers packing alternates between
        self._planner: Planner | None = None  # the last update's layout, reused while the group lives
        self.phases: dict[str, float] = {}  # the last send's seconds by phase (hello, plan, meta, payload, end)
        self._mapped: dict[str, Tensor] = {}  # servers' IPC buffers opened in this process, by handle
        self._staged: tuple[Window, str, list[Tensor]] | None = None  # IPC: the last update's window, digest, servers' buffers
        self._releasing: list[threading.Thread] = []  # groups being torn down (close() waits for them)
        self._listener: socket.socket | None = None  # IPC with reuse: where the planned group's servers open their channels
        self._channels: list[socket.socket] = []  # IPC with reuse: each server's staged-update channel (channel.py), rank order
        self._clock: Phases | None = None  # the staged update in progress: its phases so far
        self._written: torch.cuda.Event | None = None  # the staged update in progress: recorded after its copies (CUDA)

    def plan(self, *, num_servers: int, transport: str, master_addr: str) -> list[dict[str, Any]]:
        """Starts a new group; returns what each server must be told to join it (ranks 1..N)."""
        if self._store is None:
            timeout = timedelta(seconds=self.config.weight_sync_timeout_s)
            self._store = dist.TCPStore(master_addr, self.config.weight_sync_port, None, True, timeout, wait_for_workers=False)
        self.close_group()
        self.group_id, self._world_size, self._transport = uuid.uuid4().hex[:12], num_servers + 1, transport
        if transport == "ipc" and self.config.weight_sync_ipc_reuse:
            self._listener = channel.listen(master_addr)
        return [
            dict(
                master_addr=master_addr,
                master_port=self._store.port,
                rank=rank,
                world_size=self._world_size,
                transport=transport,
                group_id=self.group_id,
                timeout_s=self.config.weight_sync_timeout_s,
                channel_port=self._listener.getsockname()[1] if self._listener is not None else 0,
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
        if self._listener is not None:
            self._channels = channel.accept(
                self._listener, group_id=self.group_id, num_servers=self._world_size - 1, timeout_s=self.config.weight_sync_timeout_s
            )

    def send(self, weights: Iterable[tuple[str, Tensor]], *, cancel: threading.Event | None = None) -> tuple[int, int]:
        """Pushes every tensor, window by window; setting `cancel` (from another thread) makes it raise
        soon after. Returns (tensors, bytes)."""
        group = self._group
        assert group is not None, "send() before connect()"
        if self._planner is None:
            bucket_bytes = max(1, int(self.config.weight_sync_bucket_mb * 2**20))
            self._planner = Planner(bucket_bytes, WINDOW_BUCKETS * bucket_bytes)
        clock = Phases()
        self._staged = None
        group.hello(cancel)  # NotStarted, with no tensor taken, when a server left the group
        clock.lap("hello")
        num_tensors = num_bytes = 0
        written: list[tuple[Window, list[Tensor]]] = []  # IPC: each window and the servers' buffers it went into
        for window, tensors in self._planner.windows(weights):
            clock.lap("plan")
            group.send_meta(window.encode())
            clock.lap("meta")
            if group.transport == "ipc":
                written.append((window, self._write_ipc(group, window, tensors)))
            else:
                self._broadcast_buckets(group, window, tensors, cancel)
            clock.lap("payload")
            group.finish([group.end_mark()], cancel=cancel)
            clock.lap("end")
            num_tensors, num_bytes = num_tensors + len(tensors), num_bytes + window.num_bytes
        if len(written) == 1 and self._channels:  # the planner keeps a one-window layout
            self._staged = (written[0][0], digest(written[0][0]), written[0][1])
        self.phases = clock.seconds
        return num_tensors, num_bytes

    @property
    def staged_layout(self) -> str | None:
        """CUDA IPC: the digest of the last update's layout when its servers' buffers are mapped here, so an
        update laid out alike may be staged (`write_staged`, `announce_staged`); None otherwise."""
        return self._staged[1] if self._staged is not None else None

    def write_staged(self, weights: Iterable[tuple[str, Tensor]]) -> bool:
        """The first half of a staged update: writes it into every server's staging buffer (the copies
        queued, not waited for: `announce_staged` does). False, nothing written, when the weights are not
        laid out as the last update: the servers hear nothing, and the caller sends it in full."""
        staged = self._staged
        assert staged is not None and self._planner is not None and self._channels, "write_staged() without a staged layout"
        window, _, buffers = staged
        self._clock = clock = Phases()
        matched, _ = self._planner.match(weights)
        clock.lap("plan")
        if matched is None or matched[0] is not window:
            return False
        for flat in buffers:
            pack(window, matched[1], flat)
        self._written = _record(buffers[0])
        clock.lap("pack")
        return True

    async def announce_staged(self, *, version: int, mode: str) -> None:
        """The second half: once the device ran the copies, tells every server over its channel that
        `version` (laid out as `staged_layout`) is in its buffer, and returns once each answers that it is
        live. NotStaged when a server cannot take it staged (send it in full, in a group formed again);
        ConnectionError/TimeoutError when one died or stalled (it keeps its version)."""
        staged, clock = self._staged, self._clock
        assert staged is not None and clock is not None, "announce_staged() before write_staged()"
        await channel.written(self._written, timeout_s=self.config.weight_sync_timeout_s)
        clock.lap("payload")
        message = {"version": version, "mode": mode, "layout": staged[1]}
        answers = await channel.exchange(self._channels, message, timeout_s=self.config.weight_sync_timeout_s)
        clock.lap("answer")
        self.phases = clock.seconds
        refused = [a["error"] for a in answers if "error" in a]
        if any(a.get("not_staged") for a in answers):
            raise NotStaged("; ".join(refused))
        if refused:
            raise RuntimeError("; ".join(refused))

    def _broadcast_buckets(self, group: _Group, window: Window, tensors: list[Tensor], cancel: threading.Event | None) -> None:
        """One broadcast per bucket; bucket k+1 is packed into the other buffer while bucket k travels."""
        in_flight: collections.deque[dist.Work] = collections.deque()
        for k, (start, end, _, _) in enumerate(window.buckets):
            if len(in_flight) == 2:
                group.finish([in_flight.popleft()], cancel=cancel)  # bucket k-2 left buffer k % 2
            buffer = self._buffer(k % 2, end - start, group.device)
            pack(window, tensors, buffer, bucket=k)
            in_flight.append(group.broadcast(buffer))
        group.finish(in_flight, cancel=cancel)

    def _buffer(self, index: int, num_bytes: int, device: torch.device) -> Tensor:
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < num_bytes or buffer.device != device:
            self._buffers[index] = buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        return buffer[:num_bytes]

    def _write_ipc(self, group: _Group, window: Window, tensors: list[Tensor]) -> list[Tensor]:
        """Writes the window straight into every server's staging buffer (one GPU: no byte is copied twice);
        returns those buffers (the window's bytes of each), in rank order."""
        device = tensors[0].device
        buffers = []
        for handle in group.gather_handles(None):
            key = json.dumps(handle, sort_keys=True)
            if key not in self._mapped:
                self._mapped[key] = ipc.open_shared(handle, device)
            buffers.append(self._mapped[key][: window.num_bytes])
            pack(window, tensors, buffers[-1])
        _settle(buffers[0])  # written before the end mark tells the servers so
        return buffers

    def close_group(self) -> None:
        self._releasing = [t for t in self._releasing if t.is_alive()]
        if self._group is not None:
            self._releasing.append(self._group.close())
        self._group, self.group_id = None, None
        for conn in [*self._channels, *([self._listener] if self._listener is not None else [])]:
            conn.close()  # a server waiting on its channel sees its end: it leaves nothing behind
        self._channels, self._listener = [], None
        self._mapped.clear()
        self._planner = None  # its windows hold views into the mapped buffers
        self._staged = self._clock = self._written = None

    def close(self, wait_s: float = 10.0) -> None:
        """Drops the group and the store; waits up to `wait_s` for groups still being torn down."""
        self.close_group()
        deadline = time.monotonic() + wait_s
        for thread in self._releasing:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._releasing = [t for t in self._releasing if t.is_alive()]
        self._buffers = [None, None]
        self._store = None


class WeightReceiver:
    """A rollout server's side: joins the trainer's group and receives whole updates into staging."""

    def __init__(self, device: torch.device):
        self.device = device
        self.group_id: str | None = None
        self._group: _Group | None = None
        self._lock = threading.Lock()  # a receive left behind and the server's event loop may both drop the group
        self._buffers: list[tuple[Tensor, dict[str, Any] | None]] = []  # per window: its staging buffer (kept), IPC handle
        self._window: Window | None = None  # the last metadata received, decoded (an update like the last reuses it)
        self._staged: tuple[str, StagedTensors] | None = None  # IPC: the one-window layout last received whole in this group: digest, tensors
        self.phases: dict[str, float] = {}  # the last receive's seconds by phase (hello, meta, payload, unpack)

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
        group = _Group(
            store, rank=spec["rank"], world_size=spec["world_size"], transport=spec["transport"], timeout_s=spec["timeout_s"], device=self.device
        )
        if spec.get("channel_port"):
            group.staged_channel = channel.connect(
                spec["master_addr"], spec["channel_port"], group_id=spec["group_id"], rank=spec["rank"], timeout_s=spec["timeout_s"]
            )
        return group

    def adopt(self, group_id: str, group: _Group) -> None:
        if any(handle is not None for _, handle in self._buffers):  # a trainer of an earlier group may still write them
            self._buffers = []
            if self._window is not None:
                self._window.views.clear()
        self._staged = None
        self._group, self.group_id = group, group_id

    def stalled_s(self) -> float:
        """Seconds since the group's last completed collective (0 without a group): a server gives up on a
        receive stuck past the group's timeout, wherever the receiving thread is blocked."""
        group = self._group
        return 0.0 if group is None else time.monotonic() - group.progress_at

    @property
    def timeout_s(self) -> float:
        return self._group.timeout_s if self._group is not None else 0.0

    def receive(self) -> Named:
        """Every tensor of one update, staged apart from the live weights. On any failure the group is
        dropped (a broken collective cannot be resumed) and the error raised; nothing partial escapes.
        close() from another thread ends the receive with an error (ConnectionError)."""
        group = self._group
        assert group is not None, "receive() outside a group"
        group.progress_at = time.monotonic()
        staging: Named = []
        clock = Phases()
        self._staged = None
        try:
            group.hello()
            clock.lap("hello")
            for index in itertools.count():
                window = self._decode(group.recv_meta())
                clock.lap("meta")
                ipc_ = group.transport == "ipc"
                flat = self._staging_buffer(index, window.num_bytes, self.device if ipc_ else group.device, share=ipc_)
                flat = self._receive_ipc(group, window, index, flat) if ipc_ else self._receive_buckets(group, window, flat)
                clock.lap("payload")
                staging += unpack(window, flat)
                clock.lap("unpack")
                if window.last:
                    break
        except BaseException:
            self._drop(group)
            raise
        if group.transport == "ipc" and index == 0:
            staging = StagedTensors(staging)
            self._staged = (digest(window), staging)
        self.phases = clock.seconds
        return staging

    def take_staged(self, layout: str) -> Named:
        """A staged update (CUDA IPC; the trainer announced it on the channel once written): the tensors in
        this server's staging buffer, laid out as the last update received whole in this group (`layout`: its
        digest). NotStaged when it is not (this server has no such layout: it joined another group since, or
        restarted): the trainer then sends it in full, in a group formed again. No collective, no wait."""
        if self._group is None or self._staged is None or layout != self._staged[0]:
            raise NotStaged(f"no staged update laid out as {layout[:12]} here; send it in full")
        self.phases = {}
        return self._staged[1]

    @property
    def staged_channel(self) -> socket.socket | None:
        """This group's staged-update channel (CUDA IPC with reuse), for the server to serve; None otherwise."""
        return self._group.staged_channel if self._group is not None else None

    def settle(self) -> None:
        """After an update was applied: with CUDA IPC, returns once the copies out of the staging buffer
        ran (the engine copies on the default stream), since the trainer writes the next update into it,
        unannounced, as soon as it hears that this one is live. A stream's wait, not the device's."""
        if self._buffers and self._buffers[0][1] is not None:
            _settle(self._buffers[0][0])

    def _decode(self, data: bytes) -> Window:
        if self._window is None or self._window.encoded != data:
            self._window = Window.from_json(json.loads(data))
            self._window.encoded = data
        return self._window

    def _staging_buffer(self, index: int, num_bytes: int, device: torch.device, *, share: bool) -> Tensor:
        """Window `index`'s staging bytes: kept across updates (as are the views into them). The last
        update's apply (the engine's copies, on the default stream) has read them before they are written
        again: an NCCL receive is queued after it on the device; for CUDA IPC the device is synchronized,
        since the trainer writes from another process. Never a device-wide sync for NCCL: a dead trainer's
        receive may leave a kernel that never ends (its group aborted), and the next trainer's update must
        not wait for it. [bytes]"""
        kept = self._buffers[index] if index < len(self._buffers) else None
        if kept is None or kept[0].numel() < num_bytes or kept[0].device != device or (share and kept[1] is None):
            buffer, handle = ipc.shared_buffer(num_bytes, device) if share else (torch.empty(num_bytes, dtype=torch.uint8, device=device), None)
            self._buffers[index : index + 1] = [(buffer, handle)]
            if self._window is not None:
                self._window.views.clear()  # views into the buffer replaced: let it go
        buffer = self._buffers[index][0]
        if share and buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)
        return buffer[:num_bytes]

    def _receive_buckets(self, group: _Group, window: Window, flat: Tensor) -> Tensor:
        if group.payload is group.control:  # gloo: one group, so the end mark keeps its place in line
            group.finish([group.broadcast(flat[start:end]) for start, end, _, _ in window.buckets])
            group.finish([group.end_mark()])
            return flat
        end_mark = group.end_mark()  # fails at once if the trainer dies while the payload is on the wire
        group.finish([group.broadcast(flat[start:end]) for start, end, _, _ in window.buckets], watch=end_mark)
        group.finish([end_mark])
        return flat

    def _receive_ipc(self, group: _Group, window: Window, index: int, flat: Tensor) -> Tensor:
        group.gather_handles(self._buffers[index][1])  # after the device sync: the trainer may write the buffer now
        group.finish([group.end_mark()])
        return flat

    def close(self) -> None:
        self._drop(self._group)

    def _drop(self, group: _Group | None) -> None:
        """Closes `group` if it is still this receiver's: a receive that fails late (left behind by the
        server) never closes the group a new trainer formed since."""
        with self._lock:
            if group is None or group is not self._group:
                return
            self._group, self.group_id = None, None
        group.close()
