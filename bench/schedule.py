"""Host time of a multi-turn boundary's bookkeeping in the engine (CPU; no model): 64 prompts x 8 rollouts
decode a turn of 128 tokens, finish (their blocks are freed and hashed for the next turn), and their next
turns (the context + 47 new tokens, as bench/multiturn.py's tool answers) are admitted by one schedule()
call under the 16k-token budget (each computes only its new tokens: the earlier turns are cached).

Prints one JSON line per prompt length: the median and minimum of --rounds rounds (each on a fresh block
manager) of freeing 512 finished sequences and of the admitting schedule(). Before/after on two trees:

    python bench/schedule.py                                        # this tree
    python bench/ab.py --export HEAD~1 _ab/before && PYTHONPATH=_ab/before/src python bench/schedule.py
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tandemrl.generation.engine.kv_cache import BlockManager
from tandemrl.generation.engine.scheduler import Scheduler
from tandemrl.generation.engine.sequence import Sequence
from tandemrl.types import SamplingParams

NUM_PROMPTS, GROUP_SIZE, TURN_TOKENS, ANSWER_TOKENS, VOCAB = 64, 8, 128, 47, 150_000


def one_round(prompt_len: int, block_size: int, seed: int) -> tuple[float, float, int, int]:
    """(free seconds, schedule seconds, sequences admitted, tokens they compute) of one boundary."""
    blocks = BlockManager(40_000, block_size)
    scheduler = Scheduler(blocks, max_num_seqs=1024, max_num_batched_tokens=16_384, max_model_len=8192)
    params, rng = SamplingParams(max_tokens=TURN_TOKENS), random.Random(seed)
    seqs = []
    for _ in range(NUM_PROMPTS):
        prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
        for _ in range(GROUP_SIZE):
            seqs.append(Sequence(list(prompt), params, seed=0, stop_ids=frozenset()))
            scheduler.add(seqs[-1])
    while scheduler.waiting:
        scheduler.schedule()
    for seq in seqs:  # the turn's tokens, each with room for its KV (as decode steps leave them)
        for _ in range(TURN_TOKENS):
            seq.token_ids.append(rng.randrange(VOCAB))
            blocks.may_append(seq)
    started = time.perf_counter()
    for seq in seqs:
        scheduler.finish(seq, "length")
    free_s = time.perf_counter() - started
    scheduler.drop_finished()
    for seq in seqs:
        scheduler.add(Sequence(seq.token_ids + [rng.randrange(VOCAB) for _ in range(ANSWER_TOKENS)], params, seed=0, stop_ids=frozenset()))
    started = time.perf_counter()
    batch = scheduler.schedule()
    schedule_s = time.perf_counter() - started
    return free_s, schedule_s, len(batch.seqs), sum(batch.num_new_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt_lens", default="128,448", help="first-turn prompt lengths (448: a third turn's context)")
    parser.add_argument("--block_size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    for prompt_len in (int(n) for n in args.prompt_lens.split(",")):
        rounds = [one_round(prompt_len, args.block_size, seed) for seed in range(args.rounds)]
        free, schedule = [r[0] * 1e3 for r in rounds], [r[1] * 1e3 for r in rounds]
        print(json.dumps({"prompt_len": prompt_len, "block_size": args.block_size, "admitted": rounds[0][2], "new_tokens": rounds[0][3],
                          "schedule_ms": round(statistics.median(schedule), 2), "schedule_min_ms": round(min(schedule), 2),
                          "free_ms": round(statistics.median(free), 2), "free_min_ms": round(min(free), 2)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
