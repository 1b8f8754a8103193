"""Group-relative advantages: each rollout's reward against the other rollouts of its group.

Legend: P groups (prompts), G group size. The std is torch's default (unbiased, Bessel-corrected), as
in TRL, so that numbers match what TRL users see; a group of one (G = 1) has std 0 and advantage 0.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

STD_EPS = 1e-4  # added to the std, as TRL: an all-equal group gives 0 / 1e-4 = 0, not NaN


def group_relative_advantages(rewards: Tensor, *, scale: Literal["group", "batch", "none"]) -> Tensor:
    """A_i = r_i - mean(group); divided by (std + 1e-4) of the group ("group") or of all rewards ("batch").

    scale="group" is GRPO (Shao et al. 2024); "none" is Dr. GRPO (Liu et al. 2025); "batch" is the
    group-mean, batch-std of Lite PPO (Liu et al. 2025, "Tricks or Traps?", arXiv:2508.08221).
    Example: rewards [[1, 0, 0, 1]], scale="none" -> [[0.5, -0.5, -0.5, 0.5]]
    """
    rewards = rewards.float()  # [P, G]
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # [P, G]
    if scale == "none":
        return centred
    if scale == "group":
        std = rewards.std(dim=1, keepdim=True, correction=min(1, rewards.shape[1] - 1))  # [P, 1]
    elif scale == "batch":
        std = rewards.std(correction=min(1, rewards.numel() - 1))  # []
    else:
        raise ValueError(f"scale must be group, batch or none, got {scale!r}")
    return centred / (std + STD_EPS)


def zero_variance_groups(rewards: Tensor) -> Tensor:
    """True for each group whose rewards are all equal: zero advantage, no learning signal.

    DAPO's dynamic sampling drops them (Yu et al. 2025, arXiv:2503.14476).
    Example: [[1, 1, 1], [1, 0, 1]] -> [True, False]
    """
    return (rewards == rewards[:, :1]).all(dim=1)  # [P]

