"""Packing: token traces laid end to end into one row, planned into micro-batches by token count.

Legend: S sequences in a micro-batch, N tokens of all of them, L tokens of one trace.
Invariant: position j of the packed row predicts token j + 1 of the same trace, so every per-target
field (target_ids, loss_mask, old_logprobs, ...) is the trace's field shifted left by one, and a trace's
last position predicts nothing (loss_mask False). position_ids restart at 0 for every sequence: with
attention_mask=None and use_cache=False, transformers then attends block-diagonally (no cross-talk).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tandemrl.train.moe import RouteLayout, packed_routes
from tandemrl.types import NO_FLOOR, TokenTrace


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
    trained_index: Tensor  # [T] long, the positions where loss_mask is True
    cu_seqlens: Tensor  # [S + 1] int32, where each sequence starts in the row (packed attention)
    max_seqlen: int  # the longest sequence's length
    num_sequences: int
    num_trained_tokens: int  # T
    routes: Tensor | None = None  # [N, M, k] long, the experts that sampled each target (-1: none), when traces carry routes
    logit_floors: Tensor | None = None  # [N] float32, the sampler's lowest kept tempered logit per target (-inf: none), when one filtered


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


def pack(
    traces: list[TokenTrace], advantages: list[float], device: torch.device | str | None = None, route_layout: RouteLayout | None = None
) -> PackedBatch:
    """Lays `traces` end to end, shifting per-token fields to the target they predict (with `route_layout`,
    an MoE policy's: the traces' recorded routes too, train/moe.py).

    A trace's first token has no context, so it is never trained even if its loss_mask says so.
    Example: one trace token_ids [5, 6, 7], loss_mask [F, T, T], logprobs [0, -.1, -.2], advantage 1.0
      -> input_ids [[5, 6, 7]], position_ids [[0, 1, 2]], target_ids [6, 7, 0], loss_mask [T, T, F],
         old_logprobs [-.1, -.2, 0], advantages [1, 1, 1], seq_index [0, 0, 0]
    """
    assert len(traces) == len(advantages), "one advantage per trace"
    lengths = np.array([len(t.token_ids) for t in traces], dtype=np.int64)  # [S]
    ends = np.cumsum(lengths)  # [S]
    num_tokens = int(ends[-1]) if len(traces) else 0

    def column(field: str, dtype, fill) -> np.ndarray:
        """The traces' field laid end to end, shifted left by one within each trace, `fill` at each last position."""
        values = np.fromiter(itertools.chain.from_iterable(getattr(t, field) for t in traces), dtype=dtype, count=num_tokens)
        shifted = np.empty_like(values)
        shifted[:-1] = values[1:]
        shifted[ends - 1] = fill
        return shifted

    ids = np.fromiter(itertools.chain.from_iterable(t.token_ids for t in traces), dtype=np.int64, count=num_tokens)  # [N]
    seq = np.repeat(np.arange(len(traces)), lengths)  # [N]
    positions = np.arange(num_tokens) - np.repeat(ends - lengths, lengths)  # [N]
    mask = column("loss_mask", np.bool_, False)  # [N]
    # counts and layouts known here on the host, so the training loop never waits on the device for them
    trained = np.flatnonzero(mask)  # [T]
    on_device = functools.partial(_to_device, device=torch.device(device) if device is not None else None)
    behaviour = on_device(column("logprobs", np.float32, 0.0), np.float32)  # [N]
    floors = None
    if any(t.logit_floors and t.logit_floors.count(NO_FLOOR) != len(t.logit_floors) for t in traces):  # a filtering sampler's
        values = itertools.chain.from_iterable(t.logit_floors if len(t.logit_floors) == len(t.token_ids) else [NO_FLOOR] * len(t.token_ids) for t in traces)
        floors = on_device(_shifted(np.fromiter(values, dtype=np.float32, count=num_tokens), ends, NO_FLOOR), np.float32)  # [N]
    routes = None
    if route_layout is not None and any(t.routes for t in traces):
        routes = on_device(packed_routes(traces, ends - lengths, num_tokens, route_layout), np.int64)  # [N, M, k]
    return PackedBatch(
        input_ids=on_device(ids, np.int64).unsqueeze(0),
        position_ids=on_device(positions, np.int64).unsqueeze(0),
        target_ids=on_device(column("token_ids", np.int64, 0), np.int64),
        loss_mask=on_device(mask, np.bool_),
        old_logprobs=behaviour.clone(),
        behaviour_logprobs=behaviour,
        advantages=on_device(np.repeat(np.asarray(advantages, dtype=np.float32), lengths), np.float32),
        seq_index=on_device(seq, np.int64),
        policy_versions=on_device(column("policy_versions", np.int64, -1), np.int64),
        trained_index=on_device(trained, np.int64),
        cu_seqlens=on_device(np.concatenate([[0], ends]), np.int32),
        max_seqlen=int(lengths.max(initial=0)),
        num_sequences=len(traces),
        num_trained_tokens=len(trained),
        routes=routes,
        logit_floors=floors,
    )


def _shifted(values: np.ndarray, ends: np.ndarray, fill: float) -> np.ndarray:
    """Per-token values shifted left by one within each trace (what position j predicts), `fill` at each last."""
    shifted = np.empty_like(values)
    shifted[:-1] = values[1:]
    shifted[ends - 1] = fill
    return shifted


def _to_device(array: np.ndarray, dtype: type, device: torch.device | None) -> Tensor:
    """The array as a tensor of `dtype` on `device`. To a GPU through pinned memory without waiting: a
    copy from pageable memory would block the host until the device had run everything queued before it."""
    tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=dtype))
    if device is None or device.type == "cpu":
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def num_trained_targets(trace: TokenTrace) -> int:
    """The trained positions `pack` gives `trace`: a sampled token after the first (the first has no context).

    Example: loss_mask [T, F, T, T] -> 2
    """
    mask = trace.loss_mask
    return mask.count(True) - bool(mask and mask[0])


class MicroBatches(Sequence[PackedBatch]):
    """The step's micro-batches (`plan` over `traces`), each packed when first used, and kept: the host
    packs micro-batch i + 1 while the device still runs micro-batch i. Their trained-token count is known
    without packing."""

    def __init__(
        self, traces: list[TokenTrace], advantages: list[float], plan: list[list[int]], device: torch.device, route_layout: RouteLayout | None = None
    ) -> None:
        self._traces, self._advantages, self._plan, self._device = traces, advantages, plan, device
        self._route_layout = route_layout
        self._packed: list[PackedBatch | None] = [None] * len(plan)
        self.num_trained_tokens = sum(num_trained_targets(traces[i]) for idx in plan for i in idx)

    def __len__(self) -> int:
        return len(self._plan)

    def __getitem__(self, index: int) -> PackedBatch:  # type: ignore[override]
        if self._packed[index] is None:
            idx = self._plan[index]
            self._packed[index] = pack([self._traces[i] for i in idx], [self._advantages[i] for i in idx], self._device, self._route_layout)
        return self._packed[index]
