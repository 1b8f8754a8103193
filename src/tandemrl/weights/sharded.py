"""Server placement under torchrun: the policy is FSDP-sharded over the trainer's ranks and rank 0 alone
pushes it to the rollout servers (DistributedSync, the one-process push). Every rank gathers the same
batches of tensors in the same order (--move_model_batches of them; each gather is a collective), and
rank 0 streams each gathered batch to the servers as it comes, so a sync's extra memory is about one
batch, never the whole model. Shards are gathered in `gather_dtype` when given (the trainer's 16-bit
compute dtype: half the bytes of the float32 masters, on the gather and on the wire).

Invariant: whatever the push's outcome, every rank gathers every batch and then takes the outcome from
rank 0, so the ranks go on together or raise the same error together; none is left in a collective. A
failed push may leave its sending thread behind, still pulling tensors: pulls are serialised, so each
gathers the next tensor in order, whichever thread makes it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from tandemrl.train.distributed import DataParallel, full_tensor
from tandemrl.weights.base import WeightSync, batched

if TYPE_CHECKING:
    from torch import Tensor


class ShardedSync:
    """WeightSync of every rank; `pusher` (rank 0's DistributedSync) is None on the other ranks."""

    def __init__(
        self, pusher: WeightSync | None, dp: DataParallel, *, move_model_batches: int, gather_dtype: torch.dtype | None = None
    ) -> None:
        self.pusher = pusher
        self.dp = dp
        self.move_model_batches = move_model_batches
        self.gather_dtype = gather_dtype

    async def publish(self, weights: Iterable[tuple[str, Tensor]], *, version: int) -> None:
        """`version` is live on every server on return (on every rank), or every rank raises one RuntimeError."""
        named = [(name, tensor.detach()) for name, tensor in weights]
        whole = Serialised(gathered(named, self.move_model_batches, self.gather_dtype))
        error = ""
        if self.pusher is not None:
            try:
                await self.pusher.publish(whole, version=version)
            except RuntimeError as failure:  # DistributedSync's one error for any failure of the push
                error = str(failure)
        await asyncio.to_thread(drain, whole)  # the batches a failed push never reached: their gathers are collectives
        error = await asyncio.to_thread(self.dp.broadcast, error)
        if error:
            raise RuntimeError(error)

    async def close(self) -> None:
        if self.pusher is not None:
            await self.pusher.close()


def gathered(named: list[tuple[str, Tensor]], num_batches: int, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """The whole tensors of FSDP shards, gathered a batch at a time as the consumer reaches it; a tensor
    is let go once handed over, so about one batch is held. Every rank must consume it to the end."""
    for batch in batched(named, num_batches, len(named)):
        if batch[0][1].is_cuda:  # the consumer may be another thread (the sender's): gather on this rank's GPU
            torch.cuda.set_device(batch[0][1].device)
        whole = [(name, full_tensor(tensor, dtype)) for name, tensor in batch]
        while whole:
            yield whole.pop(0)


class Serialised(Iterator):
    """An iterator that two threads may pull from: one pull at a time, in order."""

    def __init__(self, items: Iterator) -> None:
        self._items = items
        self._lock = threading.Lock()

    def __next__(self):
        with self._lock:
            return next(self._items)


def drain(stream: Iterator) -> None:
    for _ in stream:
        pass
