"""The runner's host-to-device packing: a prefill's inputs cross in one copy per dtype group."""

from __future__ import annotations

import torch

from tandemrl.generation.engine.runner import to_device_packed


def test_packed_copy_keeps_every_value_dtype_and_shape():
    tensors = [
        torch.tensor([1, 2], dtype=torch.int32),
        torch.tensor([0.5, -1.5]),
        torch.tensor([[3], [4]]),
        torch.zeros(0, dtype=torch.int64),  # a step without some input still packs
        torch.tensor([[True, False]]),  # neither group: copied on its own
        torch.tensor([2**40 + 7]),  # int64 values past 32 bits survive the int64 wire
    ]
    moved = to_device_packed(tensors, torch.device("cpu"), pin_memory=False)
    for before, after in zip(tensors, moved):
        assert after.dtype == before.dtype and after.shape == before.shape
        assert torch.equal(after, before)
