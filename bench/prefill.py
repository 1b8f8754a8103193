"""Prefill steps of the engine on a random-weight Qwen2.5-0.5B shape, two ways alternating round by round
in one process (both meet the same machine state):

--compare padding (default): host time of a prefill's launch when every step's token count is new, as in
training (each step's prompts differ in length): padded rows (the engine's default, see
runner.padded_num_tokens) against the exact count. Each round submits 256 prompts of 16-96 random tokens
(one prefill step of ~14k tokens, max_tokens 1, no prefix hits). Exact counts are new to cuBLAS every round
(it picks a kernel per new matmul shape, on the host); padded counts fall in a few multiples of 256.

--compare graphs: the prefill's forward replayed from a CUDA graph of its padded row count (the default,
prefill_graphs.py: captured at a count's second use) against launched eagerly, op by op.

--compare attention: the paged prefill kernel (the default: it reads each sequence's context through its
block table, in the cache) against torch's flash attention over each layer's context copied out of the
cache. With --next_turns each round is what a multi-turn boundary prefills: 256 conversations of 256-448
tokens are prefilled untimed, then their next turns (each + 63 new tokens over its cached context: its last sampled one and 62 more) are
timed, so attention reads ~5x more keys than it computes queries.

After --warmup rounds of each mode, --rounds timed rounds of each. Prints one JSON line per mode (median
launch host ms of the timed prefill steps, their median device ms, median round ms, distinct row counts)
and the ratio line.

    python bench/prefill.py                                         # H200: 0.5B shape (about 1 minute)
    python bench/prefill.py --compare attention --next_turns        # H200: the multi-turn boundary's prefill
    python bench/prefill.py --compare graphs --next_turns           # H200: the same, graphed against eager
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

import torch  # noqa: E402

from tandemrl.generation.base import EngineConfig  # noqa: E402
from tandemrl.generation.engine.layers.attention import flash_varlen_available  # noqa: E402
from tandemrl.generation.engine import Engine  # noqa: E402
from tandemrl.generation.engine.runner import padded_num_tokens  # noqa: E402
from tandemrl.tasks.tiny import build_tokenizer  # noqa: E402
from tandemrl.types import SamplingParams  # noqa: E402


def one_round(engine: Engine, rng: random.Random, num_prompts: int, vocab: int, next_turns: bool) -> tuple[float, float, float, int]:
    """(launch host seconds of its timed prefill steps, their device seconds, round seconds, prefill tokens)
    of one round of fresh prompts (with next_turns: of their next turns, after the prompts untimed)."""
    params = SamplingParams(max_tokens=1, temperature=1.0, ignore_eos=True)

    def fresh(low: int, high: int) -> list[list[int]]:
        return [[rng.randrange(400, vocab) for _ in range(rng.randrange(low, high))] for _ in range(num_prompts)]

    async def run(prompts: list[list[int]]) -> list:
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    prompts = fresh(16, 97)
    if next_turns:  # the conversations so far, prefilled untimed; then each + its last sampled token + 62 new ones
        firsts = asyncio.run(run(conversations := fresh(256, 449)))
        prompts = [c + f.token_ids + [rng.randrange(400, vocab) for _ in range(62)] for c, f in zip(conversations, firsts)]
    times = engine.runner.times
    before, gpu_before = times.prepare_s, times.prefill_gpu_s
    tokens_before = engine.stats()["engine/num_prefill_tokens"]
    started = time.perf_counter()
    asyncio.run(run(prompts))
    seconds = time.perf_counter() - started
    return times.prepare_s - before, times.prefill_gpu_s - gpu_before, seconds, int(engine.stats()["engine/num_prefill_tokens"] - tokens_before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num_prompts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compare", choices=("padding", "attention", "graphs"), default="padding",
                        help="padded against exact rows, the paged prefill kernel against flash, or graphed prefills against eager")
    parser.add_argument("--next_turns", action="store_true", help="time next turns over cached contexts (a multi-turn boundary's prefill)")
    args = parser.parse_args()
    shape = "toy" if args.toy else "0.5b"
    model = build_model(shape, args.device)
    vocab = model.config.vocab_size
    engine = Engine(EngineConfig(device=args.device, gpu_memory_utilization=0.6, max_num_seqs=512, max_model_len=2048), model=model, tokenizer=build_tokenizer())
    rng = random.Random(0)
    runner = engine.runner
    if args.compare != "padding":  # both modes on the default padded rows; the graphs' own padded counts
        runner.pad_prefills = True
    if args.compare == "graphs" and runner.prefill_graphs is None:
        raise SystemExit("no prefill graphs here (they need CUDA, a 16-bit model and no tensor parallelism)")
    if args.compare == "attention":
        runner.graph_prefills = False  # the two attentions, each launched eagerly
    if args.compare == "attention" and runner.varlen_prefill and not flash_varlen_available():
        raise SystemExit(f"torch {torch.__version__} has no flash attention: nothing to compare the paged kernel with")
    # (ours, baseline): the mode names and how each sets the runner
    modes = {"padding": {"padded": ("pad_prefills", True), "exact": ("pad_prefills", False)},
             "attention": {"paged": ("paged_prefill", True), "flash": ("paged_prefill", False)},
             "graphs": {"graphed": ("graph_prefills", True), "eager": ("graph_prefills", False)}}[args.compare]  # fmt: skip
    rows = {mode: [] for mode in modes}
    for i in range(args.warmup + args.rounds):
        for mode, (attribute, value) in reversed(modes.items()):  # alternating: both meet the same machine state
            setattr(runner, attribute, value)
            measured = one_round(engine, rng, args.num_prompts, vocab, args.next_turns)
            if i >= args.warmup:
                rows[mode].append(measured)
    asyncio.run(engine.close())
    result = {}
    for mode, runs in rows.items():
        sizes = {padded_num_tokens(t) if runner.varlen_prefill and (mode != "exact") else t for *_, t in runs}
        result[mode] = {"mode": mode, "shape": shape, "num_prompts": args.num_prompts, "next_turns": args.next_turns, "rounds": len(runs),
                        "launch_ms": round(1e3 * statistics.median(r[0] for r in runs), 2), "prefill_gpu_ms": round(1e3 * statistics.median(r[1] for r in runs), 2),
                        "round_ms": round(1e3 * statistics.median(r[2] for r in runs), 2), "tokens": round(statistics.median(r[3] for r in runs)),
                        "launch_ms_all": [round(1e3 * r[0], 1) for r in runs], "distinct_row_counts": len(sizes)}  # fmt: skip
        print(json.dumps(result[mode]), flush=True)
    ours, base = (result[mode] for mode in modes)
    print(f"{ours['mode']} / {base['mode']} prefill launch host time: {ours['launch_ms'] / base['launch_ms']:.2f} ({ours['launch_ms']} vs {base['launch_ms']} ms); "
          f"prefill device time: {ours['prefill_gpu_ms'] / max(base['prefill_gpu_ms'], 1e-9):.2f} ({ours['prefill_gpu_ms']} vs {base['prefill_gpu_ms']} ms); "
          f"round time: {ours['round_ms'] / base['round_ms']:.2f} ({ours['round_ms']} vs {base['round_ms']} ms)")


if __name__ == "__main__":
    main()
