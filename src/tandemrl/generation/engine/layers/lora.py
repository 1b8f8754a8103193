"""LoRA adapters applied beside the base weights, for an engine that serves from a colocated LoRA trainer's
own base tensors (`--lora_engine shared`): y = x W^T + (x A^T) B^T, with W the trainer's frozen base (one copy
in the process) and A, B this engine's copies of the adapters (B scaled by lora_alpha / r), written by weight
updates under peft's names and read by CUDA graphs in place.

A fused projection (qkv, gate/up) holds one slot of rank r per part: A stacks the parts' A [S r, in], and B is
block-diagonal [out, S r] (part i's rows read only slot i's columns), so one pair of matmuls serves all parts;
a part without an adapter keeps zeros. A checkpoint's own fused projection (Phi-3's qkv_proj) uses slot 0
for all its rows.

Example: rank 16, Qwen2.5-7B's qkv_proj (3,584 in, 4,608 out): A [48, 3584], B [4608, 48];
"model.layers.0.self_attn.k_proj.lora_A.weight" [16, 3584] -> A[16:32], its lora_B [512, 16] -> B[3584:4096, 16:32].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Adapter:
    """One linear layer's adapters: `a` [slots x rank, in], `b` [out, slots x rank] (zeros: no change)."""

    def __init__(self, *, slots: int, rank: int, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device) -> None:
        self.slots, self.rank = slots, rank
        self.a = torch.zeros(slots * rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(out_features, slots * rank, dtype=dtype, device=device)

    def delta(self, x: Tensor) -> Tensor:
        """(x A^T) B^T: what the adapters add to the base layer's output."""
        return F.linear(F.linear(x, self.a), self.b)


class Linear(nn.Linear):
    """nn.Linear, plus its adapter's delta when one is attached (`adapter`: set by `attach`, never on a
    tensor-parallel rank)."""

    adapter: Adapter | None = None

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        return y if self.adapter is None else y + self.adapter.delta(x)


def attach(module: nn.Linear, *, slots: int, rank: int) -> None:
    """Gives `module` (an engine Linear) zero adapters of `slots` parts of rank `rank`, on its weight's device and dtype."""
    weight = module.weight
    module.adapter = Adapter(slots=slots, rank=rank, in_features=weight.shape[1], out_features=weight.shape[0], dtype=weight.dtype, device=weight.device)
