"""Scaling past one GPU. `engine`: the engine split over --tensor_parallel_size GPUs against one GPU, on
a random-weight model of a real Qwen2.5 shape: output tokens/s of a GRPO-shaped workload (temperature 1),
and greedy equality (token ids of TP = N against TP = 1, and the first token's logprob gap).

This process is rank 0 on GPU 0; ranks 1..N-1 are spawned (generation/engine/workers.py) and map the
model's weights from GPU 0 (CUDA IPC) to cut their shards. Prints one JSON line per figure and a ratio line.

    python bench/scale.py engine --shape 1.5b --tensor_parallel_size 2
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time

import torch

SHAPES = {  # Qwen2.5's configs (tied embeddings, 151936 vocab)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}


def build_model(shape: str, device: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    vocab = 151936 if shape != "tiny" else 1024
    config = Qwen2Config(vocab_size=vocab, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, **SHAPES[shape])
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _rank_died(rank: int, exit_code: int | None) -> None:
    print(json.dumps({"error": f"tensor-parallel rank {rank} exited (code {exit_code})"}), flush=True)
    os._exit(1)


def run_engine(model, size: int, args, requests, greedy_prompts):
    """(tokens/s, sampled completions, greedy completions) of one engine split over `size` GPUs."""
    from tandemrl.generation.base import EngineConfig
    from tandemrl.generation.engine import Engine
    from tandemrl.generation.engine.workers import launch
    from tandemrl.types import SamplingParams

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = EngineConfig(
        device=f"{device}:0" if device == "cuda" else device, gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=512,
        max_model_len=args.prompt_len + args.new_tokens, enforce_eager=args.enforce_eager, tensor_parallel_size=size,
    )  # fmt: skip
    tp = launch(config, model=model, on_death=_rank_died)[0] if size > 1 else None
    engine = Engine(config, model=model, tp=tp)

    async def go(prompts, params):
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))

    sampled = [SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True, seed=i) for i, (_, n) in enumerate(requests)]
    prompts = [p for p, _ in requests]
    asyncio.run(go(prompts[:64], sampled[:64]))  # warm: Triton kernels compile
    start = time.perf_counter()
    completions = asyncio.run(go(prompts, sampled))
    elapsed = time.perf_counter() - start
    greedy = SamplingParams(max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True)
    greedy_out = asyncio.run(go(greedy_prompts, [greedy] * len(greedy_prompts)))
    asyncio.run(engine.close())
    return sum(len(c.token_ids) for c in completions) / elapsed, elapsed, greedy_out


def engine_main(args) -> None:
    rng = random.Random(0)
    vocab = 151936 if args.shape != "tiny" else 1024
    requests = [([rng.randrange(1000, vocab - 1) for _ in range(args.prompt_len)], args.new_tokens) for _ in range(args.num_prompts) for _ in range(8)]
    greedy_prompts = [[rng.randrange(1000, vocab - 1) for _ in range(args.prompt_len)] for _ in range(args.num_greedy)]
    model = build_model(args.shape, "cuda" if torch.cuda.is_available() else "cpu")
    results = {}
    for size in (1, args.tensor_parallel_size):
        tokens_per_s, elapsed, greedy = run_engine(model, size, args, requests, greedy_prompts)
        results[size] = (tokens_per_s, greedy)
        print(json.dumps({"bench": "engine_tp", "shape": args.shape, "tensor_parallel_size": size, "requests": len(requests),
                          "new_tokens": args.new_tokens, "seconds": round(elapsed, 3), "tokens_per_s": round(tokens_per_s)}), flush=True)  # fmt: skip
    one, many = results[1][1], results[args.tensor_parallel_size][1]
    same = [a.token_ids == b.token_ids for a, b in zip(one, many)]
    prefix = [next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids)) for a, b in zip(one, many)]
    first_gap = max(abs(a.logprobs[0] - b.logprobs[0]) for a, b in zip(one, many))
    print(json.dumps({"bench": "engine_tp_greedy", "shape": args.shape, "sequences": len(same), "identical": sum(same),
                      "mean_common_prefix": round(sum(prefix) / len(prefix), 1), "tokens_each": args.greedy_tokens,
                      "first_token_logprob_max_gap": round(first_gap, 5)}), flush=True)  # fmt: skip
    ratio = results[args.tensor_parallel_size][0] / results[1][0]
    print(f"ratio {args.shape} tokens/s TP={args.tensor_parallel_size} / TP=1 = {ratio:.2f}; greedy identical {sum(same)}/{len(same)}", flush=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    engine = commands.add_parser("engine", help="engine tensor parallelism: TP = N against TP = 1")
    engine.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    engine.add_argument("--tensor_parallel_size", type=int, default=2)
    engine.add_argument("--num_prompts", type=int, default=64, help="prompts, 8 samples each")
    engine.add_argument("--prompt_len", type=int, default=128)
    engine.add_argument("--new_tokens", type=int, default=256)
    engine.add_argument("--num_greedy", type=int, default=32, help="greedy sequences compared token for token")
    engine.add_argument("--greedy_tokens", type=int, default=64)
    engine.add_argument("--gpu_memory_utilization", type=float, default=0.6)
    engine.add_argument("--enforce_eager", action="store_true", help="no CUDA graphs (TP's collectives run eagerly)")
    args = parser.parse_args(argv)
    if args.command == "engine":
        engine_main(args)


if __name__ == "__main__":
    main(sys.argv[1:])
