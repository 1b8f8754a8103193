"""Evaluation, as TRL's: every --eval_steps, the eval prompts are sampled and scored, nothing is trained.

The metrics are the training ones with TRL's `eval_` prefix (`eval_reward`, `eval_rewards/<fn>/mean`,
...) and go to the same sinks at the step they follow. Invariant: evaluation draws no prompt from the
training cursor and trains nothing, so a run with evaluation trains exactly as the run without.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tandemrl.pipeline.parts import EvalSet, LoopParts
from tandemrl.pipeline.producer import reward_metrics, score_groups
from tandemrl.rollout.group import failed, play_group

EVAL_SEED_OFFSET = 7_777_777  # eval samples with seeds apart from every training step's


async def evaluate(parts: LoopParts, evals: EvalSet, step: int, *, seed: int) -> dict[str, float]:
    """eval_* metrics of every eval prompt, num_generations completions each, at the current weights."""
    g = evals.num_generations
    groups = await asyncio.gather(*(
        play_group(
            example, ids, generator=parts.generator, params=parts.params, group_size=g, tokenizer=parts.tokenizer,
            seed=(seed + EVAL_SEED_OFFSET + step) * 100_003 + i * g, multi_turn=parts.multi_turn,
        )
        for i, (example, ids) in enumerate(zip(evals.examples, evals.prompt_ids))
    ))  # fmt: skip
    ok = [group for group in groups if not failed(group)]
    await score_groups(ok, parts.reward_funcs, parts.reward_weights)
    metrics: dict[str, Any] = reward_metrics(ok) if ok else {}
    metrics["failed_groups"] = float(len(groups) - len(ok))
    return {f"eval_{name}": value for name, value in metrics.items()}
