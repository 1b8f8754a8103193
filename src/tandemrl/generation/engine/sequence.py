"""One request inside the engine: its tokens, its KV blocks, and what it has sampled so far.

Written only by the engine thread (scheduler, block manager, postprocess). `token_ids` always holds
prompt + sampled tokens, so a preempted sequence re-prefills exactly the context it had.
"""

from __future__ import annotations

import array
import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tandemrl.types import Completion, FinishReason, SamplingParams

_MASK32 = 0xFFFFFFFF
_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def seed32(seed: int) -> int:
    """Folds an arbitrary Python int seed into 32 bits (the sampler's counter-based noise key)."""
    return (seed ^ (seed >> 32) ^ (seed >> 64)) & _MASK32


@dataclass(eq=False, slots=True)
class Sequence:
    """A request in flight. `block_table` lists its KV blocks; the first `num_cached_tokens` tokens
    were found in the prefix cache at admission and are not recomputed."""

    token_ids: list[int]  # [P + T] prompt then sampled tokens
    params: SamplingParams
    seed: int  # 32-bit key of this request's sampling noise
    stop_ids: frozenset[int]
    on_finish: Callable[[Completion], None] | None = None
    on_token: Callable[[int], None] | None = None  # called with each sampled token (streaming)
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_prompt_tokens: int = 0
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    cache_epoch: int = 0  # BlockManager.epoch when the blocks were allocated
    logprobs: list[float] = field(default_factory=list)  # [T]
    policy_versions: list[int] = field(default_factory=list)  # [T]
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # [T] when params.top_logprobs > 0
    logit_floors: list[float] = field(default_factory=list)  # [T] when params filter (Completion.logit_floors)
    routes: bytearray | None = None  # [T, sparse layers, k] experts, when the engine records routes (Completion.routes)
    finish_reason: FinishReason | None = None
    num_failed_steps: int = 0  # steps that raised with this sequence in them
    isolated: bool = False  # after a failed step: admitted alone, until a step of its own succeeds
    arrival_step: int = 0  # the scheduler's decode-step count when it last began to wait (prefill_wait_steps)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def completion(self) -> Completion:
        assert self.finish_reason is not None
        return Completion(
            token_ids=self.output_ids,
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason,
            policy_versions=list(self.policy_versions),
            top_logprobs=list(self.top_logprobs) if self.params.top_logprobs else None,
            routes=bytes(self.routes) if self.routes is not None else None,
            logit_floors=list(self.logit_floors) if self.logit_floors else None,
        )


def out_of_range(token_ids: list[int], vocab_size: int) -> bool:
    """Whether an id is < 0 or >= vocab_size. Runs on the event loop for every turn of every rollout: an
    unsigned 32-bit array refuses negative ids in C and numpy finds the largest (argmax: 1 us less than
    max's reduce), ~6.3 us for 450 ids where min() and max() of the list took ~21 us (a rich comparison
    per id). Ids that are not 32-bit unsigned ints (or not ints) take that plain check, so every prompt
    gets the answer it always had.

    Example: out_of_range([0, 5], 6) -> False; out_of_range([6], 6) -> True; out_of_range([-1], 6) -> True
    """
    try:
        ids = array.array("I", token_ids)
    except (OverflowError, TypeError):
        return min(token_ids) < 0 or max(token_ids) >= vocab_size
    return ids[np.frombuffer(ids, np.uintc).argmax()] >= vocab_size
