"""`tandem train` under torchrun: the ranks are started once, before anything is built, and only rank 0
prints, logs and writes the run directory. One process (no torchrun, or one rank) is today's run."""

from __future__ import annotations

from typing import Any

from tandemrl.config import TrainConfig
from tandemrl.train.distributed import DataParallel, init_data_parallel


def start_ranks(config: TrainConfig, use_cuda: bool) -> DataParallel:
    """The process group of a torchrun launch (SINGLE without one), once the config can run on it."""
    dp = init_data_parallel(use_cuda)
    if not dp.enabled:
        return dp
    g, p = config.generation, config.data.num_prompts_per_step
    if p % dp.world_size:
        raise ValueError(f"--num_prompts_per_step {p} must be a multiple of the {dp.world_size} ranks (each generates and trains as many groups)")
    if g.rollout_mode != "colocate" or g.generator != "engine" or g.generator_device:
        raise ValueError("under torchrun each rank generates with its own colocated engine: drop --rollout_mode, --generator and --generator_device")
    if config.lora.enabled:
        raise ValueError(
            "--lora_r does not run under torchrun yet (peft's adapters are not sharded with the policy by FSDP2): drop it, or train in one process"
        )
    return dp


class Silent:
    """What ranks other than 0 get for the metrics logger and the progress display: every call does nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None
