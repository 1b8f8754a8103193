"""Token logprobs and entropy from hidden states, without ever holding float32 logits for all tokens.

Legend: N tokens, H hidden size, V vocab, C chunk size.
Invariant: at most C x V logits exist at a time, in forward and in backward: each chunk runs under
non-reentrant activation checkpointing, so autograd saves only the chunk's hidden states and the
backward recomputes its logits (the Liger / "cut cross-entropy" trade of compute for memory).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs_and_entropy(
    hidden: Tensor, lm_head: torch.nn.Module, target_ids: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """log softmax(lm_head(h) / T)[target] and the entropy of that distribution, for one chunk.

    Example: logits [[0, 0]], target [1], T 1 -> logprobs [-ln 2], entropy [ln 2]
    """
    logits = lm_head(hidden).float() / temperature  # [C, V]
    logsumexp = torch.logsumexp(logits, dim=-1)  # [C]
    logprobs = logits.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1) - logsumexp  # [C]
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)  # [C, V]
        entropy = logsumexp - (probs * logits).sum(-1)  # [C]
    return logprobs, entropy


def logprobs_and_entropy(
    hidden: Tensor,
    lm_head: torch.nn.Module,
    target_ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor]:
    """Logprob of each target token under softmax(lm_head(hidden) / temperature), and its entropy.

    hidden [N, H], target_ids [N] -> logprobs [N] float32 (with grad), entropy [N] float32 (detached).
    Dividing by the sampling temperature scores tokens under the distribution they were sampled from.
    Example: hidden [[1.0]], lm_head Linear(1, 2) with weight [[0], [0]], target [0] -> ([-ln 2], [ln 2])
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens (greedy has no logprobs), got {temperature}")
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        chunk = slice(start, start + chunk_size)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(
                _chunk_logprobs_and_entropy, hidden[chunk], lm_head, target_ids[chunk], temperature, use_reentrant=False
            )
        else:
            lp, ent = _chunk_logprobs_and_entropy(hidden[chunk], lm_head, target_ids[chunk], temperature)
        logprobs.append(lp)
        entropies.append(ent.detach())
    if not logprobs:
        return hidden.new_zeros(0, dtype=torch.float32), hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(logprobs), torch.cat(entropies)  # [N], [N]
