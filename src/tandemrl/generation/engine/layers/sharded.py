"""Layers split across tensor-parallel ranks (Megatron's column/row split); with no group, plain layers.

Column-parallel needs no layer of its own: a Linear whose output features are this rank's (the fused
qkv of its heads, the gate/up of its MLP columns). Row-parallel takes this rank's input features and
sums the partial outputs over ranks, adding the bias once after the sum. The vocabulary is split by
rows (ceil(V / ranks) each, the last padded with zero rows): the embedding looks up the ids in this
rank's rows and sums over ranks; the head's logits of every rank are gathered into [*, V].
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from tandemrl.generation.engine.layers.lora import Linear
from tandemrl.generation.engine.parallel import TensorParallel


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T, + bias (whole on every rank, added once); on one rank a plain Linear
    (adapters included, layers/lora.py)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, tp: TensorParallel | None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        if self.tp is None:
            return super().forward(x)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [start, start + rows) of the embedding; ids outside them contribute zeros."""

    def __init__(self, num_rows: int, dim: int, *, start: int, tp: TensorParallel | None) -> None:
        super().__init__(num_rows, dim)
        self.start, self.tp = start, tp

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp is None:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)  # [N]
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(x)


def gathered_logits(hidden: Tensor, weight: Tensor, vocab_size: int, tp: TensorParallel | None) -> Tensor:
    """hidden [B, E] x this rank's head rows [V_r, E] -> logits [B, V], the same on every rank."""
    logits = F.linear(hidden, weight)
    if tp is None:
        return logits
    return tp.all_gather_last(logits)[:, :vocab_size]
