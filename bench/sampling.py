"""The sampler and the trainer agree under every sampling knob: train/logprob_mismatch_kl_lag0 per setting.

At policy lag 0 the trainer and the sampler hold the same weights, so the lag-0 KL between their logprobs
of the sampled tokens is numerics only, whatever the sampling settings (issue 34: --generation_kwargs'
temperature once reached the sampler alone, and under top-p/top-k/min-p the trainer scored the full
softmax). One process, one random-weight Qwen2.5-shaped policy, a colocated engine, the real loop and
trainer; each setting's SamplingParams and trainer temperature come from `TrainConfig.resolve()` as in
`tandem train`, run for --steps steps at --max_staleness 0. Prints one JSON line per setting, then

    ratio <setting>: kl_lag0 / kl_lag0(defaults) = X (<= 2: ok)

    python bench/sampling.py                                          # H200: 0.5B shape, 32 x 8, 128 new tokens, 4 steps
    python bench/sampling.py --device cpu --shape tiny --prompts 4 --generations 4 --completion_len 16 --steps 2   # CPU
    python bench/sampling.py --logit_scale 8 --settings defaults,temperature_0.7    # 0.5B: logits' std ~5 instead of ~0.6

A random model's next-token distributions are nearly flat (entropy near log V), where the same logit noise
divided by a temperature T gives a KL 1/T^2 times larger, whatever the plumbing. `--logit_scale S` multiplies
the final norm's weights by S (the logits by S) so the distributions are peaked as a trained model's are; each
line prints the trainer's mean entropy of the sampled tokens' distributions, so the two regimes are told apart.

`tokens_per_s` (sampled tokens / step time, the steps after the first) lets bench/ab.py compare step
time before and after on the same settings (it runs on trees from before the Plan too):

    python bench/ab.py --export 835d994 _ab/before
    python bench/ab.py --trees before=_ab/before/src,after=src --rounds 2 -- python bench/sampling.py --settings defaults,top_p_0.9
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step import Collect, LengthTokenizer  # noqa: E402
from sync import SHAPES, save_model  # noqa: E402

OLD_NAMES = {"sampling/sampling_logp_difference/mean": "train/logprob_mismatch", "rollout/generate_s": "time/generate"}
SETTINGS = {
    "defaults": [],
    "generation_kwargs_temperature_0.7": ["--generation_kwargs", '{"temperature": 0.7}'],
    "temperature_0.7": ["--temperature", "0.7"],
    "top_p_0.9": ["--top_p", "0.9"],
    "top_k_50": ["--top_k", "50"],
    "min_p_0.05": ["--min_p", "0.05"],
}


def build_parts(args, model_dir: str):
    from transformers import AutoModelForCausalLM

    from tandemrl.algo.presets import AlgoConfig
    from tandemrl.data.cursor import PromptCursor
    from tandemrl.generation.base import EngineConfig
    from tandemrl.rewards.base import RewardFunc
    from tandemrl.train.config import TrainerConfig
    from tandemrl.train.trainer import Trainer
    from tandemrl.types import Example, SamplingParams
    from tandemrl.weights.base import LocalSyncConfig

    try:  # this tree's homes; the fallbacks let bench/ab.py run the bench on a tree from before them
        from tandemrl.generation.factory import build_generator
        from tandemrl.pipeline.parts import LoopParts
        from tandemrl.weights.factory import build_weight_sync
    except ImportError:
        from tandemrl.generation.base import build_generator
        from tandemrl.pipeline.loop import LoopParts
        from tandemrl.weights.base import build_weight_sync

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device)
    with torch.no_grad():
        model.model.norm.weight.mul_(args.logit_scale)  # the logits x S (the head reads the final norm's output)
    algo = AlgoConfig(max_completion_length=args.completion_len, drop_zero_variance_groups=False)
    trainer = Trainer(TrainerConfig(device=args.device), algo, model, max_steps=1000)
    engine = EngineConfig(device=args.device, max_model_len=args.prompt_len + args.completion_len + 16,
                          max_num_seqs=args.prompts * args.generations, gpu_memory_utilization=0.3)  # fmt: skip
    generator = build_generator(engine, model=model, tokenizer=None)
    rng = random.Random(0)
    vocab = min(SHAPES[args.shape]["vocab_size"], 30000)
    num_examples = 4 * args.prompts
    prompt_ids = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(num_examples)]

    async def reward(prompts, completions, **columns):
        return [rng.random() for _ in completions]

    return LoopParts(
        examples=[Example(prompt="", index=i) for i in range(num_examples)], prompt_ids=prompt_ids,
        cursor=PromptCursor(num_examples), generator=generator, sync=build_weight_sync(LocalSyncConfig(), generator), trainer=trainer,
        tokenizer=LengthTokenizer(), reward_funcs=[RewardFunc(name="random", fn=reward)], reward_weights=None,
        params=SamplingParams(), logger=Collect(), progress=Collect(), run_dir=Path(tempfile.mkdtemp()),
    )  # fmt: skip


async def measure(parts, args) -> list[dict]:
    from tandemrl.cli.train import parse
    from tandemrl.pipeline import loop
    from tandemrl.pipeline.loop import LoopSettings, publish_policy, run_loop

    loop._should_save = lambda settings, step: False  # a benchmark writes no checkpoints
    await publish_policy(parts)
    results = []
    for name in args.settings:
        sampling = resolved_sampling(parse([*SETTINGS[name], "--max_completion_length", str(args.completion_len)])[0])
        parts.params = dataclasses.replace(sampling, ignore_eos=True)  # what the sampler draws from
        parts.trainer.temperature = sampling.temperature  # what the trainer scores under (cli/build.py's rule)
        if hasattr(sampling, "top_k_alone"):  # the trainer keeps its own top-k where top-k is the only filter (cli/build.py's _trainer)
            parts.trainer.top_k = sampling.top_k_alone
        start = parts.trainer.policy_version
        settings = LoopSettings(
            max_steps=start + args.steps, num_prompts_per_step=args.prompts, num_generations=args.generations, scale_rewards="group",
            drop_zero_variance_groups=False, seed=0, sleep_level=0, log_completions_steps=0, save_steps=0, save_total_limit=0,
        )  # fmt: skip
        parts.logger.rows.clear()
        await run_loop(parts, settings, start_step=start)
        rows = parts.logger.rows
        timed = rows[1:] or rows  # the first step of a setting compiles and warms up
        # a metric's name, or its name on a tree from before TRL's names (bench/ab.py's "before")
        value = lambda r, key: r[key] if key in r else r[OLD_NAMES[key]]  # noqa: E731
        mean = lambda key, rows=rows: sum(value(r, key) for r in rows) / len(rows)  # noqa: E731
        step_s = mean("step_time", timed)
        tokens = args.prompts * args.generations * args.completion_len
        result = {
            "bench": "sampling", "setting": name, "shape": args.shape, "model": args.shape, "workload": name, "steps": len(rows), "temperature": sampling.temperature,
            "top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": sampling.min_p,
            "kl_lag0": mean("train/logprob_mismatch_kl_lag0"), "kl_lag0_max": max(r["train/logprob_mismatch_kl_lag0"] for r in rows),
            "logprob_mismatch": mean("sampling/sampling_logp_difference/mean"), "step_s": round(step_s, 4), "gen_s": round(mean("rollout/generate_s", timed), 4),
            "train_s": round(mean("time/train", timed), 4), "tokens_per_s": round(tokens / step_s, 1),
            "logit_scale": args.logit_scale, "entropy": round(mean("entropy"), 4) if "entropy" in rows[0] else None,
        }  # fmt: skip
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


def resolved_sampling(config):
    """The run's SamplingParams as `tandem train` resolves them (a tree from before the Plan: cli/build's)."""
    if hasattr(config, "resolve"):
        return config.resolve().sampling
    from tandemrl.cli.build import _sampling

    return _sampling(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(SHAPES), default="0.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--settings", type=lambda s: s.split(","), default=list(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--completion_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--logit_scale", type=float, default=1.0, help="the logits x this (peaked distributions, as a trained model's; see the docstring)")
    args = parser.parse_args()
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(model_dir, SHAPES[args.shape], torch.float32)
        parts = build_parts(args, model_dir)

        async def go():
            try:
                return await measure(parts, args)
            finally:
                await parts.sync.close()
                await parts.generator.close()

        results = {r["setting"]: r for r in asyncio.run(go())}
    base = results.get("defaults")
    for name, r in results.items():
        if base is not None and name != "defaults":
            if base["kl_lag0"] <= 0:  # float32 on a CPU: both sides agree to rounding, the estimate sits at (or under) zero
                print(f"ratio {name}: n/a (the defaults' kl_lag0 is {base['kl_lag0']:.2e}: no numerics to compare)")
                continue
            ratio = r["kl_lag0"] / base["kl_lag0"]
            print(f"ratio {name}: kl_lag0 / kl_lag0(defaults) = {ratio:.2f} ({'ok' if ratio <= 2 else 'OVER 2x'}; "
                  f"{r['kl_lag0']:.2e} vs {base['kl_lag0']:.2e}), step {r['step_s']:.3f} s vs {base['step_s']:.3f} s")  # fmt: skip


if __name__ == "__main__":
    main()
