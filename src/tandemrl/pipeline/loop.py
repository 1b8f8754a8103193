"""The RL loop: take -> train -> publish -> release -> log, one optimizer step per turn, while the
producer (pipeline/producer.py) generates and scores groups for the next steps into the rollout buffer.

Groups are generated in rounds of K = --steps_per_generation steps (TRL's generation batch: K x P
groups sampled by one policy version, scored together, then trained P a step over K optimizer steps).
Invariants: every trained token was sampled by a policy at most S + K - 1 versions behind the weights
it trains (pipeline/buffer.py says why; asserted each step), and S = 0, K = 1 is synchronous, on-policy
GRPO through the same code. The data cursor is saved at the groups actually trained, not those
admitted, so a resumed run regenerates the groups that were in flight (the rest of a round, too): no
prompt is skipped or repeated. Under torchrun each rank generates and scores the groups it owns
(train/distributed.py); a round's groups are gathered on every rank before advantages, so every rank
sees the same batch.

Legend: P groups per step, G group size, S max staleness, K steps per generation round.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandemrl.algo.advantage import group_relative_advantages, nan_std, zero_variance_groups
from tandemrl.data.cursor import PromptCursor
from tandemrl.generation.base import Generator
from tandemrl.logging.console import readable_text
from tandemrl.logging.metrics import MetricsLogger
from tandemrl.logging.progress import Progress
from tandemrl.pipeline.buffer import RolloutBuffer
from tandemrl.pipeline.evaluate import EvalSet, evaluate
from tandemrl.pipeline.producer import Producer, generation_rounds, group_seed, mark_failed, score_groups
from tandemrl.rewards.base import RewardFunc, RewardTimeoutError, TrainerState
from tandemrl.rollout.group import failed, play_group, turn_metrics
from tandemrl.rollout.run import MultiTurn, completion_text
from tandemrl.train.checkpoint import save_checkpoint
from tandemrl.train.distributed import SINGLE, DataParallel
from tandemrl.train.trainer import Trainer
from tandemrl.types import Batch, Example, Group, RunStopped, SamplingParams
from tandemrl.weights.base import WeightSync

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class LoopSettings:
    """The loop's knobs, resolved from the leaf configs by cli/."""

    max_steps: int
    num_prompts_per_step: int
    num_generations: int
    scale_rewards: str
    drop_zero_variance_groups: bool
    max_dynamic_sampling_rounds: int = 3
    seed: int
    sleep_level: int
    log_completions_steps: int
    save_steps: int
    save_total_limit: int
    reward_nonfinite: str = "error"
    reward_timeout_s: float | None = None
    max_staleness: int = 0
    steps_per_generation: int = 1
    logprob_mismatch_warning: float = 0.0
    save_merged: bool = False  # LoRA: checkpoints hold the merged model too

    @property
    def max_policy_lag(self) -> int:
        """S + K - 1: a round may start S steps early, and its last step trains K - 1 versions after it."""
        return self.max_staleness + self.steps_per_generation - 1


@dataclass(kw_only=True)
class LoopParts:
    """What the loop drives; built by cli/ (each part from its own leaf config)."""

    examples: list[Example]
    prompt_ids: list[list[int]]  # [num_examples][prompt tokens]
    cursor: PromptCursor
    generator: Generator
    sync: WeightSync
    trainer: Trainer
    tokenizer: Any
    reward_funcs: list[RewardFunc]
    reward_weights: list[float] | None
    params: SamplingParams
    logger: MetricsLogger
    progress: Progress
    run_dir: Path
    multi_turn: MultiTurn | None = None  # tools: rollouts play turns until the model stops calling them
    evals: EvalSet | None = None
    dp: DataParallel = SINGLE  # under torchrun: which groups this rank generates and trains


async def run_loop(parts: LoopParts, settings: LoopSettings, *, start_step: int = 0) -> dict[str, float]:
    """Trains from `start_step` to `settings.max_steps`; returns the last step's metrics."""
    p = settings.num_prompts_per_step
    rounds = generation_rounds(start_step, settings.max_steps, settings.steps_per_generation)
    buffer = RolloutBuffer(lead=settings.max_staleness * p, first_index=start_step * p)
    first_taken = parts.cursor.num_taken  # the cursor of the groups trained so far (the checkpoint's)
    producer = Producer(parts, settings, buffer, rounds=rounds)
    await asyncio.to_thread(parts.trainer.offload.optimizer_to_cpu)  # the weights were published: generation comes first
    await asyncio.to_thread(parts.trainer.offload.model_to_cpu)
    producer.start()
    metrics: dict[str, float] = {}
    refill = settings.drop_zero_variance_groups and settings.max_staleness == 0 and settings.steps_per_generation == 1
    if settings.drop_zero_variance_groups and not refill:
        log.warning(
            "zero-variance groups are dropped but the batch is not refilled (dynamic sampling needs --max_staleness 0 and --steps_per_generation 1)"
        )
    num_refilled = 0  # prompts taken by dynamic sampling's extra rounds, beyond the producer's P a step
    steps: list[list[Group]] = []  # the groups of the current round's steps not trained yet
    sizes = iter(rounds)
    try:
        for step in range(start_step, settings.max_steps):
            started = time.perf_counter()
            parts.progress.phase("generate")
            if not steps:  # a round's first step: all its groups, generated by one policy version (TRL's generation batch)
                num_steps = next(sizes)
                round_groups, times = await _take_round(parts, producer, buffer, step, first=step * p, num_groups=num_steps * p)
                if refill:  # S = 0: the producer waits for this step's release, so the extra rounds take the next prompts
                    taken = parts.cursor.num_taken
                    round_groups, times = await _refill(parts, settings, step, round_groups, times)
                    num_refilled += parts.cursor.num_taken - taken
                # P groups a step, in admission order; the last step takes the rest (dynamic sampling's refills)
                steps = [round_groups[i * p : (i + 1) * p] for i in range(num_steps - 1)] + [round_groups[(num_steps - 1) * p :]]
            else:  # the round's generation and scoring were logged at its first step
                times = dict.fromkeys(times, 0.0)
            waited = time.perf_counter() - started
            groups = steps.pop(0)
            batch, group_metrics = _batch(groups, settings, parts.trainer.policy_version, round_groups=round_groups)
            metrics = {**group_metrics, **times, "pipeline/wait_time": waited, **await _train_and_publish(parts, settings, batch)}
            _check_mismatch(metrics, settings.logprob_mismatch_warning, step + 1)
            buffer.release(p)  # the weights trained on these groups are live: admit the next ones
            metrics["pipeline/queue_depth"] = float(buffer.num_ready)
            metrics["step_time"] = time.perf_counter() - started
            if parts.evals is not None and parts.evals.due(step + 1, settings.max_steps) and parts.dp.is_main:
                metrics.update(await evaluate(parts, parts.evals, step + 1, seed=settings.seed))
            parts.logger.log(step + 1, metrics)
            parts.progress.update(step + 1, metrics)
            _maybe_log_completions(parts, settings, step + 1, groups)
            if _should_save(settings, step + 1):
                parts.progress.phase("save")
                _save(parts, settings, step + 1, num_taken=first_taken + (step + 1 - start_step) * p + num_refilled)
    finally:
        await producer.cancel()
    return metrics


async def _take_round(
    parts: LoopParts, producer: Producer, buffer: RolloutBuffer, step: int, *, first: int, num_groups: int
) -> tuple[list[Group], dict[str, float]]:
    """A round's groups (admissions first .. first + num_groups - 1) once all are generated and scored
    (by every rank), and the time this rank's took to generate and score."""
    groups = await _gathered(parts, await buffer.take(num_groups))
    if all(g.error for g in groups):  # the generator is broken (a server died or froze): stop, do not train on nothing
        raise RunStopped(f"step {step + 1}: every rollout group failed, the first with {groups[0].error}")
    return groups, producer.step_times(range(first, first + num_groups))


async def _refill(
    parts: LoopParts, settings: LoopSettings, step: int, groups: list[Group], times: dict[str, float]
) -> tuple[list[Group], dict[str, float]]:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): sample more prompts, P at a time, until
    P groups with reward variance are in hand or --max_dynamic_sampling_rounds extra rounds are spent."""
    rounds = 0
    while _num_informative(groups) < settings.num_prompts_per_step and rounds < settings.max_dynamic_sampling_rounds:
        rounds += 1
        more, more_times = await _generate_and_score(parts, settings, step, round_=rounds)
        groups = groups + more
        times = {key: times[key] + more_times[key] for key in times}
    times["dynamic_sampling/rounds"] = float(rounds)
    times["dynamic_sampling/num_groups_sampled"] = float(len(groups))
    return groups, times


async def _gathered(parts: LoopParts, groups: list[Group | None]) -> list[Group]:
    """Under torchrun, every rank's groups of the step (in a thread: other ranks may still be generating)."""
    return await asyncio.to_thread(parts.dp.gather_groups, groups) if parts.dp.enabled else groups


def _num_informative(groups: list[Group]) -> int:
    """Groups that will train: generated, scored, rewards not all equal."""
    ok = [g for g in groups if not failed(g)]
    return int((~zero_variance_groups(reward_matrix(ok))).sum()) if ok else 0


async def _generate_and_score(
    parts: LoopParts, settings: LoopSettings, step: int, *, round_: int
) -> tuple[list[Group], dict[str, float]]:
    """One extra round of dynamic sampling: the cursor's next P prompts, seeds after the step's own groups."""
    t0 = time.perf_counter()
    parts.progress.phase("generate")
    indices = parts.cursor.take(settings.num_prompts_per_step)
    seed0 = group_seed(settings.seed, step) + round_ * settings.num_prompts_per_step * settings.num_generations
    groups = await asyncio.gather(*(
        play_group(
            parts.examples[i], parts.prompt_ids[i], generator=parts.generator, params=parts.params,
            group_size=settings.num_generations, tokenizer=parts.tokenizer, seed=seed0 + p * settings.num_generations,
            multi_turn=parts.multi_turn,
        )
        for p, i in enumerate(indices) if parts.dp.owns(p)
    ))  # fmt: skip
    t1 = time.perf_counter()
    parts.progress.phase("reward")
    scored = [g for g in groups if not failed(g)]
    num_timeouts = 0
    state = TrainerState(global_step=step, epoch=parts.cursor.num_taken / parts.cursor.num_examples, max_steps=settings.max_steps)
    try:
        num_nonfinite = await score_groups(
            scored, parts.reward_funcs, parts.reward_weights, state, nonfinite=settings.reward_nonfinite, timeout_s=settings.reward_timeout_s
        )
    except RewardTimeoutError as error:  # its groups are not trained; the run goes on
        log.warning("%s; the %d groups it was scoring are not trained", error, len(scored))
        mark_failed(scored)
        num_nonfinite, num_timeouts = 0, 1
    times = {"time/generate": t1 - t0, "time/reward": time.perf_counter() - t1}
    mine = iter(groups)
    groups = await _gathered(parts, [next(mine) if parts.dp.owns(p) else None for p in range(len(indices))])
    if all(g.error for g in groups):  # the generator is broken (a server died or froze): every rank stops here
        raise RunStopped(f"step {step + 1}: every rollout group failed, the first with {groups[0].error}")
    return groups, {**times, "rollout/nonfinite_reward_groups": float(num_nonfinite), "rollout/reward_timeouts": float(num_timeouts)}


def _batch(
    groups: list[Group], settings: LoopSettings, version: int, *, round_groups: list[Group] | None = None
) -> tuple[Batch, dict[str, float]]:
    """Group-relative advantages; groups with zero reward variance are dropped when asked (DAPO).

    `round_groups` (default `groups`) are the groups generated together, whose rewards the advantages
    of --scale_rewards batch are scaled by (TRL's generation batch); `groups` are among them."""
    ok = [g for g in groups if not failed(g)]
    metrics = {"rollout/failed_groups": float(len(groups) - len(ok))}
    if not ok:
        return Batch(groups=[], policy_version=version), metrics
    baseline = [g for g in (round_groups or groups) if not failed(g)]
    advantages = group_relative_advantages(reward_matrix(baseline), scale=settings.scale_rewards).tolist()  # [R, G]
    row = {id(b): i for i, b in enumerate(baseline)}
    for g in ok:
        g.advantages = advantages[row[id(g)]]
    rewards = reward_matrix(ok)  # [P, G]
    flat = zero_variance_groups(rewards)  # [P]
    metrics.update(reward_metrics(ok))
    metrics.update(turn_metrics(ok))
    metrics["frac_reward_zero_std"] = frac_zero_std(rewards, flat, settings.scale_rewards)
    metrics["rewards/num_unscorable"] = float(rewards.isnan().sum())
    lags = policy_lags(ok, version)  # [trained tokens]
    bound = settings.max_policy_lag
    assert max(lags, default=0) <= bound, f"policy lag {max(lags)} > --max_staleness + --steps_per_generation - 1 = {bound}"
    metrics["rollout/policy_lag_mean"] = sum(lags) / max(len(lags), 1)
    metrics["rollout/policy_lag_max"] = float(max(lags, default=0))
    trained = [g for g, f in zip(ok, flat.tolist()) if not (f and settings.drop_zero_variance_groups)]
    # dynamic sampling may hold more informative groups than a step trains: the first P, in sampling order
    return Batch(groups=trained[: settings.num_prompts_per_step], policy_version=version), metrics


def frac_zero_std(rewards: torch.Tensor, flat: torch.Tensor, scale: str) -> float:
    """TRL's frac_reward_zero_std: the fraction of rollouts whose scaling std is 0, so it follows
    --scale_rewards: the group's std (group, none) or the batch's (batch: 0.0 or 1.0)."""
    if scale == "batch":
        std = nan_std(rewards.flatten(), dim=0)
        return float(torch.isclose(std, torch.zeros_like(std)).all())
    return float(flat.double().mean())


def reward_matrix(groups: list[Group]) -> torch.Tensor:
    """[P, G] float64 rewards, NaN where a rollout is unscorable (every reward function returned None)."""
    return torch.tensor([[math.nan if x is None else x for x in g.rewards] for g in groups], dtype=torch.float64)


def policy_lags(groups: list[Group], version: int) -> list[int]:
    """Per sampled token, how many versions the trained weights are ahead of those that sampled it.

    With `pause` updates a completion spans versions; each token counts its own, so the max is the
    oldest token's. Example: tokens sampled at versions [3, 4], trained at version 4 -> [1, 0]
    """
    return [version - v for g in groups for r in g.rollouts for v, m in zip(r.trace.policy_versions, r.trace.loss_mask) if m]


def reward_metrics(groups: list[Group]) -> dict[str, float]:
    """TRL/ms-swift names: reward, reward_std (std of all rewards), rewards/<fn>/*, completions/*; unscorable left out."""
    rewards = reward_matrix(groups)  # [P, G]
    rollouts = [r for g in groups for r in g.rollouts]
    lengths = torch.tensor([r.trace.num_sampled for r in rollouts], dtype=torch.float64)
    metrics = {
        "reward": float(rewards.nanmean()),
        "reward_std": float(nan_std(rewards.flatten(), dim=0)),  # TRL: Bessel-corrected std of all the step's rewards
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
    }
    for name in rollouts[0].rewards:
        values = torch.tensor([r.rewards[name] for r in rollouts if r.rewards[name] is not None], dtype=torch.float64)
        if values.numel():
            metrics[f"rewards/{name}/mean"] = float(values.mean())
            metrics[f"rewards/{name}/std"] = float(nan_std(values, dim=0))  # Bessel-corrected, as TRL
    return metrics


async def _train_and_publish(parts: LoopParts, settings: LoopSettings, batch: Batch) -> dict[str, float]:
    """The colocate memory plan around a step: the engine sleeps (KV cache, at level 2 its weights too) and
    the trainer's offloaded state comes back; after training the optimizer state leaves before the engine
    wakes (its KV cache takes the room), and the weights leave once published (level 2 refills from them)."""
    t0 = time.perf_counter()
    parts.progress.phase("train")
    offload = parts.trainer.offload
    if settings.sleep_level:
        await parts.generator.sleep(settings.sleep_level)
    await asyncio.to_thread(offload.to_device)
    version = parts.trainer.policy_version
    train_metrics = await asyncio.to_thread(parts.trainer.train_step, batch) if batch.groups else {}
    await asyncio.to_thread(offload.optimizer_to_cpu)
    t1 = time.perf_counter()
    if settings.sleep_level:
        await parts.generator.wake()
    parts.progress.phase("sync")
    unchanged = parts.trainer.policy_version == version  # every group dropped, or the step skipped: nothing new to push
    if not unchanged or settings.sleep_level == 2:  # level 2 dropped the engine's weights: refill them all the same
        await publish_policy(parts)
    await asyncio.to_thread(offload.model_to_cpu)
    return {**train_metrics, "time/train": t1 - t0, "time/sync": time.perf_counter() - t1, "sync/skipped": float(unchanged)}


async def publish_policy(parts: LoopParts) -> None:
    """The trainer's weights live on the generators at its policy version, or RunStopped saying why."""
    try:
        await parts.sync.publish(parts.trainer.published_weights(), version=parts.trainer.policy_version)
    except (RuntimeError, OSError) as error:  # the generators cannot take it (a server died mid-push)
        raise RunStopped(f"pushing policy version {parts.trainer.policy_version} failed: {error}") from error


def _check_mismatch(metrics: dict[str, float], threshold: float, step: int) -> None:
    """Turns the trainer's lag-0 mismatch sum into a mean over lag-0 tokens; warns past `threshold`.

    At lag 0 trainer and sampler hold the same weights, so a large KL there is a weight-sync bug or a
    numerics problem (lesson 4), not staleness."""
    frac = metrics.pop("train/frac_lag0", 0.0)
    if "train/logprob_mismatch_kl_lag0" not in metrics:
        return
    if not frac:
        del metrics["train/logprob_mismatch_kl_lag0"]
        return
    kl = metrics["train/logprob_mismatch_kl_lag0"] = metrics["train/logprob_mismatch_kl_lag0"] / frac
    if threshold and kl > threshold:
        log.warning(
            "step %d: the sampler's and the trainer's logprobs of the same weights differ (KL %.3g > %g): "
            "check weight sync and dtypes", step, kl, threshold,
        )


def _maybe_log_completions(parts: LoopParts, settings: LoopSettings, step: int, groups: list[Group]) -> None:
    every = settings.log_completions_steps
    if not every or (step % every and step != settings.max_steps):
        return
    rollouts = [r for g in groups[:2] for r in g.rollouts[:2]]
    rows = [{"prompt": str(r.example.prompt), "completion": completion_text(r, parts.tokenizer), "reward": r.reward, **r.rewards} for r in rollouts]
    parts.logger.log_completions(step, rows)
    sampled = [[t for t, m in zip(r.trace.token_ids, r.trace.loss_mask) if m] for r in rollouts]
    shown = [{**row, "completion": readable_text(parts.tokenizer, ids, row["completion"])} for row, ids in zip(rows, sampled)]
    parts.progress.print_completions(step, shown)


def _should_save(settings: LoopSettings, step: int) -> bool:
    return step == settings.max_steps or (settings.save_steps > 0 and step % settings.save_steps == 0)


def _save(parts: LoopParts, settings: LoopSettings, step: int, *, num_taken: int) -> None:
    """The cursor is saved at the groups trained; those admitted beyond are regenerated on resume."""
    with parts.trainer.offload.resident():
        state = {"trainer": parts.trainer.state_dict(), "cursor": parts.cursor.state_dict(num_taken=num_taken)}
        save_checkpoint(
            parts.run_dir, step, model=parts.trainer.model, tokenizer=parts.tokenizer, state=state, limit=settings.save_total_limit,
            save_merged=settings.save_merged, dp=parts.dp, optimizer=parts.trainer.optimizer if parts.dp.enabled else None,
        )  # fmt: skip
