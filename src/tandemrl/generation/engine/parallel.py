"""Tensor parallelism of the engine: the ranks of one model, their collectives, and the leader's channel.

Every rank holds one shard of the model (heads, MLP columns and vocab rows split by rank) and runs the
same engine: the same scheduler on the same inputs, so the same batches, the same collectives in the
same order, and the same sampled tokens (every rank samples the gathered logits with the same
counter-based noise). Rank 0, the leader, takes the requests; before each step it sends what arrived
(new requests, aborts) and whether to step, and it sends weight updates, sleep and wake the same way,
so every rank changes state between the same two steps. Every wait has a deadline (`timeout_s`): a
silent leader is an error on a follower, and a dead follower is the leader's process owner's to catch
(workers.py watches its processes).

Groups are built from a store (no default process group) or handed in (colocate: ranks of a trainer
under torchrun); only their own collectives are used (all_reduce, all_gather, broadcast).
"""

from __future__ import annotations

import functools
import logging
import pickle
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tandemrl.generation.engine.sequence import Sequence

log = logging.getLogger(__name__)
MESSAGE_BYTES = 4096  # one broadcast carries a message this long (a step's usual one); longer ones take two
HEARTBEAT_S = 1.0  # an idle leader still speaks this often, so a follower's deadline means a dead leader


@dataclass(kw_only=True)
class TensorParallel:
    """One model's ranks. `group` carries the forward's collectives (NCCL on GPUs, gloo on CPU),
    `control` (gloo, CPU) the leader's messages. `broadcast_weights`: updates reach the leader only
    (a rollout server) and it broadcasts them; False when every rank is handed the same full tensors
    (colocate: each trainer rank gathers them)."""

    group: Any  # torch.distributed ProcessGroup
    control: Any  # torch.distributed ProcessGroup, gloo
    timeout_s: float = 300.0
    broadcast_weights: bool = True
    store: Any = None  # the rendezvous store, kept alive with the groups when this rank owns it
    owns_groups: bool = False  # made by connect(), so ended by close(); split_world's end with the world

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def close(self, deadline_s: float = 15.0) -> None:
        """Ends the groups connect() made, once this rank's engine stopped using them (and dropped its CUDA
        graphs: NCCL ends a communicator only after the graphs that captured its collectives are gone).
        Without it, a NCCL group left to its destructor at exit waits 120 s for an abort (seen on two
        H200s). Bounded: a group that does not end within `deadline_s` is left to the process's exit."""
        if not self.owns_groups:
            return
        self.owns_groups = False
        rank, groups = self.rank, (self.group, self.control)

        def end() -> None:
            for group in groups:
                try:
                    group.shutdown()
                except Exception as error:  # ending anyway: nothing is left to lose
                    log.warning("tensor-parallel rank %d: ending a group failed: %s: %s", rank, type(error).__name__, error)

        ender = threading.Thread(target=end, name="tp-close", daemon=True)
        ender.start()
        ender.join(deadline_s)
        if ender.is_alive():
            log.warning("tensor-parallel rank %d: its groups did not end within %g s; left to the process's exit", rank, deadline_s)

    # --- the forward's collectives -------------------------------------------------------------------
    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum over ranks, in place (identical on every rank)."""
        self.group.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: Tensor) -> Tensor:
        """[B, C] on each rank -> [B, size * C], rank r's columns at [r * C, (r + 1) * C)."""
        gathered = x.new_empty(self.size * x.shape[0], x.shape[1])  # [size * B, C]: one collective into one tensor
        self.group._allgather_base(gathered, x.contiguous()).wait()
        return gathered.view(self.size, *x.shape).permute(1, 0, 2).reshape(x.shape[0], -1)

    def min(self, value: int) -> int:
        """The smallest `value` of all ranks (e.g. KV blocks that fit on every GPU)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.control.allreduce([tensor], options).wait(timedelta(seconds=self.timeout_s))
        return int(tensor.item())

    # --- the leader's channel ------------------------------------------------------------------------
    def send(self, message: Any) -> None:
        """Leader: `message` (picklable) to every follower."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        head = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        inline = data[: MESSAGE_BYTES - 8]
        head[8 : 8 + len(inline)] = torch.frombuffer(bytearray(inline), dtype=torch.uint8)
        self._broadcast_control(head)
        if len(data) > len(inline):
            self._broadcast_control(torch.frombuffer(bytearray(data[len(inline) :]), dtype=torch.uint8))

    def receive(self) -> Any:
        """Follower: the leader's next message; raises when none comes within timeout_s."""
        head = torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
        self._broadcast_control(head)
        length = int(head[:8].view(torch.int64).item())
        data = head[8 : 8 + min(length, MESSAGE_BYTES - 8)].numpy().tobytes()
        if length > len(data):
            rest = torch.empty(length - len(data), dtype=torch.uint8)
            self._broadcast_control(rest)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def _broadcast_control(self, tensor: Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.control.broadcast([tensor], options).wait(timedelta(seconds=self.timeout_s))

    def shared_weights(self, weights: Iterable[tuple[str, Tensor]] | None, device: torch.device) -> Iterator[tuple[str, Tensor]]:
        """Leader (`weights` given): each named tensor, broadcast to the followers as it is yielded.
        Follower (`weights` None): the leader's tensors as they arrive, on `device`."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        if weights is not None:
            for name, tensor in weights:
                tensor = tensor.to(device).contiguous()
                self.send((name, tensor.dtype, tuple(tensor.shape)))
                self.group.broadcast([tensor], options).wait()
                yield name, tensor
            self.send(None)
            return
        while (meta := self.receive()) is not None:
            name, dtype, shape = meta
            tensor = torch.empty(shape, dtype=dtype, device=device)
            self.group.broadcast([tensor], options).wait()
            yield name, tensor


def connect(store: Any, *, rank: int, size: int, device: torch.device, timeout_s: float = 300.0) -> TensorParallel:
    """The two groups of one model's ranks, rendezvoused through `store` (a torch.distributed Store)."""
    timeout = timedelta(seconds=timeout_s)
    control = dist.ProcessGroupGloo(dist.PrefixStore("tp-control", store), rank, size, timeout)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(dist.PrefixStore("tp-device", store), rank, size, options)
    else:
        group = dist.ProcessGroupGloo(dist.PrefixStore("tp-device", store), rank, size, timeout)
    return TensorParallel(group=group, control=control, timeout_s=timeout_s, owns_groups=True)


def split_world(size: int, *, timeout_s: float = 300.0) -> TensorParallel:
    """Colocate under torchrun: ranks [k * size, (k + 1) * size) of the default process group split one
    engine (the first leads; it alone takes requests); each rank's trainer hands its engine the same full
    tensors (broadcast_weights False). Every rank of the world calls this (new_group is collective)."""
    world, rank, timeout = dist.get_world_size(), dist.get_rank(), timedelta(seconds=timeout_s)
    if world % size:
        raise ValueError(f"--tensor_parallel_size {size} must divide the {world} ranks")
    mine = None
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group, control = dist.new_group(ranks, timeout=timeout), dist.new_group(ranks, timeout=timeout, backend="gloo")
        if rank in ranks:
            mine = TensorParallel(group=group, control=control, timeout_s=timeout_s, broadcast_weights=False)
    return mine


@dataclass(frozen=True, slots=True)
class Shard:
    """This rank's share of one model: `rank` of `size`. Example: Shard(1, 2).span(12) -> (6, 6)."""

    rank: int = 0
    size: int = 1

    def span(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's part of `total` split evenly (total % size == 0)."""
        length = total // self.size
        return self.rank * length, length


def to_wire(event: tuple[str, Any]) -> tuple[str, Any]:
    """An engine inbox event as the leader sends it: what a follower needs to replay it (no callbacks).
    Example: ("abort", <Sequence 7>) -> ("abort", 7)."""
    kind, payload = event
    if kind == "abort":
        return kind, payload.seq_id
    return kind, [(s.seq_id, s.token_ids, s.params, s.seed, s.stop_ids) for s in payload]


def from_wire(event: tuple[str, Any], following: dict[int, Sequence]) -> tuple[str, Any]:
    """A follower's copy of the leader's event: its own Sequences, kept in `following` by the leader's
    seq_id until they finish (an abort of one already finished finds None)."""
    kind, payload = event
    if kind == "abort":
        return kind, following.get(payload)
    seqs = []
    for seq_id, token_ids, params, seed, stop_ids in payload:
        on_finish = functools.partial(_forget, following, seq_id)
        seqs.append(Sequence(token_ids, params, seed=seed, stop_ids=stop_ids, on_finish=on_finish, seq_id=seq_id))
        following[seq_id] = seqs[-1]
    return kind, seqs


def _forget(following: dict[int, Sequence], seq_id: int, _: Any) -> None:
    following.pop(seq_id, None)
