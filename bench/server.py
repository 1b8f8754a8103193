"""The rollout server's output tokens/s relative to the same Generator in-process, on one workload
(a Qwen2.5-0.5B-shaped model, random weights): the cost of the HTTP skin and the client.

The server side is RemoteGenerator -> HTTP -> `tandem rollout`: the calls of one tick leave as one
POST /generate_batch, as a trainer step's rollouts do. Prints one JSON line per side and
`server/in-process output tokens/s: <ratio>`.
`--device cpu --backend hf --shape tiny` checks the script anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import tempfile
import time

import torch
from sync import QWEN25_05B, TINY, save_model, start_server

from tandemrl.generation.base import EngineConfig, HFConfig, RemoteConfig

from tandemrl.generation.factory import build_generator
from tandemrl.types import SamplingParams


async def run_workload(generator, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float]:
    await asyncio.gather(*(generator.generate(p, params) for p in prompts[:8]))  # warm-up
    start = time.perf_counter()
    completions = await asyncio.gather(*(generator.generate(p, params) for p in prompts))
    return sum(len(c.token_ids) for c in completions), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=["0.5b", "tiny"], default="0.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="engine")
    parser.add_argument("--num_prompts", type=int, default=512)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--max_tokens", type=int, default=256)
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.4)
    args = parser.parse_args()

    rng = random.Random(0)
    shape = QWEN25_05B if args.shape == "0.5b" else TINY
    prompts = [[rng.randrange(10, shape["vocab_size"] - 1) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rates = {}
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(model_dir, shape, dtype)
        if args.backend == "engine":
            config = EngineConfig(model=model_dir, device=args.device, gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=2048)
        else:
            config = HFConfig(model=model_dir, device=args.device)
        generator = build_generator(config)
        tokens, seconds = asyncio.run(run_workload(generator, prompts, params))
        asyncio.run(generator.close())
        del generator
        gc.collect()
        torch.cuda.empty_cache() if args.device == "cuda" else None
        rates["in-process"] = tokens / seconds
        print(json.dumps({"bench": "server", "side": "in-process", "backend": args.backend, "tokens": tokens, "seconds": round(seconds, 3), "tokens/s": round(tokens / seconds)}))

        extra = ["--gpu_memory_utilization", str(args.gpu_memory_utilization)]
        server, url = start_server(model_dir, args.device, args.backend, extra)
        try:
            remote = build_generator(RemoteConfig(urls=(url,), rollout_server_timeout=600))
            tokens, seconds = asyncio.run(run_workload(remote, prompts, params))
            asyncio.run(remote.close())
        finally:
            server.terminate()
            server.wait(30)
        rates["server"] = tokens / seconds
        print(json.dumps({"bench": "server", "side": "server", "backend": args.backend, "tokens": tokens, "seconds": round(seconds, 3), "tokens/s": round(tokens / seconds)}))
    print(f"server/in-process output tokens/s ({args.backend}, {args.shape}, {args.num_prompts}x{args.max_tokens}): {rates['server'] / rates['in-process']:.3f}")


if __name__ == "__main__":
    main()
