"""AdamW whose state lives in CPU memory and whose step runs on the CPU (--cpu_optimizer; ZeRO-Offload's
split): the GPU keeps the float32 masters and gradients, and never the moments (8 bytes a parameter).

The step streams the parameters in fixed-size chunks of their flat concatenation: a chunk's gradients
go to pinned memory (copy stream), the CPU runs the fused AdamW kernel on it into an update buffer,
and the update comes back (copy stream) and is applied on the GPU; the copies of chunk i+1 and i-1
overlap the CPU's work on chunk i. Invariant: the weights after each step equal torch.optim.AdamW's on
the same gradients (within float32 rounding of the update: tests/unit/train/test_cpu_adam.py); the
state_dict is AdamW's (per-parameter exp_avg, exp_avg_sq, step), with CPU tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

CHUNK_NUMEL = 1 << 26  # 64M float32 values (256 MB) a chunk: large copies, small staging


class CpuAdamW(torch.optim.Optimizer):
    def __init__(
        self, params: list[Tensor], *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
        weight_decay: float = 0.0, chunk_numel: int = CHUNK_NUMEL,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.params = [p for g in self.param_groups for p in g["params"]]
        assert len(self.param_groups) == 1, "one parameter group (the trainer's)"
        self.numel = sum(p.numel() for p in self.params)
        self.chunk_numel = min(chunk_numel, max(1, self.numel))
        # the moments: one flat CPU buffer each, every parameter's state a view of it (AdamW's layout)
        self._exp_avg = torch.zeros(self.numel, dtype=torch.float32)
        self._exp_avg_sq = torch.zeros(self.numel, dtype=torch.float32)
        offset = 0
        for p in self.params:
            n = p.numel()
            self.state[p] = {
                "step": torch.tensor(0.0), "exp_avg": self._exp_avg[offset : offset + n].view_as(p),
                "exp_avg_sq": self._exp_avg_sq[offset : offset + n].view_as(p),
            }  # fmt: skip
            offset += n
        device = self.params[0].device if self.params else torch.device("cpu")
        self.device = device
        cuda = device.type == "cuda"
        # two of each staging buffer: chunk i's copies run while the CPU works on chunk i +- 1
        self._grads = [torch.empty(self.chunk_numel, dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
        self._updates = [torch.empty(self.chunk_numel, dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
        self._on_device = [torch.empty(self.chunk_numel, dtype=torch.float32, device=device) for _ in range(2)] if cuda else []
        # gradients down on one stream, updates up (and applied) on another: both directions at once
        self._down = torch.cuda.Stream(device) if cuda else None
        self._up = torch.cuda.Stream(device) if cuda else None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        assert closure is None, "no closure"
        group = self.param_groups[0]
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for p in self.params:
            self.state[p]["step"] += 1
        step = torch.tensor(float(self.state[self.params[0]]["step"])) if self.params else torch.tensor(1.0)
        if self.device.type != "cuda":
            return self._step_cpu(lr, beta1, beta2, eps, wd, step)
        chunks = list(self._chunks())
        copied = self._send(0, chunks[0]) if chunks else None
        applied: list[torch.cuda.Event | None] = [None, None]
        for i, parts in enumerate(chunks):
            slot = i % 2
            copied.synchronize()  # chunk i's gradients are in pinned memory
            if i + 1 < len(chunks):
                copied_next = self._send((i + 1) % 2, chunks[i + 1])
            if applied[slot] is not None:
                applied[slot].synchronize()  # this slot's last update has left the pinned buffer
            n = sum(b - a for _, a, b in parts)
            update = self._updates[slot][:n]
            self._adam(update, self._grads[slot][:n], parts, lr, beta1, beta2, eps, step)
            applied[slot] = self._apply(slot, update, parts, lr, wd)
            if i + 1 < len(chunks):
                copied = copied_next
        torch.cuda.current_stream(self.device).wait_stream(self._up)
        for event in applied:  # the pinned updates are free again before the next step writes them
            if event is not None:
                event.synchronize()

    def _chunks(self) -> Iterator[list[tuple[Tensor, int, int]]]:
        """Chunks of the flat concatenation of the parameters: [(param, start, end) of its flat view]."""
        parts: list[tuple[Tensor, int, int]] = []
        room = self.chunk_numel
        for p in self.params:
            start = 0
            while start < p.numel():
                end = min(p.numel(), start + room)
                parts.append((p, start, end))
                room -= end - start
                start = end
                if room == 0:
                    yield parts
                    parts, room = [], self.chunk_numel
        if parts:
            yield parts

    def _send(self, slot: int, parts: list[tuple[Tensor, int, int]]) -> torch.cuda.Event:
        """Chunk's gradients to pinned slot `slot` on the copy stream, after the current stream's work."""
        self._down.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._down):
            offset = 0
            for p, a, b in parts:
                grad = p.grad.view(-1)[a:b] if p.grad is not None else torch.zeros(b - a, device=self.device)
                self._grads[slot][offset : offset + b - a].copy_(grad, non_blocking=True)
                offset += b - a
            event = torch.cuda.Event()
            event.record(self._down)
        return event

    def _adam(self, update: Tensor, grads: Tensor, parts: list[tuple[Tensor, int, int]], lr: float, beta1: float, beta2: float, eps: float, step: Tensor) -> None:
        """update <- -lr x m_hat / (sqrt(v_hat) + eps), the moments of the chunk updated in place (the fused
        CPU AdamW kernel on a zero "parameter", without weight decay: that acts on the GPU's masters)."""
        first = self._offset(parts[0])
        n = len(update)
        update.zero_()
        torch._fused_adamw_(
            [update], [grads], [self._exp_avg[first : first + n]], [self._exp_avg_sq[first : first + n]], [], [step],
            lr=lr, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False,
        )  # fmt: skip

    def _apply(self, slot: int, update: Tensor, parts: list[tuple[Tensor, int, int]], lr: float, wd: float) -> torch.cuda.Event:
        """The update to the GPU (copy stream) and into the masters: p <- p (1 - lr wd) + update (AdamW's order)."""
        staged = self._on_device[slot][: len(update)]
        self._up.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._up):
            staged.copy_(update, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._up)
            offset = 0
            for p, a, b in parts:
                flat = p.view(-1)[a:b]
                if wd:
                    flat.mul_(1 - lr * wd)
                flat.add_(staged[offset : offset + b - a])
                offset += b - a
        return event

    def _offset(self, part: tuple[Tensor, int, int]) -> int:
        if not hasattr(self, "_starts"):
            self._starts, start = {}, 0
            for p in self.params:
                self._starts[id(p)] = start
                start += p.numel()
        return self._starts[id(part[0])] + part[1]

    def _step_cpu(self, lr: float, beta1: float, beta2: float, eps: float, wd: float, step: Tensor) -> None:
        """Parameters on the CPU (tests): the same update, chunk by chunk, without copies."""
        for parts in self._chunks():
            grads = torch.cat([p.grad.view(-1)[a:b] if p.grad is not None else torch.zeros(b - a) for p, a, b in parts])
            update = torch.empty_like(grads)
            self._adam(update, grads, parts, lr, beta1, beta2, eps, step)
            offset = 0
            for p, a, b in parts:
                flat = p.data.view(-1)[a:b]
                if wd:
                    flat.mul_(1 - lr * wd)
                flat.add_(update[offset : offset + b - a])
                offset += b - a

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """AdamW's state_dict (this class's or torch.optim.AdamW's) into the CPU moments, in place."""
        self.param_groups[0].update({k: v for k, v in state_dict["param_groups"][0].items() if k != "params"})
        for index, p in enumerate(self.params):
            saved = state_dict["state"].get(index)
            if saved is None:
                continue
            state = self.state[p]
            state["exp_avg"].copy_(saved["exp_avg"].reshape(p.shape))
            state["exp_avg_sq"].copy_(saved["exp_avg_sq"].reshape(p.shape))
            state["step"] = torch.tensor(float(saved["step"]))


def cpu_state_bytes(numel: int) -> int:
    """Host memory of the moments of `numel` parameters (what --cpu_optimizer moves off the GPU)."""
    return 8 * numel


def num_chunks(numel: int, chunk_numel: int = CHUNK_NUMEL) -> int:
    return math.ceil(numel / chunk_numel)
