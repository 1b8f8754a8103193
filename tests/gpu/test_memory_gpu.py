"""The memory plan's GPU side: --cpu_optimizer's streamed step, in both forms (the math on the CPU; the moments
streamed to the GPU's fused kernel), equals fused AdamW on the GPU and resumes from either's state (LoRA's 16-bit
base runs in tests/gpu/test_levers_gpu.py's LoRA runs, which now take that path)."""

from __future__ import annotations

import pytest
import torch

from tandemrl.train.cpu_adam import CpuAdamW

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _step_both(ours: list[torch.Tensor], theirs: list[torch.Tensor], optimizers: tuple, steps: int) -> None:
    for step in range(steps):
        for index, (a, b) in enumerate(zip(ours, theirs)):
            if index == len(ours) - 1 and step % 2:  # a parameter without a gradient every other step: skipped
                a.grad = b.grad = None
                continue
            grad = torch.randn_like(a)
            a.grad, b.grad = grad.clone(), grad.clone()
        for optimizer in optimizers:
            optimizer.step()


@pytest.mark.parametrize("compute", ["cpu", "gpu"])
def test_streamed_step_equals_adamw_on_the_gpu(compute):
    torch.manual_seed(0)
    shapes = [(3000, 1000), (5000,), (64, 64), (1,), (777,)]
    ours = [torch.randn(s, device="cuda").requires_grad_() for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    options = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01)
    cpu = CpuAdamW(ours, chunk_numel=1 << 18, compute=compute, **options)  # chunks split parameters: the pipeline runs many
    reference = torch.optim.AdamW(theirs, fused=True, **options)
    assert cpu.compute == compute and all(s["exp_avg"].device.type == "cpu" for s in cpu.state.values())
    if compute == "gpu":  # the copies are asynchronous only from page-locked memory; the kernel reads the step on the GPU
        assert cpu.state[ours[0]]["exp_avg"].is_pinned() and cpu.state[ours[0]]["step"].is_cuda
    _step_both(ours, theirs, (cpu, reference), 5)
    # The cpu form: the fused CUDA kernel rounds its float32 arithmetic differently from the CPU's ops (the H200 gave
    # 1.43e-6 at parameters ~2.4, 5 ulp): a few ulp relative; a wrong step (weight decay or a bias correction missed)
    # is off by >= 1e-5 after these 5 steps of lr 1e-3. The gpu form runs the reference's kernel on the same values.
    for a, b in zip(ours, theirs):
        if compute == "gpu":
            assert torch.equal(a, b)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=2e-6)
    # fused AdamW's state (its steps and moments on the GPU) loads into the other form, and training goes on equal
    other = [p.detach().clone().requires_grad_() for p in ours]
    moved = CpuAdamW(other, chunk_numel=1 << 20, compute="cpu" if compute == "gpu" else "gpu", **options)
    moved.load_state_dict(reference.state_dict())
    _step_both(other, theirs, (moved, reference), 3)
    for a, b in zip(other, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=2e-6)
