"""The loop pushes weights only when an optimizer step changed them."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from tandemrl.generation.remote.batch import ServerError
from tandemrl.pipeline.loop import LoopSettings, _train_and_publish
from tandemrl.train.config import OffloadConfig
from tandemrl.train.offload import TrainerOffload
from tandemrl.types import Batch, Example, Group, RunStopped

SETTINGS = LoopSettings(
    max_steps=1, num_prompts_per_step=1, num_generations=1, scale_rewards="group", drop_zero_variance_groups=False,
    seed=0, sleep_level=0, log_completions_steps=0, save_steps=0, save_total_limit=0,
)


class FakeTrainer:
    def __init__(self, *, steps: bool) -> None:
        self.policy_version, self.steps = 3, steps
        self.model = SimpleNamespace(named_parameters=lambda: iter([]))
        self.offload = TrainerOffload(OffloadConfig(), self)  # levers off: every call a no-op

    def published_weights(self):
        return self.model.named_parameters()

    def train_step(self, batch: Batch) -> dict[str, float]:
        self.policy_version += self.steps  # a skipped non-finite step leaves the version as it was
        return {}


def publish_count(batch: Batch, trainer: FakeTrainer) -> tuple[int, dict[str, float]]:
    pushed: list[int] = []

    async def publish(weights, *, version: int) -> None:
        pushed.append(version)

    parts = SimpleNamespace(trainer=trainer, sync=SimpleNamespace(publish=publish), progress=SimpleNamespace(phase=lambda name: None))
    metrics = asyncio.run(_train_and_publish(parts, SETTINGS, batch))
    return len(pushed), metrics


def test_a_step_whose_groups_were_all_dropped_pushes_nothing():
    count, metrics = publish_count(Batch(groups=[], policy_version=3), FakeTrainer(steps=True))
    assert count == 0 and metrics["sync/skipped"] == 1.0


def test_a_skipped_optimizer_step_pushes_nothing_and_a_real_one_pushes_once():
    batch = Batch(groups=[Group(example=Example(prompt="p"), rollouts=[])], policy_version=3)
    assert publish_count(batch, FakeTrainer(steps=False))[0] == 0
    count, metrics = publish_count(batch, FakeTrainer(steps=True))
    assert count == 1 and metrics["sync/skipped"] == 0.0


def test_a_rollout_server_that_refuses_to_sleep_stops_the_run_in_one_line():
    """A server's /sleep answered 504 (its requests ran past --drain_timeout_s): the ServerError went out of the
    loop as a traceback (failed on main); now RunStopped, which `tandem` prints as one line."""

    class Refusing:
        async def sleep(self, level: int) -> None:
            raise ServerError("http://s:1", 504, "not asleep: 2 request(s) still running after 300 s (--drain_timeout_s)")

    parts = SimpleNamespace(trainer=FakeTrainer(steps=True), generator=Refusing(), progress=SimpleNamespace(phase=lambda name: None))
    settings = dataclasses.replace(SETTINGS, sleep_level=1)
    with pytest.raises(RunStopped, match=r"^putting the generator to sleep \(level 1\) failed: rollout server http://s:1 answered 504: not asleep: 2 request"):
        asyncio.run(_train_and_publish(parts, settings, Batch(groups=[], policy_version=3)))
