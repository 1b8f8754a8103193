"""What sleep level 2 frees besides the KV cache: the engine's weights, with no copy kept anywhere.

Each weight's storage is resized to 0 bytes and, on wake, back to its size (zeroed), so every tensor
object and view survives; the bytes come back through the next weight updates, by Hugging Face name,
from the trainer. Invariant: the engine runs no step while a weight is `missing` (never one on zeros).
"""

from __future__ import annotations

import torch
from torch import nn

from tandemrl.generation.engine.models.loading import hf_names


class DroppableWeights:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.missing: set[str] = set()  # HF names dropped and not yet written again
        self._dropped: list[tuple[torch.UntypedStorage, int]] = []

    @torch.no_grad()
    def drop(self) -> None:
        seen: set[int] = set()
        for param in self.model.parameters():  # tied weights share one storage: freed once
            storage = param.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                self._dropped.append((storage, storage.nbytes()))
                storage.resize_(0)
        self.missing = hf_names(self.model)

    @torch.no_grad()
    def reallocate(self) -> None:
        """Room for the weights again (zeros, until the updates arrive); CUDA graphs captured after see it."""
        for storage, nbytes in self._dropped:
            storage.resize_(nbytes)
            storage.fill_(0)
        self._dropped = []

    def written(self, names: set[str]) -> None:
        self.missing -= names
