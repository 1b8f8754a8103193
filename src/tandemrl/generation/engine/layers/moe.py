"""A sparse mixture-of-experts MLP for inference: top-k routing, then every expert's gate/up and down
projections as grouped GEMMs over the (token, expert) pairs sorted by expert, never a loop over experts.

Legend: N tokens, E hidden size, X experts, I expert width (this rank's), k experts per token, S = N * k pairs.

On CUDA the two grouped GEMMs are Triton kernels (moe_kernel.py) whose launch sizes depend on N only, so
a decode step runs inside a CUDA graph with no host sync. On CPU (the tests' reference path) the pairs
are sorted by expert and each multiplies its expert's gathered weights (bmm). Numerics follow
transformers' Qwen3-MoE: router logits in the activation dtype, softmax in float32, top-k, optionally
renormalised (norm_topk_prob), the weights cast back before they scale each expert's output.
With tensor parallelism every rank holds all experts' columns [r * I, (r + 1) * I) of the intermediate
dimension, so the router and the pairs are the same on every rank and one all-reduce sums the outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandemrl.generation.engine.parallel import TensorParallel


def num_experts(config) -> int:
    """Experts per sparse layer (Mixtral's config names them num_local_experts)."""
    return getattr(config, "num_experts", None) or config.num_local_experts


def expert_width(config) -> int:
    """An expert's intermediate width (OLMoE's and Mixtral's configs name it intermediate_size)."""
    return getattr(config, "moe_intermediate_size", None) or config.intermediate_size


def route(logits: Tensor, top_k: int, *, normalise: bool) -> tuple[Tensor, Tensor]:
    """(weights [N, k] in logits' dtype, expert ids [N, k]) of the k most probable experts.

    Example: logits [[0, ln 3, ln 2]], k 2, normalise -> weights [[0.6, 0.4]], ids [[1, 2]]
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [N, X]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def experts_reference(x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    """sum_j weights[n, j] * down[ids[n, j]] @ (silu(gate) * up)(gate_up[ids[n, j]] @ x[n]), loop-free.

    x [N, E], gate_up [X, 2I, E], down [X, E, I], weights/ids [N, k] -> [N, E]. The pairs are sorted by
    expert, as the GPU kernel groups them; each pair multiplies its expert's gathered weights (O(S I E)
    memory: for the small models of tests and CPU runs)."""
    top_k = ids.shape[1]
    order = torch.argsort(ids.flatten(), stable=True)  # [S] pairs grouped by expert
    experts, tokens = ids.flatten()[order], order // top_k  # [S], [S]
    h = torch.bmm(gate_up[experts], x[tokens, :, None]).squeeze(-1)  # [S, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(down[experts], (F.silu(gate) * up)[:, :, None]).squeeze(-1)  # [S, E]
    y = y * weights.flatten()[order, None]
    return torch.zeros_like(x).index_add_(0, tokens, y)


class Experts(nn.Module):
    """The experts' weights, stacked as transformers 5 holds them: gate_up_proj [X, 2I, E], down_proj [X, E, I]
    (this rank's I columns of each)."""

    def __init__(self, num_experts: int, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width))


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class SparseMoe(nn.Module):
    """forward(x [N, E]) -> [N, E]. Parameter names are transformers': `gate.weight`, `experts.gate_up_proj`,
    `experts.down_proj`. `routes` ([rows, k] uint8 or int16, set by the model when it records routes): the
    chosen experts of each row are written there, for routing replay."""

    def __init__(self, config, tp: TensorParallel | None) -> None:
        super().__init__()
        size = tp.size if tp is not None else 1
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.normalise = bool(getattr(config, "norm_topk_prob", True))
        self.gate = Router(num_experts(config), config.hidden_size)
        self.experts = Experts(num_experts(config), config.hidden_size, expert_width(config) // size)
        self.routes: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = route(F.linear(x, self.gate.weight), self.top_k, normalise=self.normalise)  # [N, k]
        if self.routes is not None:
            self.routes[: len(x)].copy_(ids)
        if x.is_cuda:
            from tandemrl.generation.engine.layers.moe_kernel import fused_experts

            y = fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        else:
            y = experts_reference(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        return y if self.tp is None else self.tp.all_reduce(y)
