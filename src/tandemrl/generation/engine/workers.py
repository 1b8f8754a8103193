"""The follower ranks of a tensor-parallel engine, started by the leader's process (`tandem rollout`).

One command uses GPUs 0..N-1 (as vLLM's `--tensor-parallel-size` does): the calling process is rank 0
on the first, and ranks 1..N-1 are spawned here, one process per GPU, each building its shard of the
same model and following rank 0's engine (parallel.py). A watchdog turns a follower's death into one
call of `on_death` (the server logs it and exits: a model missing a shard cannot generate).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandemrl.generation.base import EngineConfig
from tandemrl.generation.engine.parallel import TensorParallel, connect
from tandemrl.generation.loading import resolve_device

log = logging.getLogger(__name__)
WATCH_S = 0.5  # how often the watchdog looks at the followers


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: cuda:r on GPUs (indices within CUDA_VISIBLE_DEVICES), else the CPU."""
    return torch.device("cuda", rank) if resolve_device(device).type == "cuda" else torch.device("cpu")


class Followers:
    """Ranks 1..N-1 as processes, watched: the first to exit while not stopping is reported once."""

    def __init__(self, processes: list[Any], on_death: Callable[[int, int | None], None]) -> None:
        self.processes = processes
        self._stopping = threading.Event()
        self._on_death = on_death
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()
        atexit.register(self.stop)  # runs before multiprocessing's own exit handler kills the followers

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_S):
            for rank, process in enumerate(self.processes, start=1):
                if process.exitcode is not None and not self._stopping.is_set():
                    self._stopping.set()
                    self._on_death(rank, process.exitcode)
                    return

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops watching; waits for followers that are ending (the leader closed), then kills the rest."""
        self._stopping.set()
        for process in self.processes:
            process.join(timeout_s)
            if process.exitcode is None:
                process.kill()


def launch(
    config: EngineConfig, *, model: Any = None, tokenizer: Any = None, on_death: Callable[[int, int | None], None], timeout_s: float = 300.0
) -> tuple[TensorParallel, Followers]:
    """Spawns ranks 1..N-1 of `config` (with rank 0's `model`/`tokenizer`, when built in code) and joins
    them as rank 0; returns rank 0's group and the followers. Rank 0 then builds its Engine with the group."""
    size = config.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_follow, args=(rank, store.port, config, model, tokenizer, timeout_s), name=f"tandem-tp-rank{rank}", daemon=True)
        for rank in range(1, size)
    ]
    for process in processes:
        process.start()
        log.info("tensor-parallel %s started (pid %d)", process.name, process.pid)
    followers = Followers(processes, on_death)
    tp = connect(store, rank=0, size=size, device=rank_device(config.device, 0), timeout_s=timeout_s)
    tp.store = store
    return tp, followers


def _follow(rank: int, port: int, config: EngineConfig, model: Any, tokenizer: Any, timeout_s: float) -> None:
    """A follower process (its program, so it sets up its own logging): joins, builds, follows rank 0."""
    from tandemrl.generation.engine.engine import Engine

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    device = rank_device(config.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    tp = connect(store, rank=rank, size=config.tensor_parallel_size, device=device, timeout_s=timeout_s)
    engine = Engine(dataclasses.replace(config, device=str(device)), model=model, tokenizer=tokenizer, tp=tp)
    followed = engine.follow()
    if followed:  # a lost leader leaves collectives that would never end: exiting is all there is
        engine.release_group()
    raise SystemExit(0 if followed else 1)
