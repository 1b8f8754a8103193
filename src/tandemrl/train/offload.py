"""Offload: the trainer's tensors wait in pinned CPU memory while the engine generates, and come back for
training, every tensor object kept (optimizer state, parameters and their views, FSDP2's DTensor shards).

A tensor's storage is copied out and resized to 0 bytes, later resized back and copied in, so whatever
holds the tensor (the optimizer, the compute twin, a sharded parameter) needs no telling. Invariant:
between `offload` and `reload` nothing reads those tensors; after `reload` and `wait` every byte is what
it was before `offload` (tests: a run with offload trains bit-identically to one without). Copies out
run on the current stream, so the freed memory is reusable at once in stream order; copies back run on
a side stream, overlapping the forward until `wait`.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from tandemrl.train.config import OffloadConfig


class StorageOffload:
    """The storages under some tensors, moved to CPU (`keep`) or freed without a copy (`drop`), and back."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")  # of the storages offloaded last
        self.moved: list[tuple[torch.UntypedStorage, Tensor]] = []  # (device storage, its CPU copy)
        self.dropped: list[tuple[torch.UntypedStorage, int]] = []  # (device storage, its bytes)
        self._buffers: list[Tensor] = []  # CPU copies, reused by position (pinning memory is slow)
        self._copied_in: torch.cuda.Event | None = None

    @property
    def offloaded(self) -> bool:
        return bool(self.moved or self.dropped)

    def nbytes(self) -> int:
        return sum(b.numel() for _, b in self.moved) + sum(n for _, n in self.dropped)

    @torch.no_grad()
    def offload(self, keep: Iterable[Tensor], drop: Iterable[Tensor] = ()) -> None:
        assert not self.offloaded, "offloaded twice without a reload"
        self.wait()  # a reload still copying in on the side stream finishes before its storage is freed
        seen: set[int] = set()
        for i, storage in enumerate(storages(keep, seen)):
            self.device = storage.device
            buffer = self._buffer(i, storage.nbytes())
            buffer.untyped_storage().copy_(storage, non_blocking=True)
            storage.resize_(0)
            self.moved.append((storage, buffer))
        for storage in storages(drop, seen):
            self.dropped.append((storage, storage.nbytes()))
            storage.resize_(0)

    @torch.no_grad()
    def reload(self, *, overlap: bool = False) -> None:
        """Re-allocates every storage (dropped ones zeroed) and copies the CPU copies back in; with
        `overlap` on CUDA the copies run on a side stream until `wait`."""
        for storage, nbytes in self.dropped:
            storage.resize_(nbytes)
            storage.fill_(0)
        for storage, buffer in self.moved:
            storage.resize_(buffer.numel())
        side = torch.cuda.Stream(self.device) if overlap and self.device.type == "cuda" and self.moved else None
        if side is not None:
            # read outside the `with` below, where the current stream is `side` itself (a wait on itself is
            # a no-op): the blocks just allocated may still be read by queued work of the current stream
            # (e.g. another storage's copy out), which the copies in must follow
            side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for storage, buffer in self.moved:
                storage.copy_(buffer.untyped_storage(), non_blocking=True)
            if side is not None:
                self._copied_in = torch.cuda.Event()
                self._copied_in.record(side)
        self.moved, self.dropped = [], []

    def wait(self) -> None:
        """The current stream waits for the copies back (a no-op without an overlapped reload)."""
        if self._copied_in is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied_in)
            self._copied_in = None

    def _buffer(self, index: int, nbytes: int) -> Tensor:
        if index < len(self._buffers) and self._buffers[index].numel() == nbytes:
            return self._buffers[index]
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        if index < len(self._buffers):
            self._buffers[index] = buffer
        else:
            self._buffers.append(buffer)
        return buffer


def storages(tensors: Iterable[Tensor | None], seen: set[int]) -> Iterator[torch.UntypedStorage]:
    """Each non-empty storage under `tensors` once (views share one); a DTensor's is its local shard's."""
    for tensor in tensors:
        if tensor is None:
            continue
        storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            yield storage


class TrainerOffload:
    """The trainer's side of the colocate memory plan (--offload_optimizer, --offload_model).

    The loop calls `to_device` before training, `optimizer_to_cpu` after it (before the engine wakes, so
    its KV cache can take the room) and `model_to_cpu` once the weights are published; the trainer calls
    `optimizer_ready` before its optimizer step. The reference model follows the policy's weights.
    """

    def __init__(self, config: OffloadConfig, trainer: Any) -> None:
        self.config = config
        self.trainer = trainer
        self.optimizer = StorageOffload()
        self.model = StorageOffload()

    def to_device(self) -> None:
        if self.model.offloaded:
            self.model.reload()
            self.trainer.plan.invalidate()  # the compute twin was dropped: refreshed from the weights on next use
        if self.optimizer.offloaded:
            self.optimizer.reload(overlap=True)

    def optimizer_ready(self) -> None:
        self.optimizer.wait()

    def optimizer_to_cpu(self) -> None:
        if self.config.offload_optimizer and not self.config.cpu_optimizer and not self.optimizer.offloaded:
            self.optimizer.offload(optimizer_tensors(self.trainer.optimizer))
            self._collect()

    def model_to_cpu(self) -> None:
        if self.config.offload_model and not self.model.offloaded:
            keep, drop = model_tensors(self.trainer)
            self.model.offload(keep, drop)
            self._collect()

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Everything on the device for the block (a checkpoint is written), offloaded again after."""
        self.to_device()
        self.optimizer_ready()
        try:
            yield
        finally:
            self.optimizer_to_cpu()
            self.model_to_cpu()

    def _collect(self) -> None:
        if self.config.gc_collect_after_offload:
            gc.collect()
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Every tensor of the optimizer's state (AdamW: exp_avg, exp_avg_sq, step)."""
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, Tensor)]


def model_tensors(trainer: Any) -> tuple[list[Tensor], list[Tensor]]:
    """(kept: the policy's weights and the reference model's; dropped: gradients and the compute twin,
    which the next step zeroes and refreshes from the weights anyway)."""
    keep = list(trainer.model.parameters())
    if trainer.reference is not None:
        keep += list(trainer.reference.parameters())
    drop = [p.grad for p in trainer.model.parameters()]
    compute = trainer.plan.compute
    if compute is not None:
        drop += [*compute.model.parameters(), *(p.grad for p in compute.model.parameters())]
    return keep, drop
