"""Contract of every in-process WeightSync backend: after publish(v), the generator serves the new
weights at version v, and never a mix (the distributed backend has its own real-process suite in
tests/integration/)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch

from tandemrl.generation.base import HFConfig

from tandemrl.generation.factory import build_generator
from tandemrl.tasks.tiny import build_model, build_tokenizer
from tandemrl.types import SamplingParams
from tandemrl.weights.base import LocalSyncConfig
from tandemrl.weights.factory import build_weight_sync

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def backends():
    yield "hf", HFConfig(device="cpu")
    try:
        from tandemrl.generation.base import EngineConfig
        import tandemrl.generation.engine  # noqa: F401

        yield "engine", EngineConfig(device="cpu", kv_cache_tokens=4096, max_model_len=256)
    except ImportError:
        pass


@pytest.mark.parametrize("name, config", list(backends()), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("move_model_batches", [1, 3])
def test_publish_makes_new_weights_live_at_the_new_version(name, config, move_model_batches):
    tokenizer = build_tokenizer()
    served = build_model(tokenizer, seed=0)
    trained = build_model(tokenizer, seed=1)  # stands for the trainer's weights after a step
    generator = build_generator(config, model=served, tokenizer=tokenizer)
    sync = build_weight_sync(LocalSyncConfig(move_model_batches=move_model_batches), generator)
    prompt = tokenizer.encode("digits:")

    async def scenario():
        before = await generator.generate(prompt, GREEDY)
        await sync.publish(trained.named_parameters(), version=7)
        after = await generator.generate(prompt, GREEDY)
        return before, after

    before, after = asyncio.run(scenario())
    expected = trained.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    with torch.no_grad():
        logits = trained(torch.tensor([prompt + expected])).logits[0, len(prompt) - 1 : -1]
    expected_logprobs = logits.log_softmax(-1).gather(-1, torch.tensor(expected)[:, None])[:, 0]
    assert after.token_ids == expected
    torch.testing.assert_close(torch.tensor(after.logprobs), expected_logprobs, atol=1e-4, rtol=0)
    assert max(abs(a - b) for a, b in zip(before.logprobs, after.logprobs)) > 1e-3
    assert generator.version == 7 and set(after.policy_versions) == {7} and set(before.policy_versions) == {0}




def test_a_batched_publish_lets_no_step_run_on_half_updated_weights(monkeypatch):
    """--move_model_batches 3 while the engine generates (--max_staleness > 0 colocated): the batches land as
    one update (the old weights until the last, then the new), never a step on a mix of the two. Each batch was
    an update of its own: steps ran between them, on some tensors new and the rest old, tagged the old version."""
    from tandemrl.generation.base import EngineConfig

    tokenizer = build_tokenizer()
    served, trained = build_model(tokenizer, seed=0), build_model(tokenizer, seed=1)
    generator = build_generator(EngineConfig(device="cpu", kv_cache_tokens=4096), model=served, tokenizer=tokenizer)
    sync = build_weight_sync(LocalSyncConfig(move_model_batches=3), generator)
    decoded = []  # the engine's decode count as each tensor reaches its weights
    loaded = generator.residency.load

    def watched(weights):
        for item in weights:
            decoded.append(generator.stats()["engine/num_decode_tokens"])
            time.sleep(0.002)  # a tensor takes time to gather (FSDP's collective, a cast)
            yield item

    monkeypatch.setattr(generator.residency, "load", lambda weights: loaded(list(watched(weights)) if isinstance(weights, list) else watched(weights)))

    async def scenario():
        task = asyncio.create_task(generator.generate(tokenizer.encode("digits:"), SamplingParams(max_tokens=400, ignore_eos=True)))
        while generator.stats()["engine/num_decode_tokens"] < 5:
            await asyncio.sleep(0.001)
        await sync.publish(trained.named_parameters(), version=1)
        completion = await task
        await generator.close()
        return completion

    completion = asyncio.run(scenario())
    assert set(completion.policy_versions) == {0, 1}  # the update landed mid-generation
    assert len(decoded) == len(list(trained.parameters())) and len(set(decoded)) == 1, f"steps ran mid-update: decode counts {decoded}"
