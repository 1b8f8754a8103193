"""Evaluation, as TRL's: every --eval_steps, the eval prompts are sampled and scored, nothing is trained.

The metrics are the training ones with TRL's `eval_` prefix (`eval_reward`, `eval_rewards/<fn>/mean`,
...) and go to the same sinks at the step they follow. Invariant: evaluation draws no prompt from the
training cursor and trains nothing, so a run with evaluation trains exactly as the run without.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tandemrl.pipeline.parts import EvalSet, LoopParts
from tandemrl.pipeline.producer import reward_metrics, score_or_drop
from tandemrl.pipeline.settings import LoopSettings
from tandemrl.rewards.base import TrainerState
from tandemrl.rollout.group import failed, play_group

EVAL_SEED_OFFSET = 7_777_777  # eval samples with seeds apart from every training step's


async def evaluate(parts: LoopParts, evals: EvalSet, step: int, *, settings: LoopSettings) -> dict[str, float]:
    """eval_* metrics of every eval prompt, num_generations completions each, at the current weights (`step`
    optimizer steps done). Rewards are called as in training: the run's trainer_state, --reward_timeout_s
    (past it the groups count as failed) and --reward_nonfinite."""
    seed = settings.seed
    g = evals.num_generations
    groups = await asyncio.gather(*(
        play_group(
            example, ids, generator=parts.generator, params=parts.params, group_size=g, tokenizer=parts.tokenizer,
            seed=(seed + EVAL_SEED_OFFSET + step) * 100_003 + i * g, multi_turn=parts.multi_turn,
        )
        for i, (example, ids) in enumerate(zip(evals.examples, evals.prompt_ids))
    ))  # fmt: skip
    ok = [group for group in groups if not failed(group)]
    state = TrainerState(global_step=step, epoch=parts.cursor.num_taken / parts.cursor.num_examples, max_steps=settings.max_steps)
    await score_or_drop(ok, parts, settings, state, f"the evaluation at step {step} is not scored")
    ok = [group for group in ok if not failed(group)]  # scoring may have dropped some (timeout, non-finite)
    metrics: dict[str, Any] = reward_metrics(ok) if ok else {}
    metrics["failed_groups"] = float(len(groups) - len(ok))
    return {f"eval_{name}": value for name, value in metrics.items()}
