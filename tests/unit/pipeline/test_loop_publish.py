"""The loop pushes weights only when an optimizer step changed them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tandemrl.pipeline.loop import LoopSettings, _train_and_publish
from tandemrl.train.config import OffloadConfig
from tandemrl.train.offload import TrainerOffload
from tandemrl.types import Batch, Example, Group


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
    settings = LoopSettings(
        max_steps=1, num_prompts_per_step=1, num_generations=1, scale_rewards="group", drop_zero_variance_groups=False,
        seed=0, sleep_level=0, log_completions_steps=0, save_steps=0, save_total_limit=0,
    )
    metrics = asyncio.run(_train_and_publish(parts, settings, batch))
    return len(pushed), metrics


def test_a_step_whose_groups_were_all_dropped_pushes_nothing():
    count, metrics = publish_count(Batch(groups=[], policy_version=3), FakeTrainer(steps=True))
    assert count == 0 and metrics["sync/skipped"] == 1.0


def test_a_skipped_optimizer_step_pushes_nothing_and_a_real_one_pushes_once():
    batch = Batch(groups=[Group(example=Example(prompt="p"), rollouts=[])], policy_version=3)
    assert publish_count(batch, FakeTrainer(steps=False))[0] == 0
    count, metrics = publish_count(batch, FakeTrainer(steps=True))
    assert count == 1 and metrics["sync/skipped"] == 0.0
