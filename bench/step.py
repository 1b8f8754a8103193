"""Step time of the RL loop at --max_staleness 0, 1, 2 with trainer and generator on disjoint resources.

The real pipeline (pipeline/loop.py) and trainer on a random-weight Qwen2.5-shaped model, GRPO-shaped
work (P prompts x G samples, fixed prompt and completion lengths, ignore EOS, random rewards), with the
generator either in this process on another device (`--placement device --generator_device cuda:1`) or
a `tandem rollout` server (`--placement server`: on GPU pinned to `--server_gpu`, on CPU to
`--server_cores` while this process keeps `--trainer_cores`). Prints one JSON line per S, then

    speedup S=1: step_s(S=0) / step_s(S=1) = X
    efficiency S=k: max(gen_s, train_s) / step_s = Y

gen_s is rollout/generate_s (first admission to last completion of a step's groups), train_s is time/train +
time/sync, step_s is step_time; each the mean over the steps after --warmup. Efficiency takes gen_s and
train_s of the first S listed (0: the phases run apart; at S > 0 a group's span includes its queueing).

    python bench/step.py --placement device --shape 0.5b --generator_device cuda:1            # GPU x2
    python bench/step.py --placement server --shape 1.5b --server_gpu 1                       # GPU x2
    python bench/step.py --placement server --device cpu --shape tiny --prompts 8 --generations 4 \
        --prompt_len 16 --completion_len 32 --trainer_cores 0 --server_cores 1                 # CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sync import SHAPES, save_model, start_server  # noqa: E402



class LengthTokenizer:
    """The loop decodes completions for rewards and logs only; a random-weight model's text means nothing."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "x" * len(ids)


class Collect:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def log(self, step: int, metrics: dict) -> None:
        self.rows.append(metrics)

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def build_parts(args, model_dir: str, url: str | None):
    from transformers import AutoModelForCausalLM

    from tandemrl.algo.presets import AlgoConfig
    from tandemrl.data.cursor import PromptCursor
    from tandemrl.generation.base import EngineConfig, RemoteConfig
    from tandemrl.generation.factory import build_generator
    from tandemrl.pipeline.loop import LoopParts
    from tandemrl.rewards.base import RewardFunc
    from tandemrl.train.config import TrainerConfig
    from tandemrl.train.trainer import Trainer
    from tandemrl.types import Example, SamplingParams
    from tandemrl.weights.base import DistributedSyncConfig, LocalSyncConfig
    from tandemrl.weights.factory import build_weight_sync

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device)
    algo = AlgoConfig(max_completion_length=args.completion_len, drop_zero_variance_groups=False)
    trainer = Trainer(TrainerConfig(device=args.device, max_tokens_per_microbatch=args.max_tokens_per_microbatch), algo, model, max_steps=1000)
    if url is None:
        engine = EngineConfig(device=args.generator_device, max_model_len=args.prompt_len + args.completion_len + 16,
                              max_num_seqs=args.prompts * args.generations, gpu_memory_utilization=0.5)  # fmt: skip
        generator = build_generator(engine, model=model, tokenizer=None)
        sync = build_weight_sync(LocalSyncConfig(), generator)
    else:
        generator = build_generator(RemoteConfig(urls=(url,), rollout_server_timeout=600))
        sync = build_weight_sync(DistributedSyncConfig(weight_sync_port=0), generator)
    rng = random.Random(0)
    vocab = min(SHAPES[args.shape]["vocab_size"], 30000)
    num_examples = 4 * args.prompts
    prompt_ids = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(num_examples)]

    async def reward(prompts, completions, **columns):
        return [rng.random() for _ in completions]

    return LoopParts(
        examples=[Example(prompt="", index=i) for i in range(num_examples)], prompt_ids=prompt_ids,
        cursor=PromptCursor(num_examples), generator=generator, sync=sync, trainer=trainer, tokenizer=LengthTokenizer(),
        reward_funcs=[RewardFunc(name="random", fn=reward)], reward_weights=None,
        params=SamplingParams(max_tokens=args.completion_len, temperature=1.0, ignore_eos=True),
        logger=Collect(), progress=Collect(), run_dir=Path(tempfile.mkdtemp()),
    )  # fmt: skip


async def measure(parts, args) -> list[dict]:
    from tandemrl.pipeline import loop
    from tandemrl.pipeline.loop import LoopSettings, run_loop

    loop._should_save = lambda settings, step: False  # a benchmark writes no checkpoints
    await parts.sync.publish(parts.trainer.model.named_parameters(), version=parts.trainer.policy_version)
    results = []
    for staleness in args.staleness:
        start = parts.trainer.policy_version
        settings = LoopSettings(
            max_steps=start + args.warmup + args.steps, num_prompts_per_step=args.prompts, num_generations=args.generations,
            scale_rewards="group", drop_zero_variance_groups=False, seed=0, sleep_level=0, log_completions_steps=0,
            save_steps=0, save_total_limit=0, max_staleness=staleness,
        )  # fmt: skip
        parts.logger.rows.clear()
        await run_loop(parts, settings, start_step=start)
        rows = parts.logger.rows[args.warmup :]
        mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
        result = {
            "bench": "step", "placement": args.placement, "shape": args.shape, "S": staleness, "steps": len(rows),
            "gen_s": round(mean("rollout/generate_s"), 4), "train_s": round(mean("time/train") + mean("time/sync"), 4),
            "sync_s": round(mean("time/sync"), 4), "wait_s": round(mean("pipeline/wait_time"), 4), "step_s": round(mean("step_time"), 4),
            "policy_lag_max": max(r["rollout/policy_lag_max"] for r in rows),
        }  # fmt: skip
        results.append(result)
    base = results[0]  # the phases measured apart: S = 0 when it ran first (at S > 0 a group's span includes queueing)
    for result in results:
        result["efficiency"] = round(max(base["gen_s"], base["train_s"]) / result["step_s"], 3)
        print(json.dumps(result), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--placement", choices=["device", "server"], default="device")
    parser.add_argument("--shape", choices=list(SHAPES), default="0.5b")
    parser.add_argument("--device", default="cuda", help="the trainer's device: cuda (GPU 0) or cpu")
    parser.add_argument("--generator_device", default="cuda:1", help="--placement device: the engine's device")
    parser.add_argument("--server_gpu", type=int, default=1, help="--placement server on GPU: the server's physical GPU")
    parser.add_argument("--trainer_cores", default="0", help="on CPU: cores of this (trainer) process")
    parser.add_argument("--server_cores", default="1", help="on CPU: cores of the rollout server")
    parser.add_argument("--server_args", default="--gpu_memory_utilization 0.5")
    parser.add_argument("--staleness", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--completion_len", type=int, default=256)
    parser.add_argument("--max_tokens_per_microbatch", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if args.device == "cpu" and args.placement == "server":  # disjoint cores; --placement device shares them (a check only)
        cores = {int(c) for c in args.trainer_cores.split(",")}
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(model_dir, SHAPES[args.shape], torch.float32)
        server, url = None, None
        if args.placement == "server":
            cores = {int(c) for c in args.server_cores.split(",")} if args.device == "cpu" else None
            gpu = args.server_gpu if args.device != "cpu" else None
            server, url = start_server(model_dir, args.device, "engine", args.server_args.split(), gpu=gpu, cores=cores)  # max_model_len 2048
        try:
            parts = build_parts(args, model_dir, url)

            async def go():
                try:
                    return await measure(parts, args)
                finally:
                    await parts.sync.close()
                    await parts.generator.close()

            results = {r["S"]: r for r in asyncio.run(go())}
        finally:
            if server is not None:
                server.terminate()
                server.wait(60)
    if 0 in results and 1 in results:
        print(f"speedup S=1: step_s(S=0) / step_s(S=1) = {results[0]['step_s'] / results[1]['step_s']:.2f}x "
              f"({args.placement}, {args.shape}, {args.prompts}x{args.generations}, {args.prompt_len}+{args.completion_len} tokens)")  # fmt: skip
    for s, r in sorted(results.items()):
        print(f"efficiency S={s}: max(gen_s, train_s) / step_s = {r['efficiency']:.2f} (step {r['step_s']:.3f} s; this S's gen {r['gen_s']:.3f} s, train {r['train_s']:.3f} s)")


if __name__ == "__main__":
    main()
