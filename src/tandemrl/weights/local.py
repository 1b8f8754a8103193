"""Colocate weight sync: the generator shares the trainer's process; tensors are handed over in memory,
in `move_model_batches` batches, and the new version goes live after the last batch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from tandemrl.weights.base import LocalSyncConfig, batched

if TYPE_CHECKING:
    from torch import Tensor

    from tandemrl.generation.base import LocalGenerator


class LocalSync:
    def __init__(self, config: LocalSyncConfig, generator: LocalGenerator) -> None:
        self.config = config
        self.generator = generator

    async def publish(self, weights: Iterable[tuple[str, Tensor]], *, version: int) -> None:
        named = [(name, tensor.detach()) for name, tensor in weights]
        batches = list(batched(named, self.config.move_model_batches, len(named)))
        # every batch but the last keeps the old version: the generator flips only at the end
        for batch in batches[:-1]:
            await self.generator.update_weights(batch, version=self.generator.version)
        await self.generator.update_weights(batches[-1] if batches else [], version=version)

    async def close(self) -> None:
        pass
