"""Evaluation, as TRL's: every --eval_steps, the eval prompts are sampled and scored, nothing is trained.

The metrics are the training ones with TRL's `eval_` prefix (`eval_reward`, `eval_rewards/<fn>/mean`,
...) and go to the same sinks at the step they follow. Invariant: evaluation draws no prompt from the
training cursor and trains nothing, so a run with evaluation trains exactly as the run without.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandemrl.pipeline.producer import score_groups
from tandemrl.rollout.group import failed, play_group
from tandemrl.types import Example

if TYPE_CHECKING:
    from tandemrl.pipeline.loop import LoopParts

EVAL_SEED_OFFSET = 7_777_777  # eval samples with seeds apart from every training step's


@dataclass(kw_only=True)
class EvalSet:
    """The eval prompts and how often and how widely they are sampled (from DataConfig)."""

    examples: list[Example]
    prompt_ids: list[list[int]]  # [num_examples][prompt tokens]
    eval_steps: int
    num_generations: int

    def due(self, step: int, max_steps: int) -> bool:
        """Every eval_steps steps, and after the last (TRL evaluates on its eval_steps schedule)."""
        return bool(self.examples) and self.eval_steps > 0 and (step % self.eval_steps == 0 or step == max_steps)


async def evaluate(parts: LoopParts, evals: EvalSet, step: int, *, seed: int) -> dict[str, float]:
    """eval_* metrics of every eval prompt, num_generations completions each, at the current weights."""
    from tandemrl.pipeline.loop import reward_metrics  # the loop imports this module

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
