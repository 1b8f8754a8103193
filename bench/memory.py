"""Colocate memory on one GPU: peak memory per phase with each lever off and on, what each lever returns,
and what it costs in step time.

The real loop (pipeline/loop.py), trainer and colocated engine (sharing GPU 0) on a random-weight
Qwen2.5-shaped model (its config built in code), GRPO-shaped work (P prompts x G samples, fixed prompt
and completion lengths, ignore EOS, random rewards), once per lever set: none, --sleep_level 1,
--sleep_level 2, --offload_optimizer, --offload_model, and all of them with --gc_collect_after_offload.
The torch allocator's own counts (memory_allocated) are read around each lever and per phase:
generation (from the end of one step's sync to the start of the next step's training), training (the
trainer's step, the sleep and the reload before it included) and sync (offload, wake, publish). Prints
one JSON line per lever set (peaks in GB, seconds per step and phase: means over the steps after
--warmup), then

    sleep 1 returns X of the KV cache (N GB) during training        (required >= 0.90)
    offload returns X of the optimizer state (N GB) during generation (required >= 0.90)
    cost of LEVER: step X s vs Y s (+Z%); peak generation A GB, training B GB

    python bench/memory.py --shape 1.5b                                                  # GPU, ~3 min
    python bench/memory.py --device cpu --shape tiny --prompts 4 --generations 4 --prompt_len 8 --completion_len 8
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from engine import SHAPES  # noqa: E402
from step import Collect, LengthTokenizer  # noqa: E402

LEVERS = {
    "none": {},
    "sleep1": {"sleep_level": 1},
    "sleep2": {"sleep_level": 2},
    "offload_optimizer": {"offload_optimizer": True},
    "offload_model": {"offload_model": True},
    "all": {"sleep_level": 2, "offload_optimizer": True, "offload_model": True, "gc_collect_after_offload": True},
}
GB = 2**30


def model_config(shape: str):
    from transformers import Qwen2Config

    dims = SHAPES.get(shape) or dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return Qwen2Config(
        vocab_size=151936 if shape in SHAPES else 320, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, **dims,
    )  # fmt: skip


class Probe:
    """Reads the allocator around each lever and at phase boundaries (methods wrapped on the instances)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.rows: list[dict[str, float]] = []  # one per step
        self.row: dict[str, float] = {}

    def allocated(self) -> float:
        return torch.cuda.memory_allocated() / GB if self.cuda else 0.0

    def peak(self, reset: bool = True) -> float:
        if not self.cuda:
            return 0.0
        value = torch.cuda.max_memory_allocated() / GB
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return value

    def install(self, parts, loop_module) -> None:
        train_and_publish, train_step = loop_module._train_and_publish, parts.trainer.train_step

        async def traced_step(parts_, settings, batch):
            self.row = {"gen_peak_gb": self.peak(), "gen_reserved_gb": torch.cuda.max_memory_reserved() / GB if self.cuda else 0.0}
            result = await train_and_publish(parts_, settings, batch)
            self.row["sync_peak_gb"] = self.peak()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            self.rows.append(self.row)
            return result

        def traced_train(batch):
            metrics = train_step(batch)
            self.row["train_peak_gb"] = self.peak()
            return metrics

        loop_module._train_and_publish = traced_step
        parts.trainer.train_step = traced_train
        engine = parts.generator
        engine_weights = sum(p.nbytes for p in engine.model.parameters()) / GB
        self._around(engine, "sleep", "sleep", lambda level: engine.runner.kv_cache.nbytes / GB + (engine_weights if level >= 2 else 0), is_async=True)
        offload = parts.trainer.offload
        from tandemrl.train.offload import model_tensors, optimizer_tensors

        self._around(offload, "optimizer_to_cpu", "optimizer", lambda: sum(t.nbytes for t in optimizer_tensors(parts.trainer.optimizer)) / GB)
        self._around(offload, "model_to_cpu", "model", lambda: sum(t.nbytes for group in model_tensors(parts.trainer) for t in group if t is not None) / GB)

    def _around(self, owner, name: str, key: str, size, *, is_async: bool = False) -> None:
        """owner.name wrapped: the bytes it frees (allocated before - after) and what it should free (`size`
        of the call's arguments)."""
        inner = getattr(owner, name)

        def before(*args) -> tuple[float, float]:
            return self.allocated(), size(*args)

        def after(start: tuple[float, float]) -> None:
            self.row[f"{key}_gb"] = start[1]
            self.row[f"{key}_returned_gb"] = start[0] - self.allocated()

        async def async_wrapped(*args):
            start = before(*args)
            await inner(*args)
            after(start)

        def wrapped(*args):
            start = before()
            inner(*args)
            after(start)

        setattr(owner, name, async_wrapped if is_async else wrapped)


def build_parts(args, levers: dict):
    from transformers import AutoModelForCausalLM

    from tandemrl.algo.presets import AlgoConfig
    from tandemrl.data.cursor import PromptCursor
    from tandemrl.generation.base import EngineConfig, build_generator
    from tandemrl.pipeline.loop import LoopParts
    from tandemrl.rewards.base import RewardFunc
    from tandemrl.train.config import OffloadConfig, TrainerConfig
    from tandemrl.train.trainer import Trainer
    from tandemrl.types import Example, SamplingParams
    from tandemrl.weights.base import LocalSyncConfig, build_weight_sync

    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(model_config(args.shape), dtype=torch.float32, attn_implementation="sdpa")
    offload = OffloadConfig(**{k: v for k, v in levers.items() if k != "sleep_level"})
    trainer_config = TrainerConfig(device=args.device, max_tokens_per_microbatch=args.max_tokens_per_microbatch, torch_compile=False)
    algo = AlgoConfig(max_completion_length=args.completion_len, drop_zero_variance_groups=False)
    trainer = Trainer(trainer_config, algo, model, max_steps=1000, offload=offload)
    engine = EngineConfig(device=args.device, max_model_len=args.prompt_len + args.completion_len + 16,
                          max_num_seqs=args.prompts * args.generations, gpu_memory_utilization=0.4, kv_cache_tokens=1 << 20)  # fmt: skip
    generator = build_generator(engine, model=model, tokenizer=None)
    rng = random.Random(0)
    num_examples = 4 * args.prompts
    prompt_ids = [[rng.randrange(100, min(model.config.vocab_size, 30000)) for _ in range(args.prompt_len)] for _ in range(num_examples)]

    async def reward(prompts, completions, **columns):
        return [rng.random() for _ in completions]

    return LoopParts(
        examples=[Example(prompt="", index=i) for i in range(num_examples)], prompt_ids=prompt_ids,
        cursor=PromptCursor(num_examples), generator=generator, sync=build_weight_sync(LocalSyncConfig(), generator), trainer=trainer,
        tokenizer=LengthTokenizer(), reward_funcs=[RewardFunc(name="random", fn=reward)], reward_weights=None,
        params=SamplingParams(max_tokens=args.completion_len, temperature=1.0, ignore_eos=True),
        logger=Collect(), progress=Collect(), run_dir=Path(tempfile.mkdtemp()),
    )  # fmt: skip


async def measure(args, name: str) -> dict:
    from tandemrl.cli import frozen_heap
    from tandemrl.pipeline import loop
    from tandemrl.pipeline.loop import LoopSettings, run_loop

    levers = LEVERS[name]
    loop._should_save = lambda settings, step: False  # a benchmark writes no checkpoints
    parts = build_parts(args, levers)
    probe = Probe(torch.device(args.device))
    original = loop._train_and_publish
    try:
        await parts.sync.publish(parts.trainer.published_weights(), version=0)
        probe.install(parts, loop)
        probe.peak()
        settings = LoopSettings(
            max_steps=args.warmup + args.steps, num_prompts_per_step=args.prompts, num_generations=args.generations,
            scale_rewards="group", drop_zero_variance_groups=False, seed=0, sleep_level=levers.get("sleep_level", 0),
            log_completions_steps=0, save_steps=0, save_total_limit=0,
        )  # fmt: skip
        with frozen_heap():  # as `tandem train` runs: a gc.collect() scans only what the run creates
            await run_loop(parts, settings)
    finally:
        loop._train_and_publish = original
        await parts.generator.close()
    rows, probes = parts.logger.rows[args.warmup :], probe.rows[args.warmup :]
    mean = lambda key: round(sum(r[key] for r in rows) / len(rows), 4)  # noqa: E731
    result = {"bench": "memory", "levers": name, "shape": args.shape, "steps": len(rows)}
    for key in sorted({k for p in probes for k in p}):
        result[key] = round(max(p.get(key, 0.0) for p in probes), 3)
    result.update(step_s=mean("step_time"), gen_s=mean("rollout/generate_s"), train_s=mean("time/train"), sync_s=mean("time/sync"))
    return result


def fraction(part: float, whole: float) -> str:
    return f"{part / whole:.2f}" if whole > 0.001 else "n/a (CPU: no allocator counts)"


def report(results: dict[str, dict]) -> None:
    for name in ("sleep1", "sleep2"):
        if name in results:
            r = results[name]
            freed = "KV cache" if name == "sleep1" else "KV cache and weights"
            kv = r["sleep_gb"]
            print(f"sleep {name[-1]} returns {fraction(r['sleep_returned_gb'], kv)} of the {freed} ({kv:.2f} GB) during training "
                  f"(freed {r['sleep_returned_gb']:.2f} GB" + ("; required >= 0.90)" if name == "sleep1" else ")"))  # fmt: skip
    for name, key in (("offload_optimizer", "optimizer"), ("offload_model", "model")):
        if name in results:
            r = results[name]
            size = r[f"{key}_gb"]
            print(f"offload returns {fraction(r[f'{key}_returned_gb'], size)} of the {key} state ({size:.2f} GB) during generation"
                  + (" (required >= 0.90)" if key == "optimizer" else ""))  # fmt: skip
    base = results.get("none")
    for name, r in results.items():
        if base is not None and name != "none":
            print(f"cost of {name}: step {r['step_s']:.3f} s vs {base['step_s']:.3f} s ({100 * (r['step_s'] / base['step_s'] - 1):+.0f}%); "
                  f"peak generation {r['gen_peak_gb']:.2f} GB (vs {base['gen_peak_gb']:.2f}), training {r['train_peak_gb']:.2f} GB "
                  f"(vs {base['train_peak_gb']:.2f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=[*SHAPES, "tiny"], default="1.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--levers", type=lambda s: s.split(","), default=list(LEVERS))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--completion_len", type=int, default=256)
    parser.add_argument("--max_tokens_per_microbatch", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    results = {}
    for name in args.levers:
        started = time.perf_counter()
        results[name] = asyncio.run(measure(args, name))
        results[name]["wall_s"] = round(time.perf_counter() - started, 1)
        print(json.dumps(results[name]), flush=True)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    report(results)


if __name__ == "__main__":
    main()
