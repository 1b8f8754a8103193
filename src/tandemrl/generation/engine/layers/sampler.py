"""Sampling a batch of next tokens, and the logprob of each under the distribution it was drawn from.

Legend: B rows (sequences), V vocab.

Sampling is the Gumbel-max trick with counter-based noise: the noise of row b is a hash of (the
request's seed, the position being sampled, the vocab index). So a request's samples depend on its
seed alone, never on what else is in the batch, and a preempted request that recomputes its context
draws the same tokens again. The same hash runs in torch (here, any device) and in the Triton
kernel (sampler_kernel.py), so the CPU and GPU paths draw the same noise.

Order (as transformers applies them): repetition penalty, temperature, top-k, top-p, min-p. The
reported logprob is log_softmax of the penalised, filtered, tempered logits; greedy rows (temperature 0)
report log_softmax of the (penalised) raw logits. Each filter keeps a prefix of the sorted logits, so
the kept set is every token whose tempered logit is above a floor: a filtering row reports the floor
halfway between its lowest kept and highest excluded tempered logit (-inf for a row that filters nothing),
so the trainer, whose logits differ by numerics, keeps the same tokens and renormalises over them
(algo/logprobs.py): its ratio at lag 0 is 1 under top-k, top-p and min-p too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from tandemrl.types import SamplingParams

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9


def mix32(x: Tensor) -> Tensor:
    """lowbias32 (C. Wellons): a 32-bit integer hash, on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32  # wraps in int64 for large x; the low 32 bits stay exact
    return x ^ (x >> 16)


def row_keys(seeds: Tensor, positions: Tensor) -> Tensor:
    """The noise key of each row: [B] int64 in [0, 2**32), from the request seed and sampled position."""
    return mix32((mix32(seeds) + positions * GOLDEN32) & MASK32)


def gumbel_noise(keys: Tensor, vocab_size: int) -> Tensor:
    """[B, V] float32 standard Gumbel noise, a pure function of (key, vocab index)."""
    index = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    bits = mix32((keys[:, None] + index[None, :] * GOLDEN32) & MASK32)  # [B, V]
    return -torch.log(-torch.log(uniform_of(bits)))


def uniform_of(bits: Tensor) -> Tensor:
    """32-bit hash values -> float32 uniforms in (0, 1), from their top 23 bits: (k + 0.5) / 2^23 is exact in
    float32 and below 1. (With 24 bits, k = 2^24 - 1 rounded to u = 1: infinite noise, so that token was
    drawn whatever its probability, in ~1% of draws over a 150k vocab.)"""
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters of one step, on the logits' device."""

    temperatures: Tensor  # [B] float32, 0 = greedy
    top_k: Tensor  # [B] int64, V when off
    top_p: Tensor  # [B] float32
    min_p: Tensor  # [B] float32
    keys: Tensor  # [B] int64 noise keys
    needs_filter: bool  # any row with top-k, top-p or min-p
    penalty: RepetitionPenalty | None = None  # None: no row has a repetition penalty


@dataclass(slots=True)
class RepetitionPenalty:
    """transformers' and vLLM's repetition penalty (Keskar et al. 2019): the logit of every token already
    in the row's prompt or completion is divided by the penalty where positive, multiplied where negative."""

    seen: Tensor  # [B, V] bool
    penalties: Tensor  # [B] float32, 1 = none


def repetition_penalty(
    token_ids: list[list[int]], penalties: list[float], vocab_size: int, device: torch.device, *, last_ids: Tensor | None = None, pad: int = 0
) -> RepetitionPenalty | None:
    """The penalty of rows whose context is `token_ids` (+ `last_ids` [B], tokens the host may not hold
    yet); None when no row penalises. Padded rows are not penalised. Only indices cross to the device.

    Example: repetition_penalty([[2, 0]], [2.0], 3, cpu).seen -> [[True, False, True]]
    """
    if all(p == 1.0 for p in penalties):
        return None
    rows = torch.tensor([i for i, ids in enumerate(token_ids) for _ in ids], dtype=torch.int64)
    cols = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64)
    seen = torch.zeros(len(token_ids) + pad, vocab_size, dtype=torch.bool, device=device)
    seen[rows.to(device, non_blocking=True), cols.to(device, non_blocking=True)] = True
    if last_ids is not None:
        seen[torch.arange(len(last_ids), device=device), last_ids] = True
    values = torch.tensor(penalties + [1.0] * pad, dtype=torch.float32).to(device, non_blocking=True)
    return RepetitionPenalty(seen=seen, penalties=values)


def penalise(logits: Tensor, penalty: RepetitionPenalty) -> Tensor:
    """Example: logits [[2, -2, 1]], seen [[T, T, F]], penalty 2 -> [[1, -4, 1]]"""
    factor = penalty.penalties[:, None]
    return torch.where(penalty.seen, torch.where(logits > 0, logits / factor, logits * factor), logits)


def sampling_rows(params: list[SamplingParams], vocab_size: int, *, pad: int = 0) -> tuple[list[int], list[list[float]], bool]:
    """The one place SamplingParams become the engine's per-row numbers: top_k ([B + pad], V when
    off), [temperature, top_p, min_p] ([3, B + pad]) and whether any row filters. A padded row samples
    at temperature 1, unfiltered.

    Example: sampling_rows([SamplingParams(top_k=5)], 16, pad=1) -> ([5, 16], [[1, 1], [1, 1], [0, 0]], True)
    """
    top_k = [p.top_k_or(vocab_size) for p in params] + [vocab_size] * pad
    floats = [[p.temperature for p in params] + [1.0] * pad, [p.top_p for p in params] + [1.0] * pad, [p.min_p for p in params] + [0.0] * pad]
    return top_k, floats, any(p.filters for p in params)


def filter_logits(logits: Tensor, t: SamplingTensors, *, order_by: Tensor | None = None) -> Tensor:
    """Sets excluded tokens to -inf: top-k, then top-p, then min-p, each on what the last left. order_by:
    the logits before the temperature, whose order ranks the tokens (as the kernel's: dividing by a
    temperature can round float32 logits an ulp apart into a tie, which would keep the lower index)."""
    vocab_size = logits.shape[-1]
    order = (logits if order_by is None else order_by).sort(dim=-1, descending=True, stable=True).indices  # ties: lower index first
    sorted_logits = logits.gather(-1, order)  # [B, V]
    ranks = torch.arange(vocab_size, device=logits.device)[None, :]
    excluded = ranks >= t.top_k[:, None]  # [B, V] in sorted order
    sorted_logits = sorted_logits.masked_fill(excluded, float("-inf"))
    # keep the smallest prefix whose mass reaches top_p (the first token always stays), on masses relative
    # to the top (the kernel's): tokens tied with the top weigh exactly 1, so a threshold inside that tie
    # falls where exact arithmetic puts it (softmax's float32 cumsum of 50 x 0.02 kept 26 of them at 0.5)
    weights = (sorted_logits - sorted_logits[:, :1]).exp()
    excluded |= ((weights.cumsum(-1) - weights) >= t.top_p[:, None] * weights.sum(-1, keepdim=True)) & (t.top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(excluded, float("-inf"))
    probs = sorted_logits.softmax(-1)
    excluded |= probs < t.min_p[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(excluded, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: Tensor, t: SamplingTensors) -> tuple[Tensor, Tensor, Tensor | None]:
    """Returns (token_ids [B] int64, logprobs [B] float32, floors [B] float32 or None). The reference path,
    any device. floors: each row's lowest kept tempered logit, -inf where the row filters nothing (a greedy
    row too); None when no row filters (`logit_floors`)."""
    logits = logits.float()  # [B, V]
    if t.penalty is not None:
        logits = penalise(logits, t.penalty)
    greedy = t.temperatures == 0
    temperatures = torch.where(greedy, 1.0, t.temperatures)[:, None]
    # the row max comes off before the temperature (as the kernels'): logits of ~60 at T = 1e-4 are ~6e5
    # tempered, where float32's spacing (1/16) put logprobs off by 3e-2 from the trainer's
    scaled = (logits - logits.amax(-1, keepdim=True)) / temperatures
    floors = None
    if t.needs_filter:
        filtered = filter_logits(scaled, t, order_by=logits)
        floors = logit_floors(logits / temperatures, filtered == float("-inf"), t, greedy)
        scaled = torch.where(greedy[:, None], scaled, filtered)
    logprobs = scaled.log_softmax(-1)
    noise = gumbel_noise(t.keys, logits.shape[-1]).masked_fill_(greedy[:, None], 0.0)
    # greedy rows: the argmax of the logits themselves (log_softmax's rounding can tie logits an ulp apart)
    token_ids = torch.where(greedy, logits.argmax(-1), (logprobs + noise).argmax(-1))
    return token_ids, logprobs.gather(-1, token_ids[:, None])[:, 0], floors


def logit_floors(scaled: Tensor, excluded: Tensor, t: SamplingTensors, greedy: Tensor) -> Tensor:
    """[B] per row, halfway between the lowest tempered logit it kept and the highest it excluded
    (`scaled`: logits / T, the trainer's units; `excluded` [B, V] bool: what the filters set to -inf); -inf
    for a row that excludes nothing or is greedy. What a sampler returns per token for the trainer to
    renormalise by: the kept set is the tokens above it, and halfway leaves the most room for the trainer's numerics.

    Example: scaled [[2, 0, 1]], excluded [[F, T, F]], top_k [2] -> [0.5]
    """
    kept_min = scaled.masked_fill(excluded, float("inf")).amin(-1)  # [B]
    excluded_max = scaled.masked_fill(~excluded, float("-inf")).amax(-1)  # [B], -inf when all kept
    filters = (t.top_k < scaled.shape[-1]) | (t.top_p < 1.0) | (t.min_p > 0.0)  # [B]
    return torch.where(filters & ~greedy & (excluded_max > float("-inf")), (kept_min + excluded_max) / 2, float("-inf"))
