"""`tandem train` under torchrun: the ranks are started once, before anything is built, and only rank 0
prints, logs and writes the run directory. One process (no torchrun, or one rank) is today's run.
With --tensor_parallel_size T the ranks form W / T engines, each split over T consecutive ranks."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandemrl.config import TrainConfig
from tandemrl.train.distributed import DataParallel, init_data_parallel


def start_ranks(config: TrainConfig, use_cuda: bool) -> DataParallel:
    """The process group of a torchrun launch (SINGLE without one), once the config can run on it."""
    dp = init_data_parallel(use_cuda)
    g, p, t = config.generation, config.data.num_prompts_per_step, config.engine.tensor_parallel_size
    if t > 1 and g.rollout_mode == "colocate" and dp.world_size % t:
        raise ValueError(
            f"--tensor_parallel_size {t} splits the colocated engine over that many torchrun ranks: launch with "
            f"torchrun --nproc_per_node a multiple of {t} (now {dp.world_size} rank(s))"
        )
    if not dp.enabled:
        return dp
    if p % dp.world_size:
        raise ValueError(f"--num_prompts_per_step {p} must be a multiple of the {dp.world_size} ranks (each generates and trains as many groups)")
    if g.rollout_mode != "colocate" or g.generator != "engine" or g.generator_device:
        raise ValueError("under torchrun each rank generates with its own colocated engine: drop --rollout_mode, --generator and --generator_device")
    return dataclasses.replace(dp, tensor_parallel_size=t)


class Silent:
    """What ranks other than 0 get for the metrics logger and the progress display: every call does nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None
