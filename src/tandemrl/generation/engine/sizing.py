"""The engine's KV cache size: what the memory budget allows on a GPU (or the size a memory plan or the user
chose), never more blocks than max_num_seqs sequences of max_model_len can use. One function, read once
when the engine is built; a memory plan that sizes the engine beforehand sets --kv_cache_tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tandemrl.generation.base import EngineConfig
    from tandemrl.generation.engine.runner import ModelRunner

CPU_KV_CACHE_TOKENS = 65536  # --kv_cache_tokens 0 on a CPU


def num_kv_blocks(config: EngineConfig, model_config: Any, runner: ModelRunner, device: torch.device, *, max_model_len: int) -> int:
    """What the memory budget allows, but never more than max_num_seqs sequences of max_model_len can
    hold at once (+ the scratch block): a tiny model on a large GPU would otherwise book millions of
    blocks (host bookkeeping of seconds, memory the colocated trainer needs) that no batch can use."""
    usable = config.max_num_seqs * -(-max_model_len // config.block_size) + 1
    if device.type != "cuda" or config.kv_cache_tokens:  # on a GPU: a size the memory plan (or the user) chose
        return min(usable, max(2, (config.kv_cache_tokens or CPU_KV_CACHE_TOKENS) // config.block_size + 1))
    free, total = torch.cuda.mem_get_info(device)
    reusable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    # head room for activations: the largest prefill (twice with prefill graphs: their pool keeps one
    # beside the eager path's), and logits + sampler buffers of a full decode batch
    hidden = model_config.hidden_size + 3 * model_config.intermediate_size
    prefill = config.max_num_batched_tokens * hidden * 4 * (2 if runner.graph_prefills else 1)
    activations = prefill + config.max_num_seqs * model_config.vocab_size * 4 * 4
    in_use = total - free - reusable
    fraction = config.memory_fraction(colocated=False)
    budget = total * fraction - in_use - activations
    least = max_model_len // config.block_size + 2
    if budget < least * runner.bytes_per_block():
        gib = 2**30
        raise ValueError(
            f"the KV cache gets {max(0.0, budget) / gib:.1f} GiB, less than one sequence of max_model_len {max_model_len} needs "
            f"({least * runner.bytes_per_block() / gib:.2f} GiB): --gpu_memory_utilization {fraction} of {total / gib:.0f} GiB, "
            f"{in_use / gib:.1f} GiB already in use, {activations / gib:.1f} GiB kept for activations; raise --gpu_memory_utilization "
            "(a fraction of the whole GPU) or lower --max_model_len"
        )
    return min(usable, int(budget // runner.bytes_per_block()))
