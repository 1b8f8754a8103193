"""Colocate weight sync: the generator shares the trainer's process; tensors are handed over in memory,
in `move_model_batches` batches, all in one update: the new version goes live after the last batch, and
no step runs between two batches.

Under torchrun the trainer's weights are FSDP shards: each batch is gathered whole (every rank gathers
the same batches in the same order) just before it is handed over, so a sync's extra memory is about
one batch, never the whole model; in `gather_dtype` when given (the trainer's 16-bit compute dtype).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from tandemrl.train.distributed import full_tensor
from tandemrl.weights.base import LocalSyncConfig
from tandemrl.weights.sharded import gathered

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from tandemrl.generation.base import LocalGenerator


class LocalSync:
    takes_changed_only = True  # the generator keeps what an update leaves out (a server's staging may not)

    def __init__(self, config: LocalSyncConfig, generator: LocalGenerator, *, gather_dtype: torch.dtype | None = None) -> None:
        self.config = config
        self.generator = generator
        self.gather_dtype = gather_dtype

    async def publish(self, weights: Iterable[tuple[str, Tensor]], *, version: int) -> None:
        if self.config.move_model_batches == 1 and self.gather_dtype is None:
            # one batch of whole tensors: handed over as they come, so tensors made for the sync (LoRA's merged
            # weights) never all exist at once (a 7B base: 14 GiB); the version flips at the end all the same
            await self.generator.update_weights(((name, full_tensor(tensor.detach())) for name, tensor in weights), version=version)
            return
        named = [(name, tensor.detach()) for name, tensor in weights]
        # one update, its batches gathered as the generator reaches them: an update is applied between two engine
        # steps, so no step runs on half-updated weights (a call a batch let steps run between the batches)
        await self.generator.update_weights(gathered(named, self.config.move_model_batches, self.gather_dtype), version=version)

    async def close(self) -> None:
        pass
