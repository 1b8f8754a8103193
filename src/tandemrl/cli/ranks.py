"""`tandem train` under torchrun: the ranks are started once, before anything is built, and only rank 0
prints, logs and writes the run directory. One process (no torchrun, or one rank) is today's run.
With --tensor_parallel_size T the ranks form W / T engines, each split over T consecutive ranks. With
--rollout_mode server, rank 0 is the servers' one client: it generates and scores every group and pushes
the weights the ranks gather (weights/sharded.py); the other ranks build no generator of their own."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Any

from tandemrl.config import TrainConfig
from tandemrl.train.checkpoint import how_to_continue
from tandemrl.train.distributed import DataParallel, init_data_parallel, lost_a_rank
from tandemrl.types import RunStopped


def start_ranks(config: TrainConfig, use_cuda: bool) -> DataParallel:
    """The process group of a torchrun launch (SINGLE without one), once the config can run on it (the
    rules of the config alone are config.py's; these are those of the launch)."""
    g, p, t = config.generation, config.data.num_prompts_per_step, config.engine.tensor_parallel_size
    dp = init_data_parallel(use_cuda, timeout_s=config.trainer.ddp_timeout)
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


@contextlib.contextmanager
def one_line_when_a_rank_fails(dp: DataParallel, run_dir: Path, timeout_s: float):
    """A rank's failure is one line from rank 0 with how to continue, never a traceback from every rank nor
    silence. A collective that fails (a rank's connection closed, or no answer within --ddp_timeout) is a
    RunStopped naming why, said at once by rank 0; torchrun stops every rank with SIGTERM once one exits
    (and when it is stopped itself), which rank 0 says unless it said why already (torchrun's report below
    names the rank that exited first); the other ranks exit quietly."""
    if not dp.enabled:
        yield
        return
    said: list[RunStopped] = []

    def on_sigterm(signum: int, frame: Any) -> None:
        if dp.is_main and not said:
            print(f"tandem train: stopped by torchrun (SIGTERM: a rank exited, see the report below, or torchrun was stopped); "
                  f"{how_to_continue(run_dir, dp.world_size)}", file=sys.stderr, flush=True)  # fmt: skip
        os._exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except RuntimeError as error:
        if (why := lost_a_rank(error)) is None:
            raise
        said.append(RunStopped(f"rank {dp.rank} lost the other ranks: {why}: a rank died, or stopped answering for --ddp_timeout {timeout_s:g} s; "
                               f"{how_to_continue(run_dir, dp.world_size)}"))  # fmt: skip
        said[0].said = True  # type: ignore[attr-defined]  (cli/main would say it again, after this rank's teardown)
        if dp.is_main:
            print(f"tandem train: error: {said[0]}", file=sys.stderr, flush=True)
        raise said[0] from None
    finally:
        if not said:  # once a rank is lost, torchrun's SIGTERM may come while this one unwinds: it stays handled
            signal.signal(signal.SIGTERM, previous)


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
