"""Host time of a steady decode step at long contexts (CPU; no model): what the engine thread does per
step besides waiting for the device, with the look-ahead on (as on a GPU): schedule the next decode ahead,
write its inputs into the persistent DecodeState (only block-table entries of sequences that took a new
block cross), and append the last step's tokens (stop checks: a stop id, a stop string over the last few
tokens, the length). B sequences of a 128-token prompt whose completions are already --contexts long, so
the figure shows whether a step's host cost grows with the context (it should not: issue 31).

Prints one JSON line per context: the median and 90th percentile of --steps steps, with and without a stop
string, and one ratio line (longest context / shortest).

    python bench/host.py --contexts 1024,16384 --rows 128
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from tandemrl.generation.engine.decode_state import DecodeState
from tandemrl.generation.engine.kv_cache import BlockManager
from tandemrl.generation.engine.scheduler import Scheduler
from tandemrl.generation.engine.sequence import Sequence
from tandemrl.types import SamplingParams

PROMPT, VOCAB, BLOCK = 128, 150_000, 16


def step_times(context: int, rows: int, steps: int, stop: list[str]) -> list[float]:
    rng = random.Random(0)
    max_len = context + steps + 2
    blocks = BlockManager(rows * (-(-max_len // BLOCK)) + 1, BLOCK)
    scheduler = Scheduler(
        blocks, max_num_seqs=rows, max_num_batched_tokens=rows * PROMPT, max_model_len=max_len + 1, detokenize=lambda ids: "x" * len(ids)
    )  # fmt: skip
    params = SamplingParams(max_tokens=context + steps, stop=stop, ignore_eos=True)
    seqs = [Sequence([rng.randrange(VOCAB) for _ in range(PROMPT)], params, seed=i, stop_ids=frozenset([VOCAB])) for i in range(rows)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule()  # the prefill admits them all
    for seq in seqs:  # completions already `context` long, each with blocks for its KV
        seq.token_ids.extend(rng.choices(range(VOCAB), k=context - PROMPT))
        seq.logprobs.extend([0.0] * (context - PROMPT))
        seq.policy_versions.extend([0] * (context - PROMPT))
        while len(seq.block_table) * BLOCK < seq.num_tokens + 1:
            blocks.may_append(seq, ahead=1)
    state = DecodeState(rows, -(-max_len // BLOCK) + 1, VOCAB, torch.device("cpu"))
    batch = scheduler.schedule()
    state.load(batch.seqs, rows)
    state.advanced()
    tokens, logprobs, times = [1] * rows, [0.0] * rows, []
    for _ in range(steps):
        started = time.perf_counter()
        ahead = scheduler.schedule_ahead(batch)  # the next decode, launched before this one's tokens are read
        state.load(ahead.seqs, rows)
        state.advanced()
        scheduler.postprocess(batch, tokens, logprobs, 0)  # this one's tokens appended, stop checks
        batch = ahead
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,16384")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    medians = {}
    for context in (int(c) for c in args.contexts.split(",")):
        record = {"context": context, "rows": args.rows}
        for name, stop in (("plain", []), ("stop_string", ["</answer>"])):
            times = sorted(step_times(context, args.rows, args.steps, stop))
            record[f"{name}_median_ms"] = round(statistics.median(times) * 1e3, 3)
            record[f"{name}_p90_ms"] = round(times[int(0.9 * len(times))] * 1e3, 3)
        medians[context] = record
        print(json.dumps(record), flush=True)
    short, long = medians[min(medians)], medians[max(medians)]
    for name in ("plain", "stop_string"):
        ratio = long[f"{name}_median_ms"] / short[f"{name}_median_ms"]
        print(f"ratio host step {name} context {max(medians)}/{min(medians)} = {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
