"""Offload round trips: every tensor object and view survives, and training is bit-identical to a run
without offload (the memory really leaves: each offloaded storage holds 0 bytes until reloaded)."""

from __future__ import annotations

import torch

from tandemrl.algo.presets import AlgoConfig
from tandemrl.tasks.tiny import build_model, build_tokenizer
from tandemrl.train.config import OffloadConfig, TrainerConfig
from tandemrl.train.offload import StorageOffload, model_tensors, optimizer_tensors
from tandemrl.train.trainer import Trainer
from tests.unit.train.test_trainer import make_batch


def test_storage_round_trip_keeps_tensors_views_and_bytes():
    kept, dropped = torch.randn(4, 3), torch.randn(5)
    view, expected = kept[1], kept.clone()
    offload = StorageOffload()
    offload.offload([kept, view], drop=[dropped])
    assert kept.untyped_storage().nbytes() == 0 and dropped.untyped_storage().nbytes() == 0
    assert offload.nbytes() == kept.nbytes + dropped.nbytes  # the view's storage counted once
    offload.reload(overlap=True)
    offload.wait()
    assert torch.equal(kept, expected) and torch.equal(view, expected[1]) and torch.equal(dropped, torch.zeros(5))


def train(offload: OffloadConfig | None, steps: int = 3) -> Trainer:
    trainer = Trainer(
        TrainerConfig(learning_rate=1e-2), AlgoConfig(beta=0.1), build_model(build_tokenizer(), seed=1), max_steps=steps, offload=offload
    )
    for step in range(steps):
        trainer.offload.to_device()
        trainer.train_step(make_batch(seed=step))
        trainer.offload.optimizer_to_cpu()
        trainer.offload.model_to_cpu()
        if offload is not None:
            keep, drop = model_tensors(trainer)
            out = [*optimizer_tensors(trainer.optimizer), *keep, *(t for t in drop if t is not None)]
            assert all(t.untyped_storage().nbytes() == 0 for t in out)  # the reference model went too
    trainer.offload.to_device()
    trainer.offload.optimizer_ready()
    return trainer


def test_training_with_offload_round_trips_is_bit_identical():
    plain, offloaded = train(None), train(OffloadConfig(offload_optimizer=True, offload_model=True, gc_collect_after_offload=True))
    for a, b in zip(plain.model.parameters(), offloaded.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(optimizer_tensors(plain.optimizer), optimizer_tensors(offloaded.optimizer)):
        assert torch.equal(a, b)


def test_a_sharded_tensor_offloads_its_local_shard(tmp_path):
    """Under FSDP2 parameters and optimizer state are DTensors: the shard each rank holds leaves and comes back."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        full = torch.randn(6, 4)
        sharded = distribute_tensor(full, init_device_mesh("cpu", (1,)), [Shard(0)])
        offload = StorageOffload()
        offload.offload([sharded])
        assert sharded._local_tensor.untyped_storage().nbytes() == 0 and offload.nbytes() == full.nbytes
        offload.reload()
        assert torch.equal(sharded.full_tensor(), full)
    finally:
        dist.destroy_process_group()
