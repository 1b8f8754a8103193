"""--cpu_optimizer's AdamW (train/cpu_adam.py) equals torch.optim.AdamW step for step, in both forms: the math on
the CPU, and the math on the device with the moments streamed to it (here the device is the CPU: the same
per-chunk code, the copies plain copies)."""

from __future__ import annotations

import pytest
import torch

from tandemrl.train.cpu_adam import CpuAdamW, choose_compute

FORMS = ["cpu", "gpu"]


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (7,), (4, 4), (1,), (9, 2)]
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * (1 + step) for p in params]


def _step_both(ours, theirs, cpu, reference, step: int, *, compare: bool = True) -> None:
    """The same gradients to both, one step of each; with `compare`, the weights equal (1e-6) after it."""
    for a, b, grad in zip(ours, theirs, _grads(ours, step)):
        a.grad, b.grad = grad.clone(), grad.clone()
    cpu.step()
    reference.step()
    if compare:
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("compute", FORMS)
@pytest.mark.parametrize("chunk_numel", [1, 7, 1000])  # chunks that split parameters, and one for all
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_equals_adamw_over_several_steps(compute, chunk_numel, weight_decay):
    ours, theirs = _params(), _params()
    options = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    cpu = CpuAdamW(ours, chunk_numel=chunk_numel, compute=compute, **options)
    assert cpu.compute == compute
    reference = torch.optim.AdamW(theirs, **options)
    for step in range(6):
        _step_both(ours, theirs, cpu, reference, step)
    for a, b in zip(ours, theirs):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(cpu.state[a][key], reference.state[b][key], atol=1e-6, rtol=0)
        assert float(cpu.state[a]["step"]) == float(reference.state[b]["step"]) == 6


@pytest.mark.parametrize("compute", FORMS)
def test_a_parameter_without_a_gradient_is_skipped_as_adamw_skips_it(compute):
    """No gradient: no step count, no moment decay, no weight decay for that parameter (AdamW's rule), also
    where a chunk holds only such parameters or parts of them."""
    ours, theirs = _params(), _params()
    options = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    cpu, reference = CpuAdamW(ours, chunk_numel=6, compute=compute, **options), torch.optim.AdamW(theirs, **options)
    for step in range(6):
        for index, (a, b, grad) in enumerate(zip(ours, theirs, _grads(ours, step))):
            missing = index == 3 or index == step % len(ours)  # one never has a gradient, another in turn
            a.grad, b.grad = (None, None) if missing else (grad.clone(), grad.clone())
        cpu.step()
        reference.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert float(cpu.state[ours[3]]["step"]) == 0 and not cpu.state[ours[3]]["exp_avg"].any() and ours[3] not in reference.state
    assert [float(cpu.state[a]["step"]) for a in ours] == [float(reference.state[b]["step"]) if b in reference.state else 0.0 for b in theirs]
    for a in ours:
        a.grad = None
    before = [a.clone() for a in ours]
    cpu.step()  # no gradient at all: nothing moves
    assert all(torch.equal(a, b) for a, b in zip(ours, before))


@pytest.mark.parametrize("compute", FORMS)
def test_learning_rate_schedule_reaches_it(compute):
    ours, theirs = _params(), _params()
    cpu, reference = CpuAdamW(ours, lr=1e-2, compute=compute), torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.0)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1)) for o in (cpu, reference)]
    for step in range(3):
        _step_both(ours, theirs, cpu, reference, step, compare=False)
        for s in schedules:
            s.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("compute", FORMS)
def test_resumes_from_an_adamw_state_dict(compute):
    """A checkpoint's optimizer state (AdamW's layout) loads into the CPU moments and training goes on equal."""
    ours, theirs = _params(), _params()
    reference = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    for step in range(2):
        for b, grad in zip(theirs, _grads(theirs, step)):
            b.grad = grad
        reference.step()
    with torch.no_grad():
        for a, b in zip(ours, theirs):
            a.copy_(b)
    cpu = CpuAdamW(ours, lr=1.0, chunk_numel=7, compute=compute)
    cpu.load_state_dict(reference.state_dict())  # the learning rate and weight decay come with it
    again = CpuAdamW(_params(), lr=1e-2, compute=compute)
    again.load_state_dict(cpu.state_dict())  # its own state_dict round-trips too
    assert torch.equal(again.state[again.params[0]]["exp_avg"], cpu.state[ours[0]]["exp_avg"])
    for step in range(2, 5):
        _step_both(ours, theirs, cpu, reference, step)


def test_state_dict_round_trips_between_the_forms_and_adamw():
    """AdamW -> gpu form -> cpu form -> AdamW, each taking the last one's weights and state_dict and making one
    step: every step lands on the weights of one AdamW that made them all (a checkpoint moves between the forms,
    and back to plain training)."""
    options = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    theirs = _params()
    reference = torch.optim.AdamW(theirs, **options)
    relay = [lambda p: torch.optim.AdamW(p, **options), lambda p: CpuAdamW(p, compute="gpu", chunk_numel=5, **options),
             lambda p: CpuAdamW(p, compute="cpu", chunk_numel=9, **options), lambda p: torch.optim.AdamW(p, **options)]  # fmt: skip
    weights, state = _params(), None
    for index, make in enumerate(relay):
        ours = [w.detach().clone().requires_grad_() for w in weights]
        optimizer = make(ours)
        if state is not None:
            optimizer.load_state_dict(state)
        for a, b, grad in zip(ours, theirs, _grads(ours, index)):
            a.grad, b.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        weights, state = ours, optimizer.state_dict()
    assert [float(s["step"]) for s in state["state"].values()] == [4.0] * len(theirs)


def test_auto_is_the_gpu_form_for_float32_weights_on_a_gpu():
    """On the CPU auto is the cpu form (the two are one math there); gpu is refused for 16-bit weights."""
    assert choose_compute("auto", _params()) == "cpu" and choose_compute("gpu", _params()) == "gpu"
    half = [torch.zeros(3, dtype=torch.bfloat16)]
    assert choose_compute("auto", half) == "cpu"
    with pytest.raises(ValueError, match="--cpu_optimizer_compute gpu needs float32 weights"):
        choose_compute("gpu", half)
    if torch.cuda.is_available():
        assert choose_compute("auto", [torch.zeros(3, device="cuda")]) == "gpu"


@pytest.mark.parametrize("compute", ["auto", "gpu"])
def test_a_trainer_with_the_optimizer_on_the_cpu_trains_as_adamw(compute):
    """--cpu_optimizer through the trainer, in either form: three GRPO steps of the tiny policy equal plain AdamW's (1e-6)."""
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

    plain, cpu = train(OffloadConfig()), train(OffloadConfig(cpu_optimizer=True, offload_optimizer=True, cpu_optimizer_compute=compute))
    assert isinstance(cpu.optimizer, CpuAdamW) and cpu.optimizer.compute == ("gpu" if compute == "gpu" else "cpu")
    for a, b in zip(plain.model.parameters(), cpu.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
