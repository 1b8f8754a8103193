"""The clipped policy-gradient loss on packed tokens: per-token terms and the weights that aggregate them.

Legend: N tokens of a packed micro-batch (all sequences end to end), S sequences in it.
Invariant: token weights are normalised by counts of the WHOLE optimizer step (all micro-batches, all
ranks), so summing `policy_loss` over micro-batches gives the loss and gradient of one big batch.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from tandemrl.algo.presets import LossConfig


class PackedTokens(Protocol):
    """What the loss reads of a packed micro-batch (train.batching.PackedBatch has these fields)."""

    loss_mask: Tensor  # [N] bool
    old_logprobs: Tensor  # [N]
    behaviour_logprobs: Tensor  # [N]
    advantages: Tensor  # [N]
    seq_index: Tensor  # [N] long, 0..S-1


def _tokens_per_sequence(seq_index: Tensor, loss_mask: Tensor) -> Tensor:
    """Trained tokens of each position's sequence. Example: [0, 0, 1], [T, T, F] -> [2, 2, 0]."""
    counts = torch.zeros(seq_index.numel(), device=seq_index.device)  # [N] >= S slots: no wait for max()
    counts.index_add_(0, seq_index, loss_mask.float())
    return counts[seq_index]  # [N]


def token_weights(
    seq_index: Tensor,
    loss_mask: Tensor,
    *,
    aggregation: str,
    num_sequences: int,
    num_tokens: int,
    max_completion_length: int,
) -> Tensor:
    """The weight of each token's loss, so sum(weight * loss) over the step's micro-batches is the step loss.

    num_sequences / num_tokens count the whole optimizer step (sequences incl. any fully masked ones, as
    TRL's mean does; trained tokens). seq_mean_token_mean: 1 / (len_i * num_sequences) (GRPO, Shao et al.
    2024); token_mean: 1 / num_tokens (DAPO, Yu et al. 2025); seq_mean_token_sum_norm:
    1 / (num_sequences * max_completion_length) (Dr. GRPO, Liu et al. 2025). 0 where loss_mask is False.
    Example: seq_index [0, 0, 1], loss_mask [T, T, T], "seq_mean_token_mean", num_sequences 2
      -> [0.25, 0.25, 0.5]
    """
    mask = loss_mask.float()  # [N]
    if aggregation == "token_mean":
        return mask / max(num_tokens, 1)
    if aggregation == "seq_mean_token_mean":
        return mask / (_tokens_per_sequence(seq_index, loss_mask).clamp(min=1) * num_sequences)
    if aggregation == "seq_mean_token_sum_norm":
        return mask / (num_sequences * max_completion_length)
    raise ValueError(f"unknown aggregation {aggregation!r}")


def clipped_surrogate(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """Per-token PPO loss -min(r A, clip(r, 1 - low, 1 + high) A), r = exp(logprobs - old_logprobs).

    PPO (Schulman et al. 2017); the decoupled clip_high is DAPO's clip-higher (Yu et al. 2025). The mask
    is 1.0 where the clipped term is the active one (the token gives no gradient).
    Example: logprobs [log 1.5], old [0], advantages [1], clip 0.2/0.2 -> loss [-1.2], clipped [1.0]
    """
    ratio = torch.exp(logprobs - old_logprobs)  # [N]
    unclipped = ratio * advantages  # [N]
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages  # [N]
    is_clipped = ((ratio < 1 - clip_low) & (advantages < 0)) | ((ratio > 1 + clip_high) & (advantages > 0))
    return -torch.min(unclipped, clipped), is_clipped.float()


def sequence_level_ratio_logprobs(
    logprobs: Tensor, old_logprobs: Tensor, seq_index: Tensor, loss_mask: Tensor
) -> Tensor:
    """GSPO-token log-ratio: log s_i,t = sg[log s_i] + logprobs - sg[logprobs], for clipped_surrogate(., 0, ...).

    log s_i is the mean over sequence i's trained tokens of (logprobs - old_logprobs); the value of every
    token of i is log s_i, its gradient that of its own logprob (Zheng et al. 2025, arXiv:2507.18071, eq. 13).
    Example: logprobs [-1, -2], old [-1.1, -2.3], one sequence, all trained -> values [0.2, 0.2]
    """
    mask = loss_mask.float()  # [N]
    log_ratio = (logprobs - old_logprobs).detach() * mask  # [N]
    sums = torch.zeros(seq_index.numel(), device=logprobs.device).index_add_(0, seq_index, log_ratio)  # [N] >= S slots
    log_s = sums[seq_index] / _tokens_per_sequence(seq_index, loss_mask).clamp(min=1)  # [N]
    return log_s + logprobs - logprobs.detach()


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token KL(pi || ref) estimate k3 = exp(ref - lp) - (ref - lp) - 1 >= 0 (Schulman 2020, "Approximating KL").

    Example: logprobs [log 0.5], ref_logprobs [0] -> [1 - ln 2] = [0.3069]
    """
    delta = ref_logprobs - logprobs  # [N]
    return torch.exp(delta) - delta - 1


def truncated_importance_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, *, cap: float) -> Tensor:
    """min(exp(old - behaviour), cap), no grad: corrects the trainer/sampler mismatch; cap 0 = off (ones).

    Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"; Espeholt et al. 2018 for the truncation).
    Example: old [log 3, log 0.5], behaviour [0, 0], cap 2 -> [2.0, 0.5]
    """
    if cap == 0:
        return torch.ones_like(old_logprobs)
    return torch.exp(old_logprobs - behaviour_logprobs).detach().clamp(max=cap)


def sequence_importance_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, seq_index: Tensor, loss_mask: Tensor, *, cap: float
) -> Tensor:
    """Each token gets its sequence's weight min(exp(sum over its trained tokens of (old - behaviour)), cap), no grad.

    The sequence-level form of truncated importance sampling, for a sequence-level objective (GSPO): one
    likelihood ratio per sequence, as TRL's `sequence_truncate`; cap 0 = off (ones).
    Example: old [log 2, log 1.5, 0], behaviour [0, 0, 0], seq_index [0, 0, 1], cap 4 -> [3.0, 3.0, 1.0]
    """
    if cap == 0:
        return torch.ones_like(old_logprobs)
    diff = ((old_logprobs - behaviour_logprobs) * loss_mask.float()).detach()  # [N]
    sums = torch.zeros(int(seq_index.max()) + 1, dtype=diff.dtype, device=diff.device).index_add_(0, seq_index, diff)  # [S]
    return torch.exp(sums).clamp(max=cap)[seq_index]  # [N]


def policy_loss(
    batch: PackedTokens,
    logprobs: Tensor,
    *,
    config: LossConfig,
    weights: Tensor,
    ref_logprobs: Tensor | None,
    beta: float,
    tis_cap: float,
    metric_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """sum_t weights_t * (surrogate_t * tis_t + beta * kl_t): this micro-batch's share of the step loss.

    logprobs [N] are the current policy's, with grad. The metrics are sums of metric_weights * value
    (default `weights`; pass token_mean weights to get per-token means), detached, so that summing them
    over micro-batches gives the step's value. Keys: clip_ratio, tis_weight, ratio, and kl when ref is given.
    """
    new, old = logprobs, batch.old_logprobs  # [N], [N]: the ratio is exp(new - old)
    if config.ratio_level == "sequence":  # GSPO: exp(new - old) = s_i, one ratio per sequence
        new = sequence_level_ratio_logprobs(logprobs, old, batch.seq_index, batch.loss_mask)
        old = torch.zeros_like(old)
    new = torch.where(batch.loss_mask, new, old)  # ratio 1 where untrained: no exp overflow, no 0 * inf = nan
    surrogate, clipped = clipped_surrogate(
        new, old, batch.advantages, clip_low=config.clip_low, clip_high=config.clip_high
    )  # [N], [N]
    if config.ratio_level == "sequence":  # a token-level weight would break the sequence-level objective
        tis = sequence_importance_weights(batch.old_logprobs, batch.behaviour_logprobs, batch.seq_index, batch.loss_mask, cap=tis_cap)
    else:
        tis = truncated_importance_weights(batch.old_logprobs, batch.behaviour_logprobs, cap=tis_cap)  # [N]
    per_token = surrogate * tis  # [N]
    mw = (weights if metric_weights is None else metric_weights).detach()  # [N]
    metrics = {
        "clip_ratio": (mw * clipped).sum(),
        "tis_weight": (mw * tis).sum(),
        "ratio": (mw * torch.exp(new - old).detach()).sum(),
    }
    if ref_logprobs is not None:
        kl = kl_k3(logprobs, ref_logprobs)  # [N]
        per_token = per_token + beta * kl  # the KL penalty to the frozen reference (Shao et al. 2024, eq. 3)
        metrics["kl"] = (mw * kl.detach()).sum()
    return (weights * per_token).sum(), metrics
