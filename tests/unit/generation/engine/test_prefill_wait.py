"""The prefill holdoff (--prefill_wait_steps): late arrivals wait a few decode steps and are prefilled
together; nothing waits when nothing decodes; tokens are those of a run without it."""

from __future__ import annotations

import asyncio

from tandemrl.generation.base import EngineConfig
from tandemrl.generation.engine import Engine
from tandemrl.generation.engine.kv_cache import BlockManager
from tandemrl.generation.engine.scheduler import Scheduler
from tandemrl.generation.engine.sequence import Sequence
from tandemrl.types import SamplingParams


def sequence(seed: int) -> Sequence:
    return Sequence([1, 2, 3], SamplingParams(max_tokens=32, ignore_eos=True), seed=seed, stop_ids=frozenset())


def step(scheduler: Scheduler) -> list[int]:
    """Runs one step (token 7 for every row); returns the seeds of what it prefilled (None: a decode)."""
    batch = scheduler.schedule()
    scheduler.postprocess(batch, [7] * len(batch.seqs), [0.0] * len(batch.seqs), 0)
    return [s.seed for s in batch.seqs] if batch.is_prefill else None


def test_late_arrivals_wait_n_decode_steps_and_are_prefilled_together():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, prefill_wait_steps=3)
    scheduler.add(sequence(0))
    assert step(scheduler) == [0]  # nothing decodes: admitted at once
    scheduler.add(sequence(1))
    assert step(scheduler) is None
    scheduler.add(sequence(2))
    assert [step(scheduler), step(scheduler)] == [None, None]
    assert step(scheduler) == [1, 2]  # the oldest waited 3 decode steps: both in one prefill
    without = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    without.add(sequence(0))
    step(without)
    without.add(sequence(1))
    assert step(without) == [1]


def test_a_held_arrival_keeps_the_look_ahead_decode_until_it_is_due():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, prefill_wait_steps=2)
    scheduler.add(sequence(0))
    step(scheduler)
    scheduler.add(sequence(1))
    batch = scheduler.schedule()
    assert not batch.is_prefill and scheduler.schedule_ahead(batch) is not None  # held: the overlap goes on
    assert scheduler.schedule_ahead(batch) is None  # two decode steps waited: due, so nothing runs ahead of its prefill


def test_arrivals_that_fill_every_free_slot_do_not_wait():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, prefill_wait_steps=100)
    scheduler.add(sequence(0))
    step(scheduler)
    scheduler.add(sequence(1))
    assert step(scheduler) == [1]


def test_the_holdoff_changes_when_a_request_is_prefilled_not_its_tokens(family_dirs):
    def tokens(wait_steps: int) -> list[list[int]]:
        engine = Engine(EngineConfig(model=family_dirs["qwen2"], device="cpu", kv_cache_tokens=2048, prefill_wait_steps=wait_steps))
        params = [SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True, seed=s) for s in range(4)]

        async def staggered():
            first = asyncio.ensure_future(engine.generate(list(range(5, 12)), params[0]))
            later = []
            for i in range(1, 4):  # each arrives while the first decodes
                await asyncio.sleep(0.01)
                later.append(asyncio.ensure_future(engine.generate(list(range(5 + i, 15 + i)), params[i])))
            return await asyncio.gather(first, *later)

        completions = asyncio.run(staggered())
        asyncio.run(engine.close())
        return [c.token_ids for c in completions]

    assert tokens(4) == tokens(0)
