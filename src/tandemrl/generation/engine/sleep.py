"""What the engine holds on its device, and when: sleep (level 1 the KV cache, level 2 the weights too,
with no copy kept anywhere), wake, and the weight updates that write the weights (and refill them).

Each weight's storage is resized to 0 bytes and, on wake, back to its size (zeroed), so every tensor
object and view survives; the bytes come back through the next weight updates, by Hugging Face name,
from the trainer. Invariant: the engine runs no step while a weight is `missing` (never one on zeros).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tandemrl.generation.engine.models.loading import hf_names


class DroppableWeights:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.missing: set[str] = set()  # HF names dropped and not yet written again
        self._dropped: list[tuple[torch.UntypedStorage, int]] = []
        self.kept: set[int] = set()  # storages (data_ptr) a colocated LoRA trainer keeps its frozen base in: never dropped

    @torch.no_grad()
    def drop(self) -> None:
        seen: set[int] = set()
        dropped: set[str] = set()
        for name, param in self.model.named_parameters():  # tied weights share one storage: freed once
            storage = param.untyped_storage()
            if storage.data_ptr() in self.kept:
                continue
            dropped.add(name)
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                self._dropped.append((storage, storage.nbytes()))
                storage.resize_(0)
        self.missing = hf_names(self.model, only=dropped)

    @torch.no_grad()
    def reallocate(self) -> None:
        """Room for the weights again (zeros, until the updates arrive); CUDA graphs captured after see it."""
        for storage, nbytes in self._dropped:
            storage.resize_(nbytes)
            storage.fill_(0)
        self._dropped = []

    def written(self, names: set[str]) -> None:
        self.missing -= names

    @torch.no_grad()
    def share(self, named: list[tuple[str, torch.Tensor]]) -> set[str]:
        """Each (Hugging Face name, trainer tensor) made a view of the model's weight that holds it (`tensor.data`
        rebound: one copy of the base in the process; the trainer's own storage is freed), its storage never
        dropped. The model was built from these tensors, so the values are already equal: nothing is copied.
        Returns the names not shared (shape, dtype or device differ): the model keeps its own copy of those."""
        views = self.model.base_views(name for name, _ in named)
        unshared: set[str] = set()
        for name, tensor in named:
            view = views.get(name)
            if view is None or (view.shape, view.dtype, view.device) != (tensor.shape, tensor.dtype, tensor.device):
                unshared.add(name)
                continue
            tensor.data = view
            self.kept.add(view.untyped_storage().data_ptr())
        return unshared


class Residency:
    """The engine's part for sleep, wake and weight loading; the engine calls it between steps, under its
    step lock. Level 1 frees the KV cache (and the CUDA graphs that address it); level 2 also the weights,
    which the next weight updates refill; a wake allocates both again (zeros until the updates arrive)."""

    def __init__(self, model: nn.Module, runner: Any, blocks: Any, scheduler: Any, device: torch.device) -> None:
        self.model, self.runner, self.blocks, self.scheduler, self.device = model, runner, blocks, scheduler, device
        self.weights = DroppableWeights(model)
        self.asleep = False

    @property
    def ready(self) -> bool:
        """Whether a step may run: awake, and every weight written (never a step on zeros)."""
        return not self.asleep and not self.weights.missing

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full Hugging Face-named tensors into the model (each rank keeps its shard); the prefix cache is
        reset, since its blocks hold another version's keys and values."""
        # a list goes as is (the model reuses its plan for one laid out as the last); draining it is a no-op
        weights = weights if isinstance(weights, list) else iter(weights)
        try:
            self.weights.written(self.model.load_weights(weights))
        finally:  # read to its end even after an error: a broadcast keeps every rank at the same message
            for _ in weights:
                pass
        self.blocks.reset_prefix_cache()

    def sleep(self, level: int) -> None:
        if self.asleep:
            return
        self.scheduler.preempt_all()
        self.blocks.reset_prefix_cache()
        self.runner.free_kv_cache()
        if level >= 2:
            self.weights.drop()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True

    def wake(self) -> None:
        if not self.asleep:
            return
        self.weights.reallocate()  # before the graphs are captured: they hold the weights' addresses
        self.runner.allocate_kv_cache(len(self.blocks.blocks))
        self.asleep = False
