"""The clipped policy-gradient loss on packed tokens: per-token terms and the weights that aggregate them.

Legend: N tokens of a packed micro-batch (all sequences end to end), S sequences in it.
Invariant: token weights are normalised by counts of the WHOLE optimizer step (all micro-batches, all
ranks), so summing `policy_loss` over micro-batches gives the loss and gradient of one big batch.
"""

from __future__ import annotations

import math
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
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, clip_low: float, clip_high: float, delta: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token PPO loss -min(r A, clip(r, 1 - low, 1 + high) A), r = exp(logprobs - old_logprobs).

    PPO (Schulman et al. 2017); the decoupled clip_high is DAPO's clip-higher (Yu et al. 2025); `delta`
    also caps r in the unclipped term (two-sided clipping, INTELLECT-2, arXiv:2505.07291). The two masks
    are 1.0 where the low / high clip is the active term (the token gives no gradient).
    Example: logprobs [log 1.5], old [0], advantages [1], clip 0.2/0.2 -> loss [-1.2], low [0.0], high [1.0]
    """
    ratio = torch.exp(logprobs - old_logprobs)  # [N]
    unclipped = (ratio if delta is None else ratio.clamp(max=delta)) * advantages  # [N]
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages  # [N]
    is_low = (ratio < 1 - clip_low) & (advantages < 0)
    is_high = (ratio > 1 + clip_high) & (advantages > 0)
    return -torch.min(unclipped, clipped), is_low.float(), is_high.float()


def cispo_surrogate(
    logprobs: Tensor, log_ratio: Tensor, advantages: Tensor, *, clip_high: float
) -> tuple[Tensor, Tensor]:
    """Per-token CISPO loss -sg[min(r, clip_high)] A logprobs, and where r was capped (with A > 0).

    CISPO (MiniMax-M1, arXiv:2506.13585): the importance weight is clipped and detached, so every token
    keeps its gradient. Example: logprobs [-1], log_ratio [log 3], advantages [1], clip_high 2 -> [-2], [1.0]
    """
    ratio = torch.exp(log_ratio)  # [N]
    is_clipped = (ratio > clip_high) & (advantages > 0)
    return -ratio.clamp(max=clip_high).detach() * advantages * logprobs, is_clipped.float()


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, seq_index: Tensor, loss_mask: Tensor) -> Tensor:
    """log s_i at every token of sequence i: the mean over its trained tokens of (logprobs - old_logprobs).

    GSPO's sequence-level ratio (Zheng et al. 2025, arXiv:2507.18071), with its full gradient: every token
    of i gets d log s_i, the mean of its trained tokens' gradients, as TRL's importance_sampling_level
    "sequence". Example: logprobs [-1, -2], old [-1.1, -2.3], one sequence, all trained -> [0.2, 0.2]
    """
    log_ratio = (logprobs - old_logprobs) * loss_mask.float()  # [N]
    sums = torch.zeros(seq_index.numel(), dtype=log_ratio.dtype, device=logprobs.device)  # [N] >= S slots: no host sync
    sums = sums.index_add(0, seq_index, log_ratio)
    return sums[seq_index] / _tokens_per_sequence(seq_index, loss_mask).clamp(min=1)  # [N]


def high_entropy_mask(entropy: Tensor, loss_mask: Tensor, *, quantile: float) -> Tensor:
    """True for trained tokens whose entropy is in the top `quantile` of the trained tokens given.

    "Beyond the 80/20 Rule" (Wang et al. 2025, arXiv:2506.01939); TRL's top_entropy_quantile, computed
    over the tokens of one forward (a micro-batch), as TRL does. quantile 1 keeps all, 0 the highest.
    Example: entropy [0.1, 0.9, 0.5, 0.3], all trained, quantile 0.5 -> [F, T, T, F]
    """
    trained = entropy[loss_mask].float()  # [M]
    if trained.numel() == 0:
        return torch.zeros_like(loss_mask)
    threshold = torch.quantile(trained, 1 - quantile)
    return (entropy >= threshold) & loss_mask


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token KL(pi || ref) estimate k3 = exp(ref - lp) - (ref - lp) - 1 >= 0 (Schulman 2020, "Approximating KL").

    Example: logprobs [log 0.5], ref_logprobs [0] -> [1 - ln 2] = [0.3069]
    """
    delta = ref_logprobs - logprobs  # [N]
    return torch.exp(delta) - delta - 1


def importance_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, seq_index: Tensor, loss_mask: Tensor, *, mode: str, cap: float, min_weight: float = 0.0
) -> Tensor:
    """The behaviour-policy correction of each token, no grad, in TRL's four modes; cap 0 = off (ones).

    The ratio is exp(old - behaviour) per token (token_*), or its product over the trained tokens of the
    token's sequence (sequence_*, the form a sequence-level objective such as GSPO needs). *_truncate
    clamps it to [min_weight, cap] (TIS: Yao et al. 2025; Espeholt et al. 2018); *_mask keeps it where
    min_weight <= ratio <= cap and zeroes it elsewhere (masked IS), so outliers give no gradient at all.
    Both are TRL 1.16's (vllm_importance_sampling_clip_min / _max).
    Example: old [log 3, log 0.5], behaviour [0, 0], seq_index [0, 1], cap 2:
      token_truncate -> [2.0, 0.5], token_mask -> [0.0, 0.5]; seq_index [0, 0]: sequence_truncate -> [1.5, 1.5]
    """
    if cap == 0:
        return torch.ones_like(old_logprobs)
    log_ratio = (old_logprobs - behaviour_logprobs).detach()  # [N]
    if mode.startswith("sequence"):
        per_token = log_ratio * loss_mask.float()  # [N]
        sums = torch.zeros(seq_index.numel(), dtype=per_token.dtype, device=per_token.device).index_add_(0, seq_index, per_token)  # [N] >= S slots: no host sync
        log_ratio = sums[seq_index]  # [N]
    ratio = torch.exp(log_ratio)  # [N], may be inf: clamp and where handle it without nan
    if mode.endswith("truncate"):
        return ratio.clamp(min=min_weight, max=cap)
    return torch.where((ratio <= cap) & (ratio >= min_weight), ratio, torch.zeros_like(ratio))


def logprob_mismatch_kl(old_logprobs: Tensor, behaviour_logprobs: Tensor, weights: Tensor, lag0: Tensor) -> dict[str, Tensor]:
    """KL(sampler || trainer) on the same tokens, as sums of weights * value (weights: per-token means).

    train/logprob_mismatch_kl: the k3 estimate from the sampler's own samples; train/logprob_mismatch_kl_lag0
    and train/frac_lag0: the same restricted to tokens sampled by the very weights being trained, where any
    mismatch is numerics or a weight-sync bug.
    Example: old [-1.0], behaviour [-1.0], weights [1.0], lag0 [True] -> both KLs 0, frac_lag0 1
    """
    kl = kl_k3(behaviour_logprobs, old_logprobs).detach()  # [N]
    w0 = weights * lag0.float()  # [N]
    return {
        "train/logprob_mismatch_kl": (weights * kl).sum(),
        "train/logprob_mismatch_kl_lag0": (w0 * kl).sum(),
        "train/frac_lag0": w0.sum(),
    }


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
    sequence_metric_weights: Tensor | None = None,
    keep: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """sum_t weights_t * (surrogate_t * keep_t * tis_t + beta * kl_t * [r_t]): this micro-batch's share of the step loss.

    logprobs [N] are the current policy's, with grad; `keep` [N] bool (default all) drops tokens from the
    policy term (top_entropy_quantile); r_t multiplies the KL when config.kl_bias_correction (TRL's
    use_bias_correction_kl). The metrics are sums of metric_weights * value (default `weights`; pass
    token_mean weights to get per-token means), detached, so that summing them over micro-batches gives
    the step's value; clip metrics use sequence_metric_weights at sequence level (one value per sequence,
    as TRL), and `*_min` / `*_max` keys are minima / maxima over sequences (see `combine_metrics`). The
    importance weights follow config.tis_mode / tis_min with cap `tis_cap` (importance_weights).
    """
    mw = (weights if metric_weights is None else metric_weights).detach()  # [N]
    if config.ratio_level == "sequence":  # GSPO: one ratio s_i per sequence
        log_ratio = sequence_log_ratio(logprobs, batch.old_logprobs, batch.seq_index, batch.loss_mask)  # [N]
        cw = mw if sequence_metric_weights is None else sequence_metric_weights.detach()  # [N]
    else:
        log_ratio = logprobs - batch.old_logprobs  # [N]
        cw = mw
    tis = importance_weights(
        batch.old_logprobs, batch.behaviour_logprobs, batch.seq_index, batch.loss_mask,
        mode=config.tis_mode, cap=tis_cap, min_weight=config.tis_min,
    )  # [N]  # fmt: skip
    log_ratio = torch.where(batch.loss_mask, log_ratio, 0.0)  # ratio 1 where untrained: no exp overflow, no 0 * inf = nan
    surrogate, metrics = _surrogate(config, logprobs, log_ratio, batch.advantages, cw, batch.seq_index, batch.loss_mask)
    if keep is not None:
        surrogate = surrogate * keep.float()
    per_token = surrogate * tis  # [N]
    # TRL's names: the importance weight (after its mode's truncation or masking), mean and extremes over trained tokens
    metrics["sampling/importance_sampling_ratio/mean"] = (cw * tis).sum()
    metrics["sampling/importance_sampling_ratio/min"] = torch.where(batch.loss_mask, tis, torch.inf).min().detach()
    metrics["sampling/importance_sampling_ratio/max"] = torch.where(batch.loss_mask, tis, -torch.inf).max().detach()
    metrics["ratio"] = (cw * torch.exp(log_ratio).detach()).sum()
    if ref_logprobs is not None:
        kl = kl_k3(logprobs, ref_logprobs)  # [N]
        penalty = kl * torch.exp(log_ratio) if config.kl_bias_correction else kl  # DeepSeek-V3.2's unbiased KL gradient
        per_token = per_token + beta * penalty  # the KL penalty to the reference (Shao et al. 2024, eq. 3)
        metrics["kl"] = (mw * penalty.detach()).sum()
    return (weights * per_token).sum(), metrics


def _surrogate(
    config: LossConfig, logprobs: Tensor, log_ratio: Tensor, advantages: Tensor, cw: Tensor, seq_index: Tensor, loss_mask: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """The objective's per-token loss and its clip metrics (TRL's names)."""
    if config.objective == "cispo":
        surrogate, clipped = cispo_surrogate(logprobs, log_ratio, advantages, clip_high=config.clip_high)
        return surrogate, {"cispo_clip_ratio": (cw * clipped).sum()}
    zeros = torch.zeros_like(log_ratio)
    surrogate, low, high = clipped_surrogate(
        log_ratio, zeros, advantages, clip_low=config.clip_low, clip_high=config.clip_high, delta=config.delta
    )
    metrics = {
        "clip_ratio/low_mean": (cw * low).sum(),
        "clip_ratio/high_mean": (cw * high).sum(),
        "clip_ratio/region_mean": (cw * (low + high)).sum(),
        "clip_ratio/low_min": _per_sequence_extreme(low, seq_index, loss_mask, largest=False),
        "clip_ratio/high_max": _per_sequence_extreme(high, seq_index, loss_mask, largest=True),
    }
    return surrogate, metrics


def _per_sequence_extreme(values: Tensor, seq_index: Tensor, loss_mask: Tensor, *, largest: bool) -> Tensor:
    """Max (or min) over sequences of the mean of `values` over each one's trained tokens; sequences with
    none are left out (-inf / inf if all are). Example: [1, 0, 1], seq [0, 0, 1], all trained -> max 1.0, min 0.5"""
    mask = loss_mask.float()
    num_sequences = seq_index.numel()  # >= S slots: no host sync; empty slots have count 0
    sums = torch.zeros(num_sequences, device=values.device).index_add_(0, seq_index, values.detach() * mask)  # [S]
    counts = torch.zeros(num_sequences, device=values.device).index_add_(0, seq_index, mask)  # [S]
    means = sums / counts.clamp(min=1)  # [S]
    if largest:
        return torch.where(counts > 0, means, -math.inf).max()
    return torch.where(counts > 0, means, math.inf).min()


def entropy_bonus(entropy: Tensor, mask: Tensor, *, share: float) -> Tensor:
    """Mean entropy over `mask`'s tokens times `share` (this micro-batch's part of the step's trained
    tokens): TRL's entropy term, which it averages per micro-batch. Example: [1, 3], [T, T], share 0.5 -> 1.0"""
    m = mask.float()  # [N]
    return (entropy * m).sum() / m.sum().clamp(min=1) * share


def combine_metrics(total: dict, part: dict) -> dict:
    """Adds one micro-batch's metrics (floats or 0-d tensors, never synced) into the step's: sums, except
    `*_min` / `*_max` (and `*/min`, `*/max`) keys (min / max). Example: {"a": 1, "x_min": 2} + {"a": 3, "x_min": 1} -> {"a": 4, "x_min": 1}"""
    for key, value in part.items():
        if key not in total:
            total[key] = value
        elif key.endswith(("_min", "_max", "/min", "/max")):
            lowest = key.endswith(("_min", "/min"))
            pick = (torch.minimum if lowest else torch.maximum) if isinstance(value, Tensor) else None
            total[key] = pick(total[key], value) if pick else (min if lowest else max)(total[key], value)
        else:
            total[key] = total[key] + value
    return total
