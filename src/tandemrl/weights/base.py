"""Weight sync: how the trainer's new weights reach the generators, with a version on every update.

Tensors travel by Hugging Face parameter name. A publish is all-or-nothing on the receiving side:
the generator switches to `version` only once every tensor arrived, so nothing is generated from
half-updated weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from torch import Tensor


class WeightSync(Protocol):
    """Pushes named tensors to the generators and makes `version` live there."""

    async def publish(self, weights: Iterable[tuple[str, Tensor]], *, version: int) -> None: ...

    async def close(self) -> None: ...


@dataclass(kw_only=True)
class LocalSyncConfig:
    """Colocate: the generator lives in the trainer's process; an in-memory copy by name."""

    move_model_batches: int = 1
    """Split the weights into this many batches when syncing (bounds the extra memory of a gather)."""


@dataclass(kw_only=True)
class DistributedSyncConfig:
    """Server: weights pushed over a torch.distributed group (NCCL on GPUs, gloo on CPU) or CUDA IPC."""

    weight_sync_port: int = 51216
    """Port where the trainer and the rollout servers rendezvous for weight sync."""
    weight_sync_bucket_mb: float = 256
    """Size of the flattened buckets tensors travel in."""
    weight_sync_timeout_s: float = 120.0
    """Deadline of every collective: a dead peer becomes an error within it."""
    update_mode: Literal["drain", "pause"] = "drain"
    """drain (finish in-flight requests, then update) or pause (freeze them between decode steps)."""
    weight_sync_backend: Literal["auto", "gloo", "nccl", "ipc"] = "auto"
    """auto (gloo for CPU weights, CUDA IPC when every server shares the trainer's GPU, else nccl), gloo, nccl or ipc."""
    weight_sync_host: str = ""
    """Trainer address the servers connect to (default: the local address that routes to the first server)."""
    weight_sync_ipc_reuse: bool = True
    """CUDA IPC: an update laid out as the last one is written into the servers' buffers mapped then and
    announced on a socket per server (no HTTP request, collective, metadata or handles); off, every update
    goes through the group in full, announced over HTTP."""


WeightSyncConfig = LocalSyncConfig | DistributedSyncConfig


def batched(weights: Iterable[tuple[str, Any]], num_batches: int, total: int) -> Iterator[list[tuple[str, Any]]]:
    """Splits named tensors into `num_batches` lists of about equal count.

    Example: batched([("a", 1), ("b", 2), ("c", 3)], 2, 3) -> [("a", 1), ("b", 2)], [("c", 3)]
    """
    size = max(1, -(-total // max(1, num_batches)))
    batch: list[tuple[str, Any]] = []
    for item in weights:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
