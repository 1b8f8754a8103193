"""The sharded push of server mode under torchrun, in one process: every batch is gathered whatever the
push does, the tensors are gathered a batch at a time as the push reaches them, and a failed push is one
RuntimeError. (Two real ranks and a real server: tests/integration/server/test_train_torchrun_server.py.)"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from tandemrl.train.distributed import SINGLE
from tandemrl.weights import sharded
from tandemrl.weights.sharded import ShardedSync

NAMED = [(f"w{i}", torch.full((2,), float(i))) for i in range(6)]


class Pusher:
    """Takes `num_taken` tensors of a publish, noting how many gathers had run at each, then fails (or returns)."""

    def __init__(self, num_taken: int, *, fail: bool, log: list[str]) -> None:
        self.num_taken, self.fail, self.log = num_taken, fail, log

    async def publish(self, weights, *, version: int) -> None:
        for _, (name, _) in zip(range(self.num_taken), weights):
            self.log.append(f"took {name}")
        if self.fail:
            raise RuntimeError(f"weight sync of version {version} to http://x failed: gone")


@pytest.fixture
def log(monkeypatch) -> list[str]:
    events: list[str] = []

    def full_tensor(tensor, dtype=None):
        time.sleep(0.005)  # a gather takes time: a second thread pulling meanwhile must wait its turn
        events.append(f"gathered {int(tensor[0])}" + (f" as {dtype}" if dtype is not None else ""))
        return tensor

    monkeypatch.setattr(sharded, "full_tensor", full_tensor)
    return events


def test_tensors_are_gathered_a_batch_at_a_time_as_the_push_reaches_them(log):
    asyncio.run(ShardedSync(Pusher(6, fail=False, log=log), SINGLE, move_model_batches=3).publish(NAMED, version=1))
    assert log == [
        "gathered 0", "gathered 1", "took w0", "took w1",
        "gathered 2", "gathered 3", "took w2", "took w3",
        "gathered 4", "gathered 5", "took w4", "took w5",
    ]  # fmt: skip


def test_a_failed_push_still_gathers_every_batch_then_raises_its_error(log):
    sync = ShardedSync(Pusher(1, fail=True, log=log), SINGLE, move_model_batches=3)
    with pytest.raises(RuntimeError, match="weight sync of version 2 to http://x failed: gone"):
        asyncio.run(sync.publish(NAMED, version=2))
    assert [e for e in log if e.startswith("gathered")] == [f"gathered {i}" for i in range(6)]  # no rank left in a collective


def test_a_rank_without_a_pusher_gathers_every_batch(log):
    asyncio.run(ShardedSync(None, SINGLE, move_model_batches=2).publish(NAMED, version=1))
    assert log == [f"gathered {i}" for i in range(6)]


def test_a_sending_thread_left_behind_by_a_failed_push_shares_the_pulls_in_order(log):
    """DistributedSync leaves a send stuck on a dead server behind; it may still pull while the rest is gathered."""
    pulled: list[str] = []

    class LeftBehind:
        async def publish(self, weights, *, version: int) -> None:
            next(weights)
            threading.Thread(target=lambda: pulled.extend(name for name, _ in weights), daemon=True).start()
            raise RuntimeError("weight sync failed: gone")

    with pytest.raises(RuntimeError, match="gone"):
        asyncio.run(ShardedSync(LeftBehind(), SINGLE, move_model_batches=3).publish(NAMED, version=1))
    assert log == [f"gathered {i}" for i in range(6)]  # each batch gathered once, in order, by one thread at a time


def test_shards_are_gathered_in_the_gather_dtype(log):
    asyncio.run(ShardedSync(None, SINGLE, move_model_batches=2, gather_dtype=torch.bfloat16).publish(NAMED[:2], version=1))
    assert log == ["gathered 0 as torch.bfloat16", "gathered 1 as torch.bfloat16"]
