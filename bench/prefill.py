"""Host time of a prefill's launch when every step's token count is new, as in training (each step's prompts
differ in length), on a random-weight Qwen2.5-0.5B shape: padded rows (the engine's default, see
runner.padded_num_tokens) against the exact count, alternating round by round in one process.

Each round submits 256 prompts of 16-96 random tokens (one prefill step of ~14k tokens, max_tokens 1, no
prefix hits); after --warmup rounds of each mode, --rounds timed rounds of each. Exact counts are new to
cuBLAS every round (it picks a kernel per new matmul shape, on the host); padded counts fall in a few
multiples of 256, each new once. Prints one JSON line per mode (median launch host ms of the prefill step,
median round ms, distinct row counts seen) and the ratio line.

    python bench/prefill.py                  # H200: 0.5B shape (about 1 minute)
    python bench/prefill.py --toy --device cpu --rounds 2 --warmup 1   # CPU check (no padding on CPU: same path twice)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from multiturn import build_model  # noqa: E402

from tandemrl.generation.base import EngineConfig  # noqa: E402
from tandemrl.generation.engine import Engine  # noqa: E402
from tandemrl.generation.engine.runner import padded_num_tokens  # noqa: E402
from tandemrl.tasks.tiny import build_tokenizer  # noqa: E402
from tandemrl.types import SamplingParams  # noqa: E402


def one_round(engine: Engine, rng: random.Random, num_prompts: int, vocab: int) -> tuple[float, float, int]:
    """(launch host seconds of its prefill steps, round seconds, prefill tokens) of one round of fresh prompts."""
    prompts = [[rng.randrange(400, vocab) for _ in range(rng.randrange(16, 97))] for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=1, temperature=1.0, ignore_eos=True)
    times, before = engine.runner.times, engine.runner.times.prepare_s
    tokens_before = engine.stats()["engine/num_prefill_tokens"]

    async def run() -> None:
        await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    started = time.perf_counter()
    asyncio.run(run())
    return times.prepare_s - before, time.perf_counter() - started, int(engine.stats()["engine/num_prefill_tokens"] - tokens_before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num_prompts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    shape = "toy" if args.toy else "0.5b"
    model = build_model(shape, args.device)
    vocab = model.config.vocab_size
    engine = Engine(EngineConfig(device=args.device, gpu_memory_utilization=0.6, max_num_seqs=512, max_model_len=2048), model=model, tokenizer=build_tokenizer())
    rng = random.Random(0)
    rows = {"padded": [], "exact": []}
    for i in range(args.warmup + args.rounds):
        for mode in ("exact", "padded"):  # alternating: both meet the same machine state
            engine.runner.pad_prefills = mode == "padded"
            launch_s, round_s, tokens = one_round(engine, rng, args.num_prompts, vocab)
            if i >= args.warmup:
                rows[mode].append((launch_s, round_s, tokens))
    asyncio.run(engine.close())
    result = {}
    for mode, runs in rows.items():
        sizes = {padded_num_tokens(t) if mode == "padded" and engine.runner.varlen_prefill else t for _, _, t in runs}
        result[mode] = {"mode": mode, "shape": shape, "num_prompts": args.num_prompts, "rounds": len(runs),
                        "launch_ms": round(1e3 * statistics.median(r[0] for r in runs), 2), "round_ms": round(1e3 * statistics.median(r[1] for r in runs), 2),
                        "launch_ms_all": [round(1e3 * r[0], 1) for r in runs], "distinct_row_counts": len(sizes)}  # fmt: skip
        print(json.dumps(result[mode]), flush=True)
    padded, exact = result["padded"], result["exact"]
    print(f"padded / exact prefill launch host time: {padded['launch_ms'] / exact['launch_ms']:.2f} ({padded['launch_ms']} vs {exact['launch_ms']} ms); "
          f"round time: {padded['round_ms'] / exact['round_ms']:.2f} ({padded['round_ms']} vs {exact['round_ms']} ms)")


if __name__ == "__main__":
    main()
