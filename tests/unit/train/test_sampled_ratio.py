"""At lag 0 the trainer scores each just-sampled token as the sampler drew it, under every sampling knob:
temperature (the flag or --generation_kwargs'), top-p, top-k and min-p. The engine reports each token's
logit floor (the lowest logit its filters kept), the trainer keeps the same tokens and renormalises, so
the importance ratio exp(trainer - sampler) is 1 within float32 tolerance (CPU, float32 both sides)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from tandemrl.cli.build import _policy
from tandemrl.cli.train import parse
from tandemrl.generation.factory import build_generator
from tandemrl.train.batching import pack
from tandemrl.train.trainer import Trainer
from tandemrl.types import TokenTrace

KNOBS = {
    "temperature": ["--temperature", "0.7"],
    "generation_kwargs temperature": ["--generation_kwargs", '{"temperature": 0.7}'],
    "top_p": ["--top_p", "0.9"],
    "top_k": ["--top_k", "50"],
    "min_p": ["--min_p", "0.05"],
    "all at once": ["--temperature", "0.8", "--top_p", "0.95", "--top_k", "40", "--min_p", "0.02"],
}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def sampled_and_scored(flags: list[str], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(sampler logprobs, trainer logprobs, trainer logprobs without the floors) [T] of the trained tokens,
    and whether the sampler filtered. Float32 on both sides (on a GPU too: the engine's CUDA path, the
    trainer without its bf16 twin)."""
    config, _ = parse([*flags, "--device", device, "--no-bf16", "--max_completion_length", "24", "--num_prompts_per_step", "2", "--num_generations", "2"])
    plan = config.resolve()
    tokenizer, model = _policy(config, None)
    generator = build_generator(dataclasses.replace(plan.generator, dtype="float32"), model=model, tokenizer=tokenizer)

    async def sample() -> list:
        return await asyncio.gather(*(generator.generate(p, plan.sampling.with_seed(seed)) for seed, p in enumerate(PROMPTS * 2)))

    try:
        completions = asyncio.run(sample())
    finally:
        asyncio.run(generator.close())
    traces = []
    for prompt, completion in zip(PROMPTS * 2, completions):
        trace = TokenTrace()
        trace.append_context(prompt)
        trace.append_sampled(completion)
        traces.append(trace)
    trainer = Trainer(config.trainer, config.algo, model, max_steps=1, temperature=plan.sampling.temperature)
    m = pack(traces, [0.0] * len(traces), model.device)
    with torch.no_grad():
        scored = trainer.plan.logprobs(model, m, temperature=trainer.temperature, chunk_size=16, with_entropy=False)[0]
        plain = trainer.plan.logprobs(model, dataclasses.replace(m, logit_floors=None), temperature=trainer.temperature, chunk_size=16, with_entropy=False)[0]
    return m.behaviour_logprobs[m.trained_index].cpu(), scored.cpu(), plain.cpu(), m.logit_floors is not None


@pytest.mark.parametrize("flags", KNOBS.values(), ids=KNOBS.keys())
def test_the_trainers_ratio_of_a_just_sampled_token_is_one(flags):
    sampler, trainer, untruncated, filtered = sampled_and_scored(flags)
    assert sampler.numel() > 50
    torch.testing.assert_close(torch.exp(trainer - sampler), torch.ones_like(sampler), rtol=0, atol=1e-5)
    if filtered:  # without the floors the trainer scores the whole vocabulary: the ratio is not 1
        assert (torch.exp(untruncated - sampler) - 1).abs().max() > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [KNOBS["top_p"], KNOBS["top_k"], KNOBS["min_p"], KNOBS["all at once"]], ids=["top_p", "top_k", "min_p", "all"])
def test_on_a_gpu_the_engines_floors_reach_the_trainer_through_its_graphs_and_pinned_copies(flags):
    """The CUDA engine (decode graphs, then the filtered rows resampled; floors copied through pinned memory)
    and the CUDA trainer (the Triton head where triton is), float32: the ratio is 1 as on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    sampler, trainer, untruncated, filtered = sampled_and_scored(flags, device="cuda")
    assert filtered
    torch.testing.assert_close(torch.exp(trainer - sampler), torch.ones_like(sampler), rtol=0, atol=1e-4)
    assert (torch.exp(untruncated - sampler) - 1).abs().max() > 1e-2
