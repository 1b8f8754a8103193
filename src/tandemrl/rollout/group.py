"""Plays the G rollouts of one example concurrently (the engine prefills their shared prompt once).

A rollout that raises marks its whole group ERROR (logged with the traceback): the group is not
trained, and the pipeline counts it in its metrics.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tandemrl.generation.base import Generator
from tandemrl.rollout.run import MultiTurn, play, with_turn_stop
from tandemrl.types import Example, Group, RolloutStatus, SamplingParams

log = logging.getLogger(__name__)


async def play_group(
    example: Example, prompt_ids: list[int], *, generator: Generator, params: SamplingParams, group_size: int, tokenizer: Any, seed: int,
    multi_turn: MultiTurn | None = None,
) -> Group:
    """G rollouts of `example`; rollout g samples with seed `seed + g`, so a run is reproducible."""
    params = with_turn_stop(params, multi_turn) if multi_turn is not None else params
    plays = [
        play(example, prompt_ids, generator=generator, params=params.with_seed(seed + g), tokenizer=tokenizer, multi_turn=multi_turn)
        for g in range(group_size)
    ]
    try:
        rollouts = await asyncio.gather(*plays)
    except Exception as error:  # noqa: BLE001 - one of the two broad excepts: a failed group is data, not a crash
        # an unreachable or silent server is one line (the run stops on it); anything else keeps its traceback
        unreachable = isinstance(error, (ConnectionError, TimeoutError))
        log.error("rollout group of example %d failed (%s); it will not be trained", example.index, error, exc_info=not unreachable)
        return Group(example=example, rollouts=[], advantages=[], error=f"{type(error).__name__}: {error}")
    return Group(example=example, rollouts=list(rollouts))


def failed(group: Group) -> bool:
    return not group.rollouts or any(r.status is RolloutStatus.ERROR for r in group.rollouts)


def turn_metrics(groups: list[Group]) -> dict[str, float]:
    """Multi-turn only (TRL's tool metric names): turns, tool calls per rollout, share of failed calls."""
    rollouts = [r for g in groups for r in g.rollouts if r.messages]
    if not rollouts:
        return {}
    answers = [m for r in rollouts for m in r.messages if m["role"] == "tool"]
    failures = sum(str(m["content"]).startswith("error:") for m in answers)
    return {
        "turns/mean": sum(len(r.turns) for r in rollouts) / len(rollouts),
        "tools/call_frequency": len(answers) / len(rollouts),
        "tools/failure_frequency": failures / len(answers) if answers else 0.0,
    }
