"""Group-relative advantages: each rollout's reward against the other rollouts of its group.

Legend: P groups (prompts), G group size. The std is torch's default (unbiased, Bessel-corrected), as
in TRL, so that numbers match what TRL users see; a group of one (G = 1) has std 0 and advantage 0.
A NaN reward is an unscorable rollout (every reward function returned None): as in TRL it stays out of
the mean and std and its advantage is 0.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

STD_EPS = 1e-4  # added to the std, as TRL: an all-equal group gives 0 / 1e-4 = 0, not NaN


def group_relative_advantages(rewards: Tensor, *, scale: Literal["group", "batch", "none"]) -> Tensor:
    """A_i = r_i - mean(group); divided by (std + 1e-4) of the group ("group") or of all rewards ("batch").

    scale="group" is GRPO (Shao et al. 2024); "none" is Dr. GRPO (Liu et al. 2025); "batch" is the
    group-mean, batch-std of Lite PPO (Liu et al. 2025, "Tricks or Traps?", arXiv:2508.08221).
    NaN rewards are left out of mean and std and get advantage 0.
    Example: rewards [[1, 0, 0, 1]], scale="none" -> [[0.5, -0.5, -0.5, 0.5]];
      [[1, 0, nan]], scale="none" -> [[0.5, -0.5, 0.0]]
    """
    rewards = rewards.float()  # [P, G]
    centred = rewards - rewards.nanmean(dim=1, keepdim=True)  # [P, G]
    if scale == "none":
        return centred.nan_to_num(nan=0.0)
    if scale == "group":
        std = nan_std(rewards, dim=1)  # [P, 1]
    elif scale == "batch":
        std = nan_std(rewards.flatten(), dim=0)  # [1]
    else:
        raise ValueError(f"scale must be group, batch or none, got {scale!r}")
    return (centred / (std + STD_EPS)).nan_to_num(nan=0.0)


def nan_std(values: Tensor, *, dim: int) -> Tensor:
    """Bessel-corrected std over the non-NaN entries along `dim` (kept); 0 where fewer than two.

    Example: [[1, 0, nan, 1]], dim=1 -> [[0.5774]]
    """
    valid = ~values.isnan()
    count = valid.sum(dim=dim, keepdim=True)
    squares = torch.where(valid, values - values.nanmean(dim=dim, keepdim=True), 0.0) ** 2
    return (squares.sum(dim=dim, keepdim=True) / (count - 1).clamp(min=1)).sqrt()


def zero_variance_groups(rewards: Tensor) -> Tensor:
    """True for each group whose scored (non-NaN) rewards are all equal: zero advantage, no learning signal.

    DAPO's dynamic sampling drops them (Yu et al. 2025, arXiv:2503.14476).
    Example: [[1, 1, 1], [1, 0, 1], [1, nan, 1]] -> [True, False, True]
    """
    std = nan_std(rewards.double(), dim=1)[:, 0]  # [P]
    return torch.isclose(std, torch.zeros_like(std))  # isclose, as TRL: the mean of equal floats may differ by an ulp

