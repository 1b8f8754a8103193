"""The one place a weight-sync backend is chosen: a config of weights/base.py and the Generator it feeds in,
a WeightSync out, each backend imported only when chosen (so no backend imports this module)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandemrl.weights.base import DistributedSyncConfig, LocalSyncConfig, WeightSync, WeightSyncConfig

if TYPE_CHECKING:
    import torch

    from tandemrl.generation.base import Generator


def build_weight_sync(config: WeightSyncConfig, generator: Generator, *, gather_dtype: torch.dtype | None = None) -> WeightSync:
    """The one place a weight-sync backend is chosen. `gather_dtype`: FSDP shards are gathered in it."""
    match config:
        case LocalSyncConfig():
            from tandemrl.weights.local import LocalSync

            return LocalSync(config, generator, gather_dtype=gather_dtype)
        case DistributedSyncConfig():
            from tandemrl.weights.distributed import DistributedSync

            return DistributedSync(config, generator.client)  # a RemoteGenerator's
    raise ValueError(f"unknown weight sync config {config!r}")
