import asyncio

import torch

from tandemrl.generation.base import HFConfig

from tandemrl.generation.factory import build_generator
from tandemrl.types import SamplingParams


def test_hf_greedy_matches_manual_argmax_and_logprobs(tiny_model_dir):
    gen = build_generator(HFConfig(model=tiny_model_dir, device="cpu"))
    prompt = gen.tokenizer.encode("abc def")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    completion = asyncio.run(gen.generate(prompt, params))
    ids = list(prompt)
    with torch.no_grad():
        for token_id, logprob in zip(completion.token_ids, completion.logprobs):
            logits = gen.model(torch.tensor([ids])).logits[0, -1]
            assert token_id == int(logits.argmax())
            assert abs(logprob - float(logits.log_softmax(-1)[token_id])) < 1e-4
            ids.append(token_id)
    assert completion.finish_reason == "length" and completion.policy_versions == [0] * 6


def test_hf_concurrent_requests_equal_alone(tiny_model_dir):
    gen = build_generator(HFConfig(model=tiny_model_dir, device="cpu"))
    prompts = [gen.tokenizer.encode(t) for t in ("a", "hello there", "xyz 12")]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    async def together():
        return await asyncio.gather(*(gen.generate(p, params) for p in prompts))

    alone = [asyncio.run(gen.generate(p, params)).token_ids for p in prompts]
    assert [c.token_ids for c in asyncio.run(together())] == alone


def test_hf_applies_extra_generation_kwargs(tiny_model_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = build_generator(HFConfig(model=tiny_model_dir, device="cpu"))
    prompt = plain.tokenizer.encode("abc def")
    penalised = build_generator(HFConfig(model=tiny_model_dir, device="cpu", generation_kwargs={"no_repeat_ngram_size": 1}))
    ids = asyncio.run(penalised.generate(prompt, params)).token_ids
    assert len(set(ids)) == len(ids)  # no token repeats: the setting reached generate


def test_hf_ignore_eos_runs_past_a_sampled_eos_to_max_tokens(tiny_model_dir):
    gen = build_generator(HFConfig(model=tiny_model_dir, device="cpu"))
    eos = gen.tokenizer.eos_token_id
    with torch.no_grad():
        gen.model.lm_head.weight[eos] += 50.0  # EOS is now the greedy choice at every step
    prompt = gen.tokenizer.encode("the answer")
    stopped = asyncio.run(gen.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0)))
    assert stopped.token_ids == [eos] and stopped.finish_reason == "stop"
    ignored = asyncio.run(gen.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    assert ignored.token_ids == [eos] * 8 and ignored.finish_reason == "length"
