"""The RL loop's settings, resolved once from the leaf configs (config.py's TrainConfig.resolve()) and read
by the loop, the producer and evaluation. Pure data: no torch, so a Plan holding it is built on any machine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class LoopSettings:
    """The loop's knobs. Written by `TrainConfig.resolve()` (and by tests and benches directly)."""

    max_steps: int
    num_prompts_per_step: int
    num_generations: int
    scale_rewards: str
    drop_zero_variance_groups: bool
    max_dynamic_sampling_rounds: int = 3
    seed: int
    sleep_level: int
    log_completions_steps: int
    save_steps: float  # below 1: TRL's ratio of max_steps (types.every_steps)
    save_total_limit: int
    reward_nonfinite: str = "error"
    reward_timeout_s: float | None = None
    max_staleness: int = 0
    steps_per_generation: int = 1
    logprob_mismatch_warning: float = 0.0
    save_merged: bool = False  # LoRA: checkpoints hold the merged model too
    planned_peaks_gib: dict[str, float] | None = None  # the memory plan's peak of each phase (memory.py), logged beside the measured
    num_tokens_seen: int = 0  # TRL's num_tokens (prompt + completion tokens trained on) before the first step: a resumed run's

    @property
    def max_policy_lag(self) -> int:
        """S + K - 1: a round may start S steps early, and its last step trains K - 1 versions after it."""
        return self.max_staleness + self.steps_per_generation - 1

    @property
    def refills(self) -> bool:
        """Dynamic sampling refills a step's batch with more prompts only when the step waits for its own
        groups: synchronous (S = 0) and one step per round (K = 1)."""
        return self.drop_zero_variance_groups and self.max_staleness == 0 and self.steps_per_generation == 1
