"""Packing: token traces laid end to end into one row, planned into micro-batches by token count.

Legend: S sequences in a micro-batch, N tokens of all of them, L tokens of one trace.
Invariant: position j of the packed row predicts token j + 1 of the same trace, so every per-target
field (target_ids, loss_mask, old_logprobs, ...) is the trace's field shifted left by one, and a trace's
last position predicts nothing (loss_mask False). position_ids restart at 0 for every sequence: with
attention_mask=None and use_cache=False, transformers then attends block-diagonally (no cross-talk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tandemrl.types import TokenTrace


@dataclass(kw_only=True)
class PackedBatch:
    """One micro-batch, packed. Written by `pack`; the trainer may replace `old_logprobs` only.

    old_logprobs is the denominator of the clipped ratio: `pack` fills it with the sampler's logprobs;
    the trainer may overwrite it with its own no-grad recompute (num_iterations > 1, GSPO, or to make
    the truncated importance weight old / behaviour meaningful). behaviour_logprobs never changes.
    """

    input_ids: Tensor  # [1, N] long
    position_ids: Tensor  # [1, N] long, 0..L-1 for each sequence
    target_ids: Tensor  # [N] long, the next token (0 at a sequence's last position)
    loss_mask: Tensor  # [N] bool, True where the target is a sampled (trained) token
    old_logprobs: Tensor  # [N] float32, logprobs of the targets under the old policy
    behaviour_logprobs: Tensor  # [N] float32, logprobs of the targets as sampled (0 where untrained)
    advantages: Tensor  # [N] float32, the sequence's advantage on each of its positions
    seq_index: Tensor  # [N] long, 0..S-1: which sequence a position belongs to
    policy_versions: Tensor  # [N] long, version that sampled the target (-1 where untrained)

    @property
    def num_sequences(self) -> int:
        return int(self.seq_index[-1]) + 1 if self.seq_index.numel() else 0

    @property
    def num_trained_tokens(self) -> int:
        return int(self.loss_mask.sum())


def plan_microbatches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of the sequences of each micro-batch, so each micro-batch holds <= max_tokens tokens.

    First-fit decreasing (longest first, ties by index; each index list ascending): deterministic. A
    sequence longer than max_tokens cannot be split (attention spans it), so it gets a micro-batch of its
    own, over the budget.
    Example: lengths [3, 5, 2, 4], max_tokens 7 -> [[1, 2], [0, 3]]
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = next((b for b, load in enumerate(loads) if load + lengths[i] <= max_tokens), None)
        if slot is None:
            bins.append([])
            loads.append(0)
            slot = len(bins) - 1
        bins[slot].append(i)
        loads[slot] += lengths[i]
    return [sorted(b) for b in bins]


def pack(traces: list[TokenTrace], advantages: list[float], device: torch.device | str | None = None) -> PackedBatch:
    """Lays `traces` end to end, shifting per-token fields to the target they predict.

    A trace's first token has no context, so it is never trained even if its loss_mask says so.
    Example: one trace token_ids [5, 6, 7], loss_mask [F, T, T], logprobs [0, -.1, -.2], advantage 1.0
      -> input_ids [[5, 6, 7]], position_ids [[0, 1, 2]], target_ids [6, 7, 0], loss_mask [T, T, F],
         old_logprobs [-.1, -.2, 0], advantages [1, 1, 1], seq_index [0, 0, 0]
    """
    assert len(traces) == len(advantages), "one advantage per trace"
    cols: dict[str, list] = {k: [] for k in ("ids", "pos", "tgt", "mask", "lp", "adv", "seq", "ver")}
    for s, (trace, advantage) in enumerate(zip(traces, advantages)):
        length = len(trace.token_ids)
        cols["ids"] += trace.token_ids
        cols["pos"] += range(length)
        cols["tgt"] += trace.token_ids[1:] + [0]
        cols["mask"] += trace.loss_mask[1:] + [False]
        cols["lp"] += trace.logprobs[1:] + [0.0]
        cols["ver"] += trace.policy_versions[1:] + [-1]
        cols["adv"] += [advantage] * length
        cols["seq"] += [s] * length
    behaviour = torch.tensor(cols["lp"], dtype=torch.float32, device=device)  # [N]
    return PackedBatch(
        input_ids=torch.tensor([cols["ids"]], dtype=torch.long, device=device),
        position_ids=torch.tensor([cols["pos"]], dtype=torch.long, device=device),
        target_ids=torch.tensor(cols["tgt"], dtype=torch.long, device=device),
        loss_mask=torch.tensor(cols["mask"], dtype=torch.bool, device=device),
        old_logprobs=behaviour.clone(),
        behaviour_logprobs=behaviour,
        advantages=torch.tensor(cols["adv"], dtype=torch.float32, device=device),
        seq_index=torch.tensor(cols["seq"], dtype=torch.long, device=device),
        policy_versions=torch.tensor(cols["ver"], dtype=torch.long, device=device),
    )
