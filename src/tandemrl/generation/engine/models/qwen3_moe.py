"""Qwen3-MoE written for inference: Qwen3's attention (q/k RMSNorm) with a sparse mixture-of-experts MLP
(layers/moe.py) in every layer transformers makes sparse (`decoder_sparse_step`, `mlp_only_layers`).

Legend: X experts, E hidden size, I expert width, k experts per token, M sparse layers, R rows recorded.

Weights load from either naming: transformers 5's stacked `mlp.experts.gate_up_proj` [X, 2I, E] and
`mlp.experts.down_proj` [X, E, I] (an in-memory model, a weight update: the parameters' own names), or
the per-expert `mlp.experts.{j}.{gate,up,down}_proj.weight` of checkpoints on disk, each copied into its
expert's rows. With tensor parallelism each rank holds every expert's columns of the intermediate
dimension (moe.py). `record_routes` keeps each step's chosen experts per sparse layer (routing replay).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from tandemrl.generation.engine.layers.moe import SparseMoe
from tandemrl.generation.engine.models.llama import LlamaForCausalLM, RMSNorm
from tandemrl.generation.engine.parallel import TensorParallel
from tandemrl.types import route_itemsize

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def is_sparse(config: Any, layer: int) -> bool:
    """Whether transformers gives decoder layer `layer` the sparse MLP (Qwen3MoeDecoderLayer's rule)."""
    return layer not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0 and (layer + 1) % config.decoder_sparse_step == 0


def route_dtype(num_experts: int) -> torch.dtype:
    """The dtype routes are recorded in (types.route_itemsize: one byte an expert id up to 256 experts)."""
    return torch.uint8 if route_itemsize(num_experts) == 1 else torch.int16


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, max_positions: int, tp: TensorParallel | None = None) -> None:
        super().__init__(config, max_positions, tp)
        if config.moe_intermediate_size % self.shard.size:
            raise ValueError(
                f"--tensor_parallel_size {self.shard.size} does not divide the experts' width {config.moe_intermediate_size}; pick a size that does"
            )
        for index, layer in enumerate(self.model.layers):
            if not hasattr(layer.self_attn, "q_norm"):
                layer.self_attn.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
                layer.self_attn.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            if is_sparse(config, index):
                layer.mlp = SparseMoe(config, tp)
        self.sparse_blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoe)]
        self.routes: Tensor | None = None  # [M, R, k] the last forward's chosen experts, when recording

    def record_routes(self, rows: int) -> None:
        """From now on every forward of up to `rows` tokens writes each token's experts into `self.routes`."""
        config = self.config
        self.routes = torch.zeros(len(self.sparse_blocks), rows, config.num_experts_per_tok, dtype=route_dtype(config.num_experts), device=self.rope_cos_sin.device)
        for block, routes in zip(self.sparse_blocks, self.routes):
            block.routes = routes

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """LlamaForCausalLM.load_weights, with per-expert tensors copied into their expert's rows here; a
        stacked tensor whose every expert was written counts as written."""
        if isinstance(weights, list) and not any(_PER_EXPERT.match(name) for name, _ in weights):
            return super().load_weights(weights)  # a live model's update: keeps the parent's cached load plan
        counts: dict[str, int] = {}
        written = super().load_weights(self._stacked_only(weights, counts))
        experts = self.config.num_experts
        return written | {name for name, count in counts.items() if count == experts * (2 if name.endswith("gate_up_proj") else 1)}

    def _stacked_only(self, weights: Iterable[tuple[str, Tensor]], counts: dict[str, int]) -> Iterator[tuple[str, Tensor]]:
        """`weights` less the per-expert tensors, which are copied on the way (counted per stacked parameter)."""
        for name, tensor in weights:
            match = _PER_EXPERT.match(name)
            if match is None:
                yield name, tensor
                continue
            prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
            stacked = f"{prefix}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
            target = self.get_parameter(stacked)[expert]  # [2I, E] or [E, I]
            width = self.config.moe_intermediate_size // self.shard.size
            if part == "down_proj":
                target.copy_(tensor.narrow(-1, *self.shard.span(self.config.moe_intermediate_size)))
            else:
                rows = tensor.narrow(0, *self.shard.span(self.config.moe_intermediate_size))
                target[(part == "up_proj") * width :][:width].copy_(rows)
            counts[stacked] = counts.get(stacked, 0) + 1

    def _split(self, name: str, tensor: Tensor) -> Tensor:
        if self.shard.size == 1 or not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return super()._split(name, tensor)
        width = self.config.moe_intermediate_size
        start, length = self.shard.span(width)
        if name.endswith("down_proj"):
            return tensor.narrow(-1, start, length)
        return torch.cat((tensor[:, start : start + length], tensor[:, width + start : width + start + length]), dim=1)
