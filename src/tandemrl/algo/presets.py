"""Paper names as presets: the algorithm config (CLI flags, TRL names) and the loss shape it picks.

`AlgoConfig` is the leaf config a user sets; `loss_config` turns it into the frozen `LossConfig` the loss
reads, so the loss never re-checks a user-facing string.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

Aggregation = Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"]
RatioLevel = Literal["token", "sequence"]
LossType = Literal["grpo", "dapo", "dr_grpo", "gspo"]
RewardScale = Literal["group", "batch", "none"]


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The shape of the clipped surrogate: clip range, how token losses aggregate, ratio level.

    aggregation: "seq_mean_token_mean" = mean over sequences of each sequence's token mean (GRPO);
    "token_mean" = mean over all trained tokens of the step (DAPO); "seq_mean_token_sum_norm" = token
    sum divided by num_sequences * max_completion_length (Dr. GRPO). ratio_level "sequence" = GSPO.
    """

    clip_low: float
    clip_high: float
    aggregation: Aggregation
    ratio_level: RatioLevel = "token"

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low (--epsilon) must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"clip_high (--epsilon_high) must be >= 0, got {self.clip_high}")
        if self.aggregation not in ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"):
            raise ValueError(f"unknown aggregation {self.aggregation!r}")
        if self.ratio_level not in ("token", "sequence"):
            raise ValueError(f"ratio_level must be 'token' or 'sequence', got {self.ratio_level!r}")


# GRPO: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300).
GRPO = LossConfig(clip_low=0.2, clip_high=0.2, aggregation="seq_mean_token_mean", ratio_level="token")
# DAPO: Yu et al. 2025 (arXiv:2503.14476): clip-higher and token-level loss.
DAPO = LossConfig(clip_low=0.2, clip_high=0.28, aggregation="token_mean", ratio_level="token")
# Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv:2503.20783).
DR_GRPO = LossConfig(clip_low=0.2, clip_high=0.2, aggregation="seq_mean_token_sum_norm", ratio_level="token")
# GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071).
GSPO = LossConfig(clip_low=3e-4, clip_high=4e-4, aggregation="seq_mean_token_mean", ratio_level="sequence")

PRESETS: dict[str, LossConfig] = {"grpo": GRPO, "dapo": DAPO, "dr_grpo": DR_GRPO, "gspo": GSPO}


@dataclass(kw_only=True)
class AlgoConfig:
    """The RL algorithm: which paper's loss, its clip range, KL, reward scaling and masking (TRL names)."""

    loss_type: LossType = "grpo"
    """Loss preset: grpo, dapo (clip-higher, token mean), dr_grpo (no std scaling of the length), gspo
    (sequence-level ratio)."""
    epsilon: float | None = None
    """Lower clip range of the ratio (None = the preset's: 0.2, or 3e-4 for gspo)."""
    epsilon_high: float | None = None
    """Upper clip range of the ratio (None = the preset's; for symmetric presets, --epsilon if set)."""
    beta: float = 0.0
    """KL coefficient to the frozen reference policy (k3 estimator); 0 = no reference model."""
    scale_rewards: RewardScale = "group"
    """Advantage scaling: group (divide by the group's reward std), batch (the batch's std), none."""
    num_iterations: int = 1
    """Optimizer passes over each batch of rollouts (PPO epochs; mu in the GRPO paper)."""
    mask_truncated_completions: bool = False
    """Exclude completions cut at --max_completion_length from the loss (DAPO overlong filtering)."""
    drop_zero_variance_groups: bool = True
    """Drop groups whose rewards are all equal: their advantages are zero (DAPO dynamic sampling)."""
    tis_cap: float = 2.0
    """Cap of the truncated importance weight trainer/sampler: per token, or per sequence (the sequence's
    likelihood ratio, as TRL's sequence_truncate) for gspo; 0 = off."""
    max_completion_length: int = 256
    """Most tokens sampled per completion; also the constant normaliser of dr_grpo."""

    def __post_init__(self) -> None:
        if self.loss_type not in PRESETS:
            raise ValueError(f"--loss_type must be one of {', '.join(PRESETS)}, got {self.loss_type!r}")
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(f"--scale_rewards must be group, batch or none, got {self.scale_rewards!r}")
        if self.epsilon is not None and not 0 <= self.epsilon < 1:
            raise ValueError(f"--epsilon must be in [0, 1), got {self.epsilon}")
        if self.epsilon_high is not None and self.epsilon_high < 0:
            raise ValueError(f"--epsilon_high must be >= 0, got {self.epsilon_high}")
        if self.beta < 0:
            raise ValueError(f"--beta must be >= 0 (0 disables the KL term), got {self.beta}")
        if self.num_iterations < 1:
            raise ValueError(f"--num_iterations must be >= 1, got {self.num_iterations}")
        if self.tis_cap != 0 and self.tis_cap < 1:
            raise ValueError(f"--tis_cap must be 0 (off) or >= 1, got {self.tis_cap}")
        if self.max_completion_length < 1:
            raise ValueError(f"--max_completion_length must be >= 1, got {self.max_completion_length}")


def loss_config(config: AlgoConfig) -> LossConfig:
    """The preset of `config.loss_type` with --epsilon / --epsilon_high applied.

    A symmetric preset (GRPO, Dr. GRPO) stays symmetric when only --epsilon is given, as in TRL; an
    asymmetric one (DAPO, GSPO) keeps its own upper clip.
    Example: AlgoConfig(loss_type="grpo", epsilon=0.1) -> clip_low=0.1, clip_high=0.1
    """
    preset = PRESETS[config.loss_type]
    clip_low = preset.clip_low if config.epsilon is None else config.epsilon
    clip_high = config.epsilon_high
    if clip_high is None:
        clip_high = clip_low if preset.clip_low == preset.clip_high else preset.clip_high
    return dataclasses.replace(preset, clip_low=clip_low, clip_high=clip_high)
