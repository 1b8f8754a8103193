"""Paper names as presets: the algorithm config (CLI flags, TRL names) and the loss shape it picks.

`AlgoConfig` is the leaf config a user sets; `loss_config` turns it into the frozen `LossConfig` the loss
reads, so the loss never re-checks a user-facing string.
"""

from __future__ import annotations

import dataclasses
import math
import logging
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

Aggregation = Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"]
RatioLevel = Literal["token", "sequence"]
LossType = Literal["grpo", "dapo", "dr_grpo", "gspo", "bnpo", "cispo"]
Objective = Literal["clip", "cispo"]
RewardScale = Literal["group", "batch", "none"]
TISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
TIS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The shape of the clipped surrogate: clip range, how token losses aggregate, ratio level.

    aggregation: "seq_mean_token_mean" = mean over sequences of each sequence's token mean (GRPO);
    "token_mean" = mean over all trained tokens of the step (DAPO); "seq_mean_token_sum_norm" = token
    sum divided by num_sequences * max_completion_length (Dr. GRPO). ratio_level "sequence" = GSPO.
    objective "cispo" replaces the clipped ratio by CISPO's detached, capped weight (clip_high is its cap).
    delta caps the ratio of the unclipped term too (two-sided clipping); kl_bias_correction multiplies the
    KL term by the ratio (TRL's use_bias_correction_kl).
    tis_mode / tis_min: how the trainer/sampler importance weight is formed (algo.loss.importance_weights);
    tis_mode None becomes the truncate mode of ratio_level (TRL's pairing: sequence_truncate at sequence level).
    """

    clip_low: float
    clip_high: float
    aggregation: Aggregation
    ratio_level: RatioLevel = "token"
    objective: Objective = "clip"
    delta: float | None = None
    kl_bias_correction: bool = False
    tis_mode: TISMode | None = None
    tis_min: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low (--epsilon) must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"clip_high (--epsilon_high) must be >= 0, got {self.clip_high}")
        if self.aggregation not in ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"):
            raise ValueError(f"unknown aggregation {self.aggregation!r}")
        if self.ratio_level not in ("token", "sequence"):
            raise ValueError(f"ratio_level must be 'token' or 'sequence', got {self.ratio_level!r}")
        if self.delta is not None and self.delta <= 1 + self.clip_high:
            raise ValueError(f"--delta must be > 1 + epsilon_high ({1 + self.clip_high}), got {self.delta}")
        _check_tis(self.tis_mode, self.tis_min)
        if self.tis_mode is None:  # frozen: resolved once here, so every reader sees a concrete mode
            object.__setattr__(self, "tis_mode", f"{self.ratio_level}_truncate")


def _check_tis(tis_mode: str | None, tis_min: float) -> None:
    """--tis_mode is one of TRL's modes (None = the ratio level's truncate mode)."""
    if tis_mode not in (None, *TIS_MODES):
        raise ValueError(f"--tis_mode must be one of {', '.join(TIS_MODES)}, got {tis_mode!r}")
    if not 0 <= tis_min <= 1:
        raise ValueError(f"--tis_min must be in [0, 1], got {tis_min}")


# GRPO: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300).
GRPO = LossConfig(clip_low=0.2, clip_high=0.2, aggregation="seq_mean_token_mean", ratio_level="token")
# DAPO: Yu et al. 2025 (arXiv:2503.14476): clip-higher and token-level loss.
DAPO = LossConfig(clip_low=0.2, clip_high=0.28, aggregation="token_mean", ratio_level="token")
# Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv:2503.20783).
DR_GRPO = LossConfig(clip_low=0.2, clip_high=0.2, aggregation="seq_mean_token_sum_norm", ratio_level="token")
# GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071).
# Its importance weight is sequence_truncate (tis_mode None follows ratio_level): a token-level weight would
# bring token-level weighting back into its sequence-level objective.
GSPO = LossConfig(clip_low=3e-4, clip_high=4e-4, aggregation="seq_mean_token_mean", ratio_level="sequence")

# BNPO: Xiao et al. 2025 (arXiv:2506.02864), TRL's "bnpo": token mean. Our token mean counts the whole
# optimizer step, so it equals TRL's bnpo at one micro-batch (TRL normalises each micro-batch on its own).
BNPO = LossConfig(clip_low=0.2, clip_high=0.2, aggregation="token_mean", ratio_level="token")
# CISPO: MiniMax-M1 (arXiv:2506.13585); cap 5.0 on the detached weight, as ScaleRL (arXiv:2510.13786) recommends.
CISPO = LossConfig(clip_low=0.2, clip_high=5.0, aggregation="token_mean", ratio_level="token", objective="cispo")

PRESETS: dict[str, LossConfig] = {
    "grpo": GRPO, "dapo": DAPO, "dr_grpo": DR_GRPO, "gspo": GSPO, "bnpo": BNPO, "cispo": CISPO,
}
DYNAMIC_SAMPLING = {"dapo"}  # presets that drop zero-variance groups and refill the batch (DAPO's dynamic sampling)


@dataclass(kw_only=True)
class AlgoConfig:
    """The RL algorithm: which paper's loss, its clip range, KL, reward scaling and masking (TRL names)."""

    loss_type: LossType = "grpo"
    """Loss preset: grpo (sequence mean of token means), dapo (clip-higher 0.28, token mean, dynamic
    sampling), dr_grpo (token sum / max_completion_length), gspo (sequence-level ratio, clip 3e-4/4e-4),
    bnpo (token mean), cispo (detached weight capped at --epsilon_high, 5.0, token mean)."""
    importance_sampling_level: RatioLevel | None = None
    """TRL's name: token (a ratio per token) or sequence (GSPO's, one per sequence; truncated IS then
    weights each sequence by its likelihood ratio). None = the preset's (sequence for gspo)."""
    epsilon: float | None = None
    """Lower clip range of the ratio (None = the preset's: 0.2, or 3e-4 for gspo)."""
    epsilon_high: float | None = None
    """Upper clip range of the ratio (None = the preset's; for symmetric presets, --epsilon if set)."""
    beta: float = 0.0
    """KL coefficient to the frozen reference policy (k3 estimator); 0 = no reference model."""
    sync_ref_model: bool = False
    """TRL's name (TR-DPO, arXiv:2404.09656): every --ref_model_sync_steps optimizer steps the reference
    becomes alpha x policy + (1 - alpha) x reference. Needs --beta > 0."""
    ref_model_mixup_alpha: float = 0.6
    """TRL's name: alpha of --sync_ref_model's mix (1.0 = copy the policy)."""
    ref_model_sync_steps: int = 512
    """TRL's name: optimizer steps between --sync_ref_model updates."""
    use_bias_correction_kl: bool = True
    """Multiply the KL term by the importance ratio (TRL's default, DeepSeek-V3.2: the unbiased reverse-KL
    gradient; changes the KL gradient even on-policy). False = plain k3."""
    delta: float | None = None
    """Two-sided clipping (INTELLECT-2): also cap the ratio at delta when the advantage is negative; must
    be > 1 + epsilon_high. None = off."""
    entropy_coef: float = 0.0
    """TRL's name: entropy bonus, the loss minus this times the mean per-token entropy (over the tokens
    --top_entropy_quantile keeps); the same meaning for every loss type. 0 = off."""
    top_entropy_quantile: float = 1.0
    """Train the policy term only on the top this fraction of tokens by entropy (per micro-batch, as TRL;
    0.2 recommended by arXiv:2506.01939); 1.0 = all tokens."""

    scale_rewards: RewardScale = "group"
    """Advantage scaling: group (divide by the group's reward std), batch (the batch's std), none."""
    num_iterations: int = 1
    """Optimizer passes over each batch of rollouts (PPO epochs; mu in the GRPO paper)."""
    mask_truncated_completions: bool = False
    """Exclude completions cut at --max_completion_length from the loss (DAPO overlong filtering)."""
    drop_zero_variance_groups: bool | None = None
    """Drop groups whose rewards are all equal (zero advantage) and refill the batch to
    --num_prompts_per_step groups by sampling more prompts (DAPO's dynamic sampling). None = the preset's:
    on for dapo, off otherwise (as TRL, which never drops)."""
    max_dynamic_sampling_rounds: int = 3
    """Dynamic sampling: at most this many extra rounds of --num_prompts_per_step prompts to refill a batch;
    a batch still short after them trains on the groups it has (dynamic_sampling/rounds is logged)."""
    tis_cap: float = 2.0
    """Cap of the importance weight trainer/sampler (it corrects sampler mismatch and policy lag); 0 = off."""
    tis_mode: TISMode | None = None
    """How that weight is formed (TRL's modes): token_truncate, token_mask, sequence_truncate or
    sequence_mask (sequence_* = the product over the completion; *_mask = 0 outside [--tis_min, --tis_cap]).
    None = the truncate mode of the ratio's level: sequence_truncate for gspo or
    --importance_sampling_level sequence (as TRL), token_truncate otherwise."""
    tis_min: float = 0.0
    """Lower bound of that weight (TRL's vllm_importance_sampling_clip_min): *_truncate modes raise weights
    below it to it, *_mask modes zero them. 0 = none."""
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
        if not 0 <= self.beta < math.inf:  # NaN fails too: it passed, and the first step's loss was NaN
            raise ValueError(f"--beta must be a finite number >= 0 (0 disables the KL term), got {self.beta}")
        if self.num_iterations < 1:
            raise ValueError(f"--num_iterations must be >= 1, got {self.num_iterations}")
        if self.tis_cap != 0 and self.tis_cap < 1:
            raise ValueError(f"--tis_cap must be 0 (off) or >= 1, got {self.tis_cap}")
        if self.max_completion_length < 1:
            raise ValueError(f"--max_completion_length must be >= 1, got {self.max_completion_length}")
        if self.importance_sampling_level not in (None, "token", "sequence"):
            raise ValueError(f"--importance_sampling_level must be token or sequence, got {self.importance_sampling_level!r}")
        if self.sync_ref_model and self.beta == 0:
            raise ValueError("--sync_ref_model needs a reference model: set --beta > 0 too")
        if not 0 < self.ref_model_mixup_alpha <= 1 or self.ref_model_sync_steps < 1:
            raise ValueError("--ref_model_mixup_alpha must be in (0, 1] and --ref_model_sync_steps >= 1")
        if self.max_dynamic_sampling_rounds < 0:
            raise ValueError(f"--max_dynamic_sampling_rounds must be >= 0, got {self.max_dynamic_sampling_rounds}")
        if not 0 <= self.top_entropy_quantile <= 1:
            raise ValueError(f"--top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}")
        _check_tis(self.tis_mode, self.tis_min)

    @property
    def dynamic_sampling(self) -> bool:
        """Whether zero-variance groups are dropped and the batch refilled (the preset's unless set)."""
        if self.drop_zero_variance_groups is None:
            return self.loss_type in DYNAMIC_SAMPLING
        return self.drop_zero_variance_groups


def loss_config(config: AlgoConfig) -> LossConfig:
    """The preset of `config.loss_type` with --epsilon / --epsilon_high and the other loss flags applied.

    A symmetric preset (GRPO, Dr. GRPO) stays symmetric when only --epsilon is given, as in TRL; an
    asymmetric one (DAPO, GSPO) keeps its own upper clip, with a warning, as when only --epsilon_high is
    given and the lower clip stays the preset's.
    Example: AlgoConfig(loss_type="grpo", epsilon=0.1) -> clip_low=0.1, clip_high=0.1
    """
    preset = PRESETS[config.loss_type]
    clip_low = preset.clip_low if config.epsilon is None else config.epsilon
    clip_high = config.epsilon_high
    if clip_high is None:
        clip_high = clip_low if preset.clip_low == preset.clip_high else preset.clip_high
    _warn_half_override(config, preset, clip_low, clip_high)
    ratio_level = config.importance_sampling_level or preset.ratio_level
    tis_mode = config.tis_mode or f"{ratio_level}_truncate"
    return dataclasses.replace(
        preset, clip_low=clip_low, clip_high=clip_high, ratio_level=ratio_level, delta=config.delta,
        kl_bias_correction=config.use_bias_correction_kl, tis_mode=tis_mode, tis_min=config.tis_min,
    )  # fmt: skip


def _warn_half_override(config: AlgoConfig, preset: LossConfig, clip_low: float, clip_high: float) -> None:
    """One clip bound set, the other left at the preset's (not derived from the one set): say so."""
    if (config.epsilon is None) == (config.epsilon_high is None):
        return
    if config.epsilon is not None and clip_high == preset.clip_high and preset.clip_low != preset.clip_high:
        log.warning(
            "--epsilon %s with --loss_type %s keeps the preset's upper clip %s; pass --epsilon_high to set it too",
            clip_low, config.loss_type, clip_high,
        )  # fmt: skip
    elif config.epsilon_high is not None:
        log.warning(
            "--epsilon_high %s with --loss_type %s keeps the preset's lower clip %s; pass --epsilon to set it too",
            clip_high, config.loss_type, clip_low,
        )  # fmt: skip
