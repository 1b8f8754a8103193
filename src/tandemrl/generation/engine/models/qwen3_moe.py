"""Qwen3-MoE written for inference: Qwen3's attention (q/k RMSNorm) with a sparse mixture-of-experts MLP
(layers/moe.py) in every layer transformers makes sparse (`decoder_sparse_step`, `mlp_only_layers`). The
same class serves OLMoE (its attention is family.py's) and Mixtral (whose checkpoints name the block
`block_sparse_moe` and its experts' projections w1 (gate), w3 (up), w2 (down)).

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

from tandemrl.generation.engine.layers.moe import SparseMoe, expert_width, num_experts
from tandemrl.generation.engine.models.llama import LlamaForCausalLM
from tandemrl.generation.engine.parallel import TensorParallel
from tandemrl.types import route_itemsize

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MIXTRAL = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def is_sparse(config: Any, layer: int) -> bool:
    """Whether transformers gives decoder layer `layer` the sparse MLP (Qwen3MoeDecoderLayer's rule; every
    layer of OLMoE and Mixtral, whose configs have neither setting)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer not in (getattr(config, "mlp_only_layers", None) or []) and num_experts(config) > 0 and (layer + 1) % step == 0


def hf_name(name: str) -> str:
    """A checkpoint's name as transformers 5 names the parameter (Mixtral's renamed; others as they are).

    Example: model.layers.0.block_sparse_moe.experts.3.w1.weight -> model.layers.0.mlp.experts.3.gate_proj.weight
    """
    if ".block_sparse_moe." not in name:
        return name
    for old, new in _MIXTRAL.items():
        name = name.replace(old, new)
    return name


def route_dtype(num_experts: int) -> torch.dtype:
    """The dtype routes are recorded in (types.route_itemsize: one byte an expert id up to 256 experts)."""
    return torch.uint8 if route_itemsize(num_experts) == 1 else torch.int16


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, max_positions: int, tp: TensorParallel | None = None) -> None:
        super().__init__(config, max_positions, tp)
        if expert_width(config) % self.shard.size:
            raise ValueError(
                f"--tensor_parallel_size {self.shard.size} does not divide the experts' width {expert_width(config)}; pick a size that does"
            )
        for index, layer in enumerate(self.model.layers):  # attention (and q/k norms) as family.py names them
            if is_sparse(config, index):
                layer.mlp = SparseMoe(config, tp)
        self.sparse_blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoe)]
        self.routes: Tensor | None = None  # [M, R, k] the last forward's chosen experts, when recording

    def record_routes(self, rows: int) -> None:
        """From now on every forward of up to `rows` tokens writes each token's experts into `self.routes`."""
        config = self.config
        self.routes = torch.zeros(len(self.sparse_blocks), rows, config.num_experts_per_tok, dtype=route_dtype(num_experts(config)), device=self.rope_cos_sin.device)
        for block, routes in zip(self.sparse_blocks, self.routes):
            block.routes = routes

    @torch.no_grad()
    def attach_adapters(self, rank: int) -> None:
        raise ValueError("the engine applies LoRA adapters beside a shared base for dense models only (an MoE policy: --lora_engine merged)")

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """LlamaForCausalLM.load_weights, with per-expert tensors copied into their expert's rows here; a
        stacked tensor whose every expert was written counts as written."""
        if isinstance(weights, list) and not any(_PER_EXPERT.match(name) or ".block_sparse_moe." in name for name, _ in weights):
            return super().load_weights(weights)  # a live model's update: keeps the parent's cached load plan
        counts: dict[str, int] = {}
        if isinstance(weights, list):  # checked whole before any copy (the parent checks its list so): a refused one changes nothing
            parts = [(name, tensor, self._expert_part(name, tensor)) for name, tensor in weights]
            written = super().load_weights([(hf_name(name), tensor) for name, tensor, expert in parts if expert is None])
            for stacked, target, source in (expert for _, _, expert in parts if expert is not None):
                target.copy_(source)
                counts[stacked] = counts.get(stacked, 0) + 1
        else:
            written = super().load_weights(self._stacked_only(weights, counts))
        experts = num_experts(self.config)
        return written | {name for name, count in counts.items() if count == experts * (2 if name.endswith("gate_up_proj") else 1)}

    def _stacked_only(self, weights: Iterable[tuple[str, Tensor]], counts: dict[str, int]) -> Iterator[tuple[str, Tensor]]:
        """`weights` less the per-expert tensors, which are copied on the way (counted per stacked parameter)."""
        for name, tensor in weights:
            expert = self._expert_part(name, tensor)
            if expert is None:
                yield hf_name(name), tensor
                continue
            stacked, target, source = expert
            target.copy_(source)
            counts[stacked] = counts.get(stacked, 0) + 1

    def _expert_part(self, name: str, tensor: Tensor) -> tuple[str, Tensor, Tensor] | None:
        """(the stacked parameter, the rows of it a per-expert tensor goes to, this rank's part of the tensor),
        or None for a tensor that is not per-expert; ValueError when its shape is not the expert's."""
        name = hf_name(name)
        match = _PER_EXPERT.match(name)
        if match is None:
            return None
        prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
        stacked = f"{prefix}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
        rows = self.get_parameter(stacked)[expert]  # [2I, E] or [E, I], I this rank's share of the width
        full = expert_width(self.config)
        expected = [rows.shape[0], full] if part == "down_proj" else [full, rows.shape[1]]
        if list(tensor.shape) != expected:  # copy_ broadcasts: checked before, not left to it
            raise ValueError(f"tensor {name} has shape {list(tensor.shape)}; this model's is {expected}")
        if part == "down_proj":
            return stacked, rows, tensor.narrow(-1, *self.shard.span(full))
        width = full // self.shard.size
        return stacked, rows[(part == "up_proj") * width :][:width], tensor.narrow(0, *self.shard.span(full))

    def _split(self, name: str, tensor: Tensor) -> Tensor:
        if self.shard.size == 1 or not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return super()._split(name, tensor)
        width = expert_width(self.config)
        start, length = self.shard.span(width)
        if name.endswith("down_proj"):
            return tensor.narrow(-1, start, length)
        return torch.cat((tensor[:, start : start + length], tensor[:, width + start : width + start + length]), dim=1)
