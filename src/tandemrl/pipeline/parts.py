"""What the RL loop drives: the parts cli/ builds, and the eval set. The shared nouns of loop, producer and
evaluate, in a module of their own so none of those three imports another to learn them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandemrl.data.cursor import PromptCursor
from tandemrl.generation.base import Generator
from tandemrl.logging.metrics import MetricsLogger
from tandemrl.logging.progress import Progress
from tandemrl.rewards.base import RewardFunc
from tandemrl.rollout.run import MultiTurn
from tandemrl.train.distributed import SINGLE, DataParallel
from tandemrl.train.trainer import Trainer
from tandemrl.types import Example, SamplingParams, every_steps
from tandemrl.weights.base import WeightSync


@dataclass(kw_only=True)
class EvalSet:
    """The eval prompts and how often and how widely they are sampled (from DataConfig)."""

    examples: list[Example]
    prompt_ids: list[list[int]]  # [num_examples][prompt tokens]
    eval_steps: float  # below 1: TRL's ratio of the run's steps
    num_generations: int

    def due(self, step: int, max_steps: int) -> bool:
        """Every eval_steps steps, and after the last (TRL evaluates on its eval_steps schedule)."""
        every = every_steps(self.eval_steps, max_steps)
        return bool(self.examples) and every > 0 and (step % every == 0 or step == max_steps)


@dataclass(kw_only=True)
class LoopParts:
    """What the loop drives; built by cli/ from the run's Plan (each part from its own leaf config)."""

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
    flags: dict[str, Any] | None = None  # the run's flags (its config.yaml), kept in each checkpoint for --resume to check
