"""Mixed precision without per-micro-batch casts: 16-bit compute weights over float32 master weights.

The optimizer owns float32 master weights (16-bit AdamW loses updates below bf16's resolution). Forward
and backward run on a 16-bit copy of the model, refreshed from the masters once per optimizer step (one
fused copy), so no weight is re-cast in every micro-batch as autocast does. The masters' gradients are
views of one flat float32 buffer. The compute weights start each backward without gradients, so autograd
hands over the gradients it made rather than adding them into zeroed buffers; after each micro-batch's
backward one multi-tensor add moves them into the float32 sums and they are dropped.
Invariant: between `refresh()` and the optimizer step, the compute weights equal the masters rounded to
16 bits; after `accumulate()`, master.grad holds the float32 sum of every micro-batch's gradient and the
compute weights hold none.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class ComputeWeights:
    """A 16-bit twin of `master` whose gradients are summed, in float32, into the master's `.grad`."""

    def __init__(self, master: nn.Module, dtype: torch.dtype) -> None:
        self.model = copy.deepcopy(master).to(dtype)
        self._master = list(master.parameters())
        self._compute = list(self.model.parameters())
        assert len(self._master) == len(self._compute), "the twin shares the master's parameter layout"
        # gradients for the trained parameters only (with LoRA: the adapters, not the frozen base)
        self._trained = [(m, c) for m, c in zip(self._master, self._compute) if m.requires_grad]
        numel = sum(m.numel() for m, _ in self._trained)
        self._master_grads = torch.zeros(numel, dtype=self._master[0].dtype, device=self._master[0].device)  # [P]
        self._fresh_for: object = None

    @torch.no_grad()
    def refresh(self, version: object) -> None:
        """Copies the masters into the compute weights, once per `version` (the optimizer step count)."""
        if self._fresh_for == version:
            return
        torch._foreach_copy_(self._compute, self._master)
        self._fresh_for = version

    def refresh_on_next_use(self) -> None:
        """The masters changed outside an optimizer step (a checkpoint was loaded)."""
        self._fresh_for = None

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Start of an optimizer step: every master gradient is a zeroed view of the flat buffer."""
        self._master_grads.zero_()
        offset = 0
        for master, compute in self._trained:
            master.grad = self._master_grads[offset : offset + master.numel()].view_as(master)
            compute.grad = None
            offset += master.numel()

    @torch.no_grad()
    def accumulate(self) -> None:
        """After a micro-batch's backward: its 16-bit gradients join the float32 sums, then are dropped.

        One multi-tensor add for all parameters (a parameter the micro-batch did not reach has no gradient).
        """
        reached = [(m.grad, c.grad) for m, c in self._trained if c.grad is not None]
        if reached:
            sums, grads = zip(*reached)
            torch._foreach_add_(list(sums), list(grads))
        for _, compute in self._trained:
            compute.grad = None
