"""--cpu_optimizer's AdamW (train/cpu_adam.py) equals torch.optim.AdamW step for step."""

from __future__ import annotations

import pytest
import torch

from tandemrl.train.cpu_adam import CpuAdamW


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (7,), (4, 4), (1,), (9, 2)]
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * (1 + step) for p in params]


@pytest.mark.parametrize("chunk_numel", [1, 7, 1000])  # chunks that split parameters, and one for all
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_equals_adamw_over_several_steps(chunk_numel, weight_decay):
    ours, theirs = _params(), _params()
    options = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    cpu = CpuAdamW(ours, chunk_numel=chunk_numel, **options)
    reference = torch.optim.AdamW(theirs, **options)
    for step in range(6):
        for a, b, grad in zip(ours, theirs, _grads(ours, step)):
            a.grad, b.grad = grad.clone(), grad.clone()
        cpu.step()
        reference.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(cpu.state[a]["exp_avg_sq"], reference.state[b]["exp_avg_sq"], atol=1e-6, rtol=0)


def test_learning_rate_schedule_reaches_it():
    ours, theirs = _params(), _params()
    cpu, reference = CpuAdamW(ours, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.0)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1)) for o in (cpu, reference)]
    for step in range(3):
        for a, b, grad in zip(ours, theirs, _grads(ours, step)):
            a.grad, b.grad = grad.clone(), grad.clone()
        cpu.step()
        reference.step()
        for s in schedules:
            s.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_resumes_from_an_adamw_state_dict():
    """A checkpoint's optimizer state (AdamW's layout) loads into the CPU moments and training goes on equal."""
    ours, theirs = _params(), _params()
    reference = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.0)
    for step in range(2):
        for b, grad in zip(theirs, _grads(theirs, step)):
            b.grad = grad
        reference.step()
    with torch.no_grad():
        for a, b in zip(ours, theirs):
            a.copy_(b)
    cpu = CpuAdamW(ours, lr=1e-2, chunk_numel=7)
    cpu.load_state_dict(reference.state_dict())
    again = CpuAdamW(_params(), lr=1e-2)
    again.load_state_dict(cpu.state_dict())  # its own state_dict round-trips too
    assert torch.equal(again.state[again.params[0]]["exp_avg"], cpu.state[ours[0]]["exp_avg"])
    for a, b, grad in zip(ours, theirs, _grads(ours, 2)):
        a.grad, b.grad = grad.clone(), grad.clone()
    cpu.step()
    reference.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_a_trainer_with_the_optimizer_on_the_cpu_trains_as_adamw():
    """--cpu_optimizer through the trainer: three GRPO steps of the tiny policy equal plain AdamW's (1e-6)."""
    from tandemrl.algo.presets import AlgoConfig
    from tandemrl.tasks.tiny import build_model, build_tokenizer
    from tandemrl.train.config import OffloadConfig, TrainerConfig
    from tandemrl.train.trainer import Trainer
    from tests.unit.train.test_trainer import make_batch

    def train(offload: OffloadConfig) -> Trainer:
        config = TrainerConfig(learning_rate=1e-3, weight_decay=0.01)
        trainer = Trainer(config, AlgoConfig(), build_model(build_tokenizer(), seed=1), max_steps=3, offload=offload)
        for step in range(3):
            trainer.offload.to_device()
            trainer.train_step(make_batch(seed=step))
            trainer.offload.optimizer_to_cpu()
        return trainer

    plain, cpu = train(OffloadConfig()), train(OffloadConfig(cpu_optimizer=True, offload_optimizer=True))
    assert isinstance(cpu.optimizer, CpuAdamW)
    for a, b in zip(plain.model.parameters(), cpu.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
