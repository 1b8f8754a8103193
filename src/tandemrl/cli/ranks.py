"""`tandem train` under torchrun: the ranks are started once, before anything is built, and only rank 0
prints, logs and writes the run directory. One process (no torchrun, or one rank) is today's run.
With --tensor_parallel_size T the ranks form W / T engines, each split over T consecutive ranks. With
--rollout_mode server, rank 0 is the servers' one client: it generates and scores every group and pushes
the weights the ranks gather (weights/sharded.py); the other ranks build no generator of their own."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandemrl.config import TrainConfig
from tandemrl.train.distributed import DataParallel, init_data_parallel


def start_ranks(config: TrainConfig, use_cuda: bool) -> DataParallel:
    """The process group of a torchrun launch (SINGLE without one), once the config can run on it (the
    rules of the config alone are config.py's; these are those of the launch)."""
    g, p, t = config.generation, config.data.num_prompts_per_step, config.engine.tensor_parallel_size
    dp = init_data_parallel(use_cuda)
    if t > 1 and g.rollout_mode == "colocate" and dp.world_size % t:
        raise ValueError(
            f"--tensor_parallel_size {t} splits the colocated engine over that many torchrun ranks: launch with "
            f"torchrun --nproc_per_node a multiple of {t} (now {dp.world_size} rank(s))"
        )
    if not dp.enabled:
        return dp
    if p % dp.world_size:
        raise ValueError(f"--num_prompts_per_step {p} must be a multiple of the {dp.world_size} ranks (each generates and trains as many groups)")
    if g.rollout_mode == "server":
        return dataclasses.replace(dp, rank_zero_generates=True)
    if g.generator != "engine" or g.generator_device:
        raise ValueError("under torchrun each rank generates with its own colocated engine (or rank 0 through rollout servers): drop --generator and --generator_device")
    return dataclasses.replace(dp, tensor_parallel_size=t)


class ServedByRankZero:
    """The Generator of ranks other than 0 in server mode: rank 0 is the servers' one client and generates
    every group (DataParallel.owns), sleeps and wakes them; this one is never asked for tokens."""

    version = 0

    async def generate(self, prompt_ids: list[int], params: Any) -> Any:
        raise AssertionError("in server mode under torchrun only rank 0 generates")

    async def sleep(self, level: int) -> None:
        pass

    async def wake(self) -> None:
        pass

    async def close(self) -> None:
        pass


class Silent:
    """What ranks other than 0 get for the metrics logger and the progress display: every call does nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None
