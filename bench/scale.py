"""Past one GPU. `engine`: the engine split over N GPUs (tensor parallel) against one GPU, on a random
model of a real Qwen2.5 shape: output tokens/s of a GRPO-shaped workload (64 prompts x 8 samples, 128 prompt
+ 256 new tokens, temperature 1) and greedy equality (token ids of TP = N against TP = 1, the first token's
logprob gap). This process is rank 0 on GPU 0; ranks 1..N-1 are spawned (generation/engine/workers.py) and
cut their shards from the model's weights on GPU 0 (CUDA IPC). One JSON line per figure, then a ratio line.

    python bench/scale.py engine --model 1.5b --tensor_parallel_size 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

import torch

SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),  # CPU check
}


def qwen_config(shape: str):
    """Qwen2.5's config of that size (the real vocabulary, rope and tying)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        bos_token_id=151643, eos_token_id=151645, **SHAPES[shape],
    )  # fmt: skip


def build_model(shape: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """Random weights, the same on every rank (seed 0)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(qwen_config(shape), dtype=dtype, attn_implementation="sdpa")


def _rank_died(rank: int, exit_code: int | None) -> None:
    print(json.dumps({"error": f"tensor-parallel rank {rank} exited (code {exit_code})"}), flush=True)
    os._exit(1)


def run_engine(model, size: int, args, requests: list, greedy_prompts: list) -> tuple[float, float, list]:
    """(tokens/s, seconds, greedy completions) of one engine split over `size` GPUs (rank 0 here, on GPU 0)."""
    from tandemrl.generation.base import EngineConfig
    from tandemrl.generation.engine import Engine
    from tandemrl.generation.engine.workers import launch as launch_ranks
    from tandemrl.types import SamplingParams

    config = EngineConfig(
        device="cuda:0" if torch.cuda.is_available() else "cpu", gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=512,
        max_model_len=args.prompt_tokens + args.new_tokens, enforce_eager=args.enforce_eager, tensor_parallel_size=size,
    )  # fmt: skip
    tp = launch_ranks(config, model=model, on_death=_rank_died)[0] if size > 1 else None
    engine = Engine(config, model=model, tp=tp)

    async def go(prompts, params):
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))

    sampled = [SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True, seed=i) for i, (_, n) in enumerate(requests)]
    prompts = [p for p, _ in requests]
    asyncio.run(go(prompts[:64], sampled[:64]))  # warm: Triton kernels compile
    started = time.perf_counter()
    completions = asyncio.run(go(prompts, sampled))
    elapsed = time.perf_counter() - started
    greedy = SamplingParams(max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True)
    greedy_out = asyncio.run(go(greedy_prompts, [greedy] * len(greedy_prompts)))
    asyncio.run(engine.close())
    return sum(len(c.token_ids) for c in completions) / elapsed, elapsed, greedy_out


def engine(args) -> None:
    """Output tokens/s of the engine on 1 GPU and split over N, and greedy equality between them."""
    rng = random.Random(0)
    vocab = qwen_config(args.model).vocab_size
    requests = [([rng.randrange(vocab) for _ in range(args.prompt_tokens)], args.new_tokens) for _ in range(args.num_prompts) for _ in range(8)]
    greedy_prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.num_greedy)]
    cuda = torch.cuda.is_available()
    model = build_model(args.model, torch.device("cuda:0" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32).eval()
    results = {}
    for size in (1, args.tensor_parallel_size):
        tokens_per_s, seconds, greedy = run_engine(model, size, args, requests, greedy_prompts)
        results[size] = (tokens_per_s, greedy)
        print(json.dumps({"model": args.model, "tensor_parallel_size": size, "requests": len(requests), "new_tokens": args.new_tokens,
                          "seconds": round(seconds, 3), "tokens_per_s": round(tokens_per_s), "enforce_eager": args.enforce_eager}), flush=True)  # fmt: skip
    one, many = results[1][1], results[args.tensor_parallel_size][1]
    same = [a.token_ids == b.token_ids for a, b in zip(one, many)]
    prefix = [next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids)) for a, b in zip(one, many)]
    gap = max(abs(a.logprobs[0] - b.logprobs[0]) for a, b in zip(one, many))
    print(json.dumps({"model": args.model, "greedy_sequences": len(same), "identical": sum(same), "tokens_each": args.greedy_tokens,
                      "mean_common_prefix": round(sum(prefix) / len(prefix), 1), "first_logprob_max_gap": round(gap, 5)}), flush=True)  # fmt: skip
    ratio = results[args.tensor_parallel_size][0] / results[1][0]
    print(f"ratio {args.model} engine tokens/s TP={args.tensor_parallel_size} / TP=1 = {ratio:.2f}; greedy identical {sum(same)}/{len(same)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    e = sub.add_parser("engine", help="the engine split over N GPUs (tensor parallel) against one GPU")
    e.add_argument("--model", default="1.5b", choices=sorted(SHAPES))
    e.add_argument("--tensor_parallel_size", type=int, default=2)
    e.add_argument("--num_prompts", type=int, default=64, help="prompts, 8 samples each (temperature 1)")
    e.add_argument("--prompt_tokens", type=int, default=128)
    e.add_argument("--new_tokens", type=int, default=256)
    e.add_argument("--num_greedy", type=int, default=32, help="greedy sequences compared token for token")
    e.add_argument("--greedy_tokens", type=int, default=64)
    e.add_argument("--gpu_memory_utilization", type=float, default=0.6)
    e.add_argument("--enforce_eager", action="store_true", help="no CUDA graphs (the ranks' collectives run eagerly)")
    args = parser.parse_args()
    {"engine": engine}[args.what](args)


if __name__ == "__main__":
    main()
