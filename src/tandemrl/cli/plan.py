"""`tandem train`'s memory plan (memory.py) from its TrainConfig: made before anything loads, printed in
the banner and by `--print_plan`, and applied: the levers it turns on, the KV cache and the micro-batch.

Only what the user left at its default is planned: a lever the user turned on stays on, a
--max_tokens_per_microbatch, --kv_cache_tokens or --gpu_memory_utilization the user gave is kept (the
last keeps its meaning: the engine's share of the whole GPU, from which the plan takes the KV cache).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tandemrl.config import TrainConfig
from tandemrl.memory import GiB, Levers, MemoryPlan, MemoryPlanError, ModelShape, Setup, plan_memory


def model_config(config: TrainConfig) -> Any:
    """The policy's Hugging Face config, without its weights."""
    from tandemrl.tasks.synthetic import TINY_MODEL

    if config.run.model == TINY_MODEL:
        from tandemrl.tasks.tiny import build_model, build_tokenizer

        return build_model(build_tokenizer()).config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(config.run.model, trust_remote_code=config.run.trust_remote_code)


def max_model_len(config: TrainConfig, max_positions: int | None = None) -> int:
    """The colocated engine's max_model_len (cli/build.py sizes it the same way)."""
    wanted = config.data.max_prompt_length + config.algo.max_completion_length
    if config.tools.enabled:
        wanted = max(wanted, config.tools.max_total_tokens)
    return config.engine.model_len(max_positions=max_positions, wanted=wanted)


def memory_setup(config: TrainConfig, *, num_ranks: int = 1, hf_config: Any = None) -> Setup:
    """The run as the plan sees it: one rank's share of it under torchrun."""
    g, e, t, o = config.generation, config.engine, config.trainer, config.offload
    engine = g.rollout_mode == "colocate" and g.generator == "engine" and not g.generator_device
    shares_base = config.lora_engine_shares_base(num_ranks=num_ranks, hf_config=hf_config)
    frozen = ["offload_model"] if shares_base else []  # levers the plan may not turn on here (the engine generates from the base)
    if g.max_staleness > 0 or not engine:
        frozen.append("sleep_level")
    if num_ranks > 1:
        frozen.append("cpu_optimizer")
    if g.rollout_mode == "colocate" and g.generator == "hf":
        frozen.append("offload_model")
    length = max_model_len(config)
    return Setup(
        lora_rank=config.lora.lora_r, lora_targets=tuple(config.lora.lora_target_modules), master_bytes=4 if t.dtype == "float32" else 2,
        mixed=t.bf16 and t.dtype == "float32", engine=engine, engine_shares_base=shares_base, reference=config.algo.beta > 0 and not config.lora.enabled, num_ranks=num_ranks,
        num_sequences=max(1, config.data.num_prompts_per_step * config.data.num_generations * config.data.steps_per_round // num_ranks),
        group_size=config.data.num_generations, prompt_tokens=config.data.max_prompt_length, max_model_len=length, block_size=e.block_size,
        prefill_tokens=max(e.max_num_batched_tokens, length), logprob_chunk_size=t.logprob_chunk_size,
        levers=Levers(sleep_level=g.sleep_level, offload_optimizer=o.offload_optimizer, offload_model=o.offload_model,
                      gradient_checkpointing=t.gradient_checkpointing, cpu_optimizer=o.cpu_optimizer),
        frozen_levers=tuple(frozen), microbatch_tokens=t.max_tokens_per_microbatch, kv_tokens=e.kv_cache_tokens,
        engine_fraction=e.gpu_memory_utilization if engine else 0.0, cpu_optimizer_compute=o.cpu_optimizer_compute,
    )  # fmt: skip


def plan_for(config: TrainConfig, gpu_bytes: int, *, hf_config: Any = None, num_ranks: int = 1) -> MemoryPlan:
    """The plan of this run on a GPU of `gpu_bytes`; MemoryPlanError (a ValueError, one line) if it cannot fit.

    LoRA under --lora_engine auto, where the engine could serve beside the trainer's base: the engine keeps a
    merged copy of its own when that costs nothing but memory the plan has spare (the same levers, KV cache
    and micro-batch as sharing the base), since it then generates without the adapters' extra matmuls; else
    it shares the base (one copy of it on the GPU). Example: 7B LoRA r16, 16 x 8 x (128 + 256) tokens: on a 141 or a
    40 GB GPU -> merged (~36 GiB at the default micro-batch), on 24 GB -> shared (~20 GiB). with_plan() writes the choice into the config the build reads."""
    hf_config = hf_config if hf_config is not None else model_config(config)
    return plan_run(config, ModelShape.from_hf_config(hf_config), memory_setup(config, num_ranks=num_ranks, hf_config=hf_config), gpu_bytes)


def plan_run(config: TrainConfig, shape: ModelShape, setup: Setup, gpu_bytes: int) -> MemoryPlan:
    """plan_for's plan from the model's shape and the run's setup (the build's entry: it reads the shape itself)."""
    plan = plan_memory(shape, setup, gpu_bytes=gpu_bytes)
    if not (setup.engine_shares_base and config.lora.lora_engine == "auto"):
        return plan
    try:
        merged = plan_memory(shape, dataclasses.replace(setup, engine_shares_base=False), gpu_bytes=gpu_bytes)
    except MemoryPlanError:
        return plan
    same = (merged.levers, merged.kv_tokens, merged.microbatch_tokens) == (plan.levers, plan.kv_tokens, plan.microbatch_tokens)
    return merged if same else plan


def with_plan(config: TrainConfig, plan: MemoryPlan) -> TrainConfig:
    """`config` with the plan's levers on and its sizes where the user left them to it."""
    levers, e, t = plan.levers, config.engine, config.trainer
    planned_kv = plan.setup.engine and not e.gpu_memory_utilization and not e.kv_cache_tokens
    lora = config.lora
    if lora.enabled and lora.lora_engine == "auto" and plan.setup.engine:  # plan_for's choice (servers keep auto: their own rule)
        lora = dataclasses.replace(lora, lora_engine="shared" if plan.setup.engine_shares_base else "merged")
    return dataclasses.replace(
        config,
        lora=lora,
        generation=dataclasses.replace(config.generation, sleep_level=levers.sleep_level),
        offload=dataclasses.replace(config.offload, offload_optimizer=levers.offload_optimizer, offload_model=levers.offload_model,
                                    cpu_optimizer=levers.cpu_optimizer),
        trainer=dataclasses.replace(t, gradient_checkpointing=levers.gradient_checkpointing,
                                    max_tokens_per_microbatch=t.max_tokens_per_microbatch or plan.microbatch_tokens),
        engine=dataclasses.replace(e, kv_cache_tokens=plan.kv_tokens) if planned_kv else e,
    )  # fmt: skip


def gpu_bytes(device: Any) -> int:
    """Total memory of a CUDA device (what the plan budgets)."""
    import torch

    return torch.cuda.mem_get_info(device)[1]


def print_plan(config: TrainConfig, gpu_gb: str) -> None:
    """--print_plan [GB]: the plan on this machine's GPU, or on a GPU of GB gigabytes (as sold: 24, 80, 141)."""
    if gpu_gb == "auto":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--print_plan: no GPU here; give the GPU's size, e.g. --print_plan 80")
        total = gpu_bytes(torch.device("cuda"))
    else:
        try:
            total = int(float(gpu_gb) * 0.99 * GiB)  # a GPU sold as N GB reports ~0.99 N GiB (24 -> 23.6, 80 -> 79.2, 141 -> 139.8)
        except ValueError:
            raise ValueError(f"--print_plan takes a GPU size in GB (e.g. 80), got {gpu_gb!r}") from None
    print("\n".join(plan_for(config, total).lines()))


def planned_peaks_gib(plan: MemoryPlan | None) -> dict[str, float] | None:
    return None if plan is None else {phase: plan.peak(phase) / GiB for phase in plan.phases}
