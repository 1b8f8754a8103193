"""The colocate memory levers on a GPU (marker gpu): what they return, and training left bit-identical.

Offload through the bf16-twin path (compute twin and gradients dropped, masters and optimizer state
copied through pinned memory, the optimizer's copy back overlapped on a side stream); the engine's
sleep levels with CUDA graphs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tandemrl.algo.presets import AlgoConfig
from tandemrl.generation.base import EngineConfig
from tandemrl.generation.engine import Engine
from tandemrl.train.config import OffloadConfig, TrainerConfig
from tandemrl.train.offload import optimizer_tensors
from tandemrl.train.trainer import Trainer
from tandemrl.types import SamplingParams
from tests.gpu.test_train_fast_gpu import _batch, _model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _train(offload: OffloadConfig | None, steps: int = 3) -> tuple[Trainer, list[float]]:
    config = TrainerConfig(learning_rate=1e-4, torch_compile=False, max_tokens_per_microbatch=4096)
    trainer = Trainer(config, AlgoConfig(beta=0.04), _model(), max_steps=steps, offload=offload)
    returned = []
    for step in range(steps):
        trainer.offload.to_device()
        trainer.train_step(_batch(seed=step))
        size, before = sum(t.nbytes for t in optimizer_tensors(trainer.optimizer)), torch.cuda.memory_allocated()
        trainer.offload.optimizer_to_cpu()
        returned.append((before - torch.cuda.memory_allocated()) / size)
        trainer.offload.model_to_cpu()
    trainer.offload.to_device()
    trainer.offload.optimizer_ready()
    torch.cuda.synchronize()
    return trainer, returned


def _largest_difference(a: Trainer, b: Trainer) -> float:
    tensors = lambda t: [*t.model.parameters(), *optimizer_tensors(t.optimizer)]  # noqa: E731
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(tensors(a), tensors(b)))


def test_offload_returns_the_optimizer_memory_and_trains_bit_identically():
    """Bit-identical where two plain runs are (then any offload error shows); where the GPU's kernels are
    not deterministic run to run, the offloaded run stays within the plain runs' own spread."""
    plain, _ = _train(None)
    again, _ = _train(None)
    offloaded, returned = _train(OffloadConfig(offload_optimizer=True, offload_model=True))
    assert min(returned) >= 0.9, returned
    spread, difference = _largest_difference(plain, again), _largest_difference(plain, offloaded)
    assert difference <= 4 * spread, (difference, spread)  # spread 0: bit-identical


def test_sleep_returns_the_kv_cache_and_level_2_the_weights(tmp_path):
    from tandemrl.generation.engine.models import weights_of
    from tandemrl.tasks.tiny import save_tiny

    model_dir = save_tiny(str(tmp_path), seed=2, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    engine = Engine(EngineConfig(model=model_dir, device="cuda", gpu_memory_utilization=0.2, max_num_seqs=64, max_model_len=1024))
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    async def scenario():
        before = await engine.generate([5, 6, 7, 8], greedy)
        for level in (1, 2):
            kv = engine.runner.kv_cache.nbytes + (sum(p.nbytes for p in engine.model.parameters()) if level == 2 else 0)
            allocated = torch.cuda.memory_allocated()
            await engine.sleep(level)
            assert (allocated - torch.cuda.memory_allocated()) / kv >= 0.9
            await engine.wake()
            if level == 2:
                await engine.update_weights(weights_of(model_dir), version=0)
            assert (await engine.generate([5, 6, 7, 8], greedy)).token_ids == before.token_ids
        await engine.close()

    asyncio.run(scenario())


def test_lora_on_the_bf16_path_trains_only_adapters_and_publishes_the_merged_policy():
    import copy

    from tandemrl.train.config import LoraConfig
    from tandemrl.train.lora import apply_lora

    base = _model()
    plain = copy.deepcopy(base)
    config = TrainerConfig(learning_rate=1e-3, torch_compile=False, max_tokens_per_microbatch=4096)
    trainer = Trainer(config, AlgoConfig(beta=0.04), apply_lora(base, LoraConfig(lora_r=8)), max_steps=2)
    assert trainer.plan.compute is not None and trainer.reference is None
    first = trainer.train_step(_batch(seed=0))
    trainer.train_step(_batch(seed=1))
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)
    num_adapter = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert trainer.plan.compute._master_grads.numel() == num_adapter  # gradients for the adapters only
    merged = copy.deepcopy(plain)
    merged.load_state_dict(dict(trainer.published_weights()), strict=False)
    x = torch.randint(1000, 100000, (1, 64), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, trainer.model(x).logits, rtol=1e-3, atol=1e-3)
        assert not torch.equal(merged(x).logits, plain(x).logits)
