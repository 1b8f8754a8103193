"""The producer: admits groups into the rollout buffer in order, a generation round at a time (the groups
of --steps_per_generation steps, TRL's generation batch), then generates and scores each group as its
own task, so a group is scored as soon as it completes and a slow reward never stalls sampling.

Invariant: group j samples with seeds derived from (seed, step j // P, slot j % P) alone and takes the
j-th prompt of the cursor's order, so the data of a run does not depend on timing, and a group
regenerated after a resume is the same prompt with the same seeds. Under torchrun every rank admits
every group (the cursors move together) and generates those it owns; another rank's is put as None.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandemrl.algo.advantage import nan_std
from tandemrl.pipeline.buffer import RolloutBuffer
from tandemrl.rewards.base import RewardFunc, RewardLogs, RewardTimeoutError, TrainerState, score
from tandemrl.rollout.group import failed, play_group
from tandemrl.rollout.run import conversation_of
from tandemrl.types import Group, RolloutStatus

if TYPE_CHECKING:
    from tandemrl.pipeline.parts import LoopParts
    from tandemrl.pipeline.settings import LoopSettings

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class GroupTiming:
    """When a group was admitted and finished generating, how long its scoring took (seconds), and how it ended."""

    admitted: float
    generated: float
    reward_s: float
    nonfinite: bool = False  # a reward was not finite (--reward_nonfinite skip): not trained
    timed_out: bool = False  # scoring passed --reward_timeout_s: not trained


class Producer:
    """Fills `buffer` with the groups of `rounds` (steps per round, see generation_rounds), P a step."""

    def __init__(self, parts: LoopParts, settings: LoopSettings, buffer: RolloutBuffer, *, rounds: list[int]) -> None:
        self.parts = parts
        self.settings = settings
        self.buffer = buffer
        self.rounds = rounds
        self.timings: dict[int, GroupTiming] = {}
        self._scoring: set[int] = set()  # admissions generated and being scored
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        """Starts admitting; an error of the producer or of a group surfaces at the trainer's next take."""
        self._spawn(self._admit_all())

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def _admit_all(self) -> None:
        for num_steps in self.rounds:
            for index in await self.buffer.admit(num_steps * self.settings.num_prompts_per_step):
                example_index = self.parts.cursor.take(1)[0]
                epoch = self.parts.cursor.num_taken / self.parts.cursor.num_examples  # passes over the data, this prompt included
                if self.parts.dp.owns(index):
                    self._spawn(self._produce(index, example_index, epoch))
                else:
                    self.buffer.put(index, None)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.buffer.fail(task.exception())

    def _name_phase(self) -> None:
        """While the trainer waits and every group it waits for is generated, the step is in "reward"."""
        waiting = self.buffer.waiting_for
        if waiting is not None and all(i in self._scoring or self.buffer.has(i) for i in waiting):
            self.parts.progress.phase("reward")

    def step_times(self, indices: range) -> dict[str, float]:
        """rollout/generate_s: first admission to last generated group of a step (it overlaps training when
        S > 0); rollout/reward_s: seconds its groups spent scoring, summed (scoring overlaps generation);
        time/reward: scoring still running after the last group was generated (the loop's critical_path)."""
        timings = [self.timings.pop(i) for i in indices if i in self.timings]  # this rank's groups
        if not timings:  # a rank whose engine another rank of its tensor-parallel group drives
            timings = [GroupTiming(admitted=0.0, generated=0.0, reward_s=0.0)]
        last_generated = max(t.generated for t in timings)
        return {
            "rollout/generate_s": last_generated - min(t.admitted for t in timings),
            "rollout/reward_s": sum(t.reward_s for t in timings),
            "time/reward": max(0.0, max(t.generated + t.reward_s for t in timings) - last_generated),
            "rollout/nonfinite_reward_groups": float(sum(t.nonfinite for t in timings)),
            "rollout/reward_timeouts": float(sum(t.timed_out for t in timings)),
        }

    async def cancel(self) -> None:
        """Cancels the groups still generating (the engine aborts their requests)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _produce(self, index: int, example_index: int, epoch: float) -> None:
        admitted = time.perf_counter()
        step, slot = divmod(index, self.settings.num_prompts_per_step)
        g = self.settings.num_generations
        group = await play_group(
            self.parts.examples[example_index], self.parts.prompt_ids[example_index], generator=self.parts.generator,
            params=self.parts.params, group_size=g, tokenizer=self.parts.tokenizer, seed=group_seed(self.settings.seed, step) + slot * g,
            multi_turn=self.parts.multi_turn,
        )
        generated = time.perf_counter()
        nonfinite = timed_out = False
        self._scoring.add(index)
        self._name_phase()
        if not failed(group):
            state = TrainerState(global_step=step, epoch=epoch, max_steps=self.settings.max_steps)
            num_nonfinite, timed_out = await score_or_drop(
                [group], self.parts, self.settings, state, f"the group of example {group.example.index} is not trained"
            )  # fmt: skip
            nonfinite = num_nonfinite > 0
        reward_s = time.perf_counter() - generated
        self._scoring.discard(index)
        self.timings[index] = GroupTiming(admitted=admitted, generated=generated, reward_s=reward_s, nonfinite=nonfinite, timed_out=timed_out)
        self.buffer.put(index, group)


def generation_rounds(first_step: int, max_steps: int, steps_per_generation: int) -> list[int]:
    """Steps per generation round from `first_step` to `max_steps`; rounds start at multiples of
    steps_per_generation (so a run resumed mid-round finishes that round first).

    Example: generation_rounds(3, 10, 4) -> [1, 4, 2] (steps 3 | 4-7 | 8-9)
    """
    rounds, step = [], first_step
    while step < max_steps:
        end = min(max_steps, (step // steps_per_generation + 1) * steps_per_generation)
        rounds.append(end - step)
        step = end
    return rounds


def group_seed(seed: int, step: int) -> int:
    """Seed of rollout 0 of the first group of `step`; rollout g of group p samples with + p * G + g."""
    return (seed * 1_000_003 + step) * 100_003


async def score_groups(
    groups: list[Group],
    funcs: list[RewardFunc],
    weights: list[float] | None,
    state: TrainerState | None = None,
    *,
    nonfinite: str = "error",
    timeout_s: float | None = None,
) -> int:
    """Writes each rollout's `rewards` and weighted `reward` (reward functions see whole batches).
    With nonfinite="skip", a group with a non-finite reward is marked failed; returns how many were."""
    rollouts = [r for g in groups for r in g.rollouts]
    if not rollouts:
        return 0
    columns = {key: [r.example.columns[key] for r in rollouts] for key in rollouts[0].example.columns}
    prompts = [r.example.prompt for r in rollouts]
    completions = [conversation_of(r) for r in rollouts]
    ids = [[t for t, m in zip(r.trace.token_ids, r.trace.loss_mask) if m] for r in rollouts]
    logs = RewardLogs()
    totals, values = await score(
        funcs, weights, prompts, completions, columns, completion_ids=ids, trainer_state=state, nonfinite=nonfinite, timeout_s=timeout_s,
        logs=logs,
    )  # fmt: skip
    for i, rollout in enumerate(rollouts):
        rollout.reward = totals[i]
        rollout.rewards = {name: v[i] for name, v in values.items()}
        rollout.extra = {column: v[i] for column, v in logs.extra.items()}
    for group in groups:  # a call scoring several groups (a refill, evaluation) gives each its means
        group.logged = {name: sum(v) / len(v) for name, v in logs.metrics.items()}
    poisoned = [g for g in groups if any(r.reward is not None and math.isnan(r.reward) for r in g.rollouts)]
    mark_failed(poisoned)
    return len(poisoned)


async def score_or_drop(groups: list[Group], parts: LoopParts, settings: LoopSettings, state: TrainerState, what: str) -> tuple[int, bool]:
    """score_groups with the run's --reward_nonfinite and --reward_timeout_s; past the deadline the groups are
    marked failed (not trained, not counted; the run goes on) with a warning that ends in `what`. Returns (how
    many groups a non-finite reward dropped, whether the deadline passed)."""
    try:
        num_nonfinite = await score_groups(
            groups, parts.reward_funcs, parts.reward_weights, state, nonfinite=settings.reward_nonfinite, timeout_s=settings.reward_timeout_s
        )  # fmt: skip
    except RewardTimeoutError as error:
        log.warning("%s; %s", error, what)
        mark_failed(groups)
        return 0, True
    return num_nonfinite, False


def mark_failed(groups: list[Group]) -> None:
    for group in groups:
        for rollout in group.rollouts:
            rollout.status = RolloutStatus.ERROR


def reward_matrix(groups: list[Group]) -> torch.Tensor:
    """[P, G] float64 rewards, NaN where a rollout is unscorable (every reward function returned None)."""
    return torch.tensor([[math.nan if x is None else x for x in g.rewards] for g in groups], dtype=torch.float64)


def terminated_lengths(rollouts: list) -> dict[str, float]:
    """TRL's completions/{mean,min,max}_terminated_length: sampled tokens of the completions that ended by
    themselves (not cut at --max_completion_length); 0 when none did, as TRL.

    Example: lengths [3, 8, 5], finish reasons [stop, length, stop] -> mean 4.0, min 3.0, max 5.0
    """
    lengths = [float(r.trace.num_sampled) for r in rollouts if r.finish_reason != "length"] or [0.0]
    return {
        "completions/mean_terminated_length": sum(lengths) / len(lengths),
        "completions/min_terminated_length": min(lengths),
        "completions/max_terminated_length": max(lengths),
    }


def reward_metrics(groups: list[Group]) -> dict[str, float]:
    """TRL/ms-swift names: reward, reward_std (std of all rewards), rewards/<fn>/*, completions/*; unscorable left out.
    What reward functions logged with log_metric: under its own name, the mean over the groups' scoring (TRL: over
    its generation batches); a name tandem logs itself keeps tandem's value."""
    rewards = reward_matrix(groups)  # [P, G]
    rollouts = [r for g in groups for r in g.rollouts]
    lengths = torch.tensor([r.trace.num_sampled for r in rollouts], dtype=torch.float64)
    logged: dict[str, list[float]] = {}  # log_metric's name -> each group's mean
    for group in groups:
        for name, value in group.logged.items():
            logged.setdefault(name, []).append(value)
    metrics = {
        **{name: sum(values) / len(values) for name, values in logged.items()},
        "reward": float(rewards.nanmean()),
        "reward_std": float(nan_std(rewards.flatten(), dim=0)),  # TRL: Bessel-corrected std of all the step's rewards
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
        **terminated_lengths(rollouts),
    }
    for name in rollouts[0].rewards:
        values = torch.tensor([r.rewards[name] for r in rollouts if r.rewards[name] is not None], dtype=torch.float64)
        if values.numel():
            metrics[f"rewards/{name}/mean"] = float(values.mean())
            metrics[f"rewards/{name}/std"] = float(nan_std(values, dim=0))  # Bessel-corrected, as TRL
    return metrics
