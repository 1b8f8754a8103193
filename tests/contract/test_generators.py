"""One contract suite over every Generator backend: add a backend by adding a factory to BACKENDS.

Each factory takes the tiny model directory and returns a Generator (sync; awaitable cleanup via close).
The remote backend is a real `tandem rollout` process (engine inside) reached over HTTP, its weights
pushed over a gloo group. Weights reach every backend as the trainer sends them: through its WeightSync.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandemrl.generation.base import EngineConfig, Generator, HFConfig

from tandemrl.generation.factory import build_generator
from tandemrl.types import SamplingParams
from tandemrl.weights.base import DistributedSyncConfig, LocalSyncConfig
from tandemrl.weights.factory import build_weight_sync

BACKENDS = {
    "hf": lambda model_dir: build_generator(HFConfig(model=model_dir, device="cpu")),
    "engine": lambda model_dir: build_generator(EngineConfig(model=model_dir, device="cpu", kv_cache_tokens=2048)),
}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def rollout_server(tiny_model_dir):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration", "server"))
    from rollout_helpers import start_server

    server = start_server(tiny_model_dir, backend="engine")
    yield server
    server.stop()


def publish(generator: Generator, weights, version: int) -> None:
    """Publishes through the WeightSync the trainer would build for this generator."""
    from tandemrl.generation.remote import RemoteGenerator

    remote = isinstance(generator, RemoteGenerator)
    sync = build_weight_sync(DistributedSyncConfig(weight_sync_port=0, weight_sync_timeout_s=30) if remote else LocalSyncConfig(), generator)

    async def publish_and_close() -> None:
        await sync.publish(weights, version=version)
        await sync.close()

    run(publish_and_close())


def remote_generator(server, model_dir: str) -> Generator:
    """A client of the module's server, which first gets the original weights back at version 0."""
    from tandemrl.generation.base import RemoteConfig
    from tandemrl.generation.remote import RemoteGenerator

    gen = RemoteGenerator(RemoteConfig(urls=(server.url,), rollout_server_timeout=60))
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    publish(gen, original.named_parameters(), version=0)
    return gen


@pytest.fixture(params=[*BACKENDS, "remote"])
def generator(request, tiny_model_dir) -> Generator:
    if request.param == "remote":
        gen = remote_generator(request.getfixturevalue("rollout_server"), tiny_model_dir)
    else:
        gen = BACKENDS[request.param](tiny_model_dir)
    yield gen
    run(gen.close())


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_is_a_generator(generator):
    assert isinstance(generator, Generator) and generator.version == 0


def test_greedy_tokens_and_logprobs_match_a_transformers_forward(generator, reference):
    prompt = [5, 17, 42, 8, 99]
    completion = run(generator.generate(prompt, GREEDY))
    ids = list(prompt)
    with torch.no_grad():
        for token_id, logprob in zip(completion.token_ids, completion.logprobs):
            logits = reference(torch.tensor([ids])).logits[0, -1]
            assert token_id == int(logits.argmax())
            assert abs(logprob - float(logits.log_softmax(-1)[token_id])) < 1e-4
            ids.append(token_id)
    assert len(completion.token_ids) == 8 and completion.finish_reason == "length"
    assert completion.policy_versions == [0] * 8


def test_a_repetition_penalty_gives_transformers_greedy_tokens(generator, reference):
    """Every backend (a rollout server's route too) applies --repetition_penalty as transformers does."""
    prompt = [5, 17, 42, 8, 99]
    completion = run(generator.generate(prompt, dataclasses.replace(GREEDY, repetition_penalty=1.8)))
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, repetition_penalty=1.8)
    assert completion.token_ids == expected[0, len(prompt) :].tolist()


def test_top_logprobs_are_the_models_most_likely_tokens(generator, reference):
    prompt = [5, 17, 42, 8, 99]
    completion = run(generator.generate(prompt, dataclasses.replace(GREEDY, top_logprobs=3)))
    assert completion.top_logprobs is not None and len(completion.top_logprobs) == len(completion.token_ids)
    ids = list(prompt)
    with torch.no_grad():
        for token_id, top in zip(completion.token_ids, completion.top_logprobs):
            expected = reference(torch.tensor([ids])).logits[0, -1].log_softmax(-1).topk(3)
            assert list(top) == expected.indices.tolist() and next(iter(top)) == token_id
            assert max(abs(a - b) for a, b in zip(top.values(), expected.values.tolist())) < 1e-4
            ids.append(token_id)
    assert run(generator.generate(prompt, GREEDY)).top_logprobs is None


def test_a_filtered_tokens_logprob_is_the_reference_softmax_over_the_tokens_above_its_floor(generator, reference):
    """Every backend (a rollout server's wire too) reports each token's logit floor under top-k/top-p/min-p:
    its logprob renormalised over the tokens above the floor is the reported one, and none without a filter."""
    prompt = [5, 17, 42, 8, 99]
    params = SamplingParams(max_tokens=6, temperature=0.8, top_k=20, top_p=0.9, seed=3, ignore_eos=True)
    completion = run(generator.generate(prompt, params))
    assert completion.logit_floors is not None and len(completion.logit_floors) == len(completion.token_ids)
    ids = list(prompt)
    with torch.no_grad():
        for token_id, logprob, floor in zip(completion.token_ids, completion.logprobs, completion.logit_floors):
            tempered = reference(torch.tensor([ids])).logits[0, -1] / 0.8
            kept = tempered.masked_fill(tempered < floor, float("-inf"))
            assert tempered[token_id] >= floor and (kept > float("-inf")).sum() <= 20
            assert abs(logprob - float(kept.log_softmax(-1)[token_id])) < 1e-4
            ids.append(token_id)
    assert run(generator.generate(prompt, dataclasses.replace(params, top_k=-1, top_p=1.0))).logit_floors is None


def test_stop_token_ends_the_completion_with_it(generator):
    free = run(generator.generate([3, 4, 5], GREEDY))
    stop_id = free.token_ids[3]
    stopped = run(generator.generate([3, 4, 5], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_id,))))
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop_id
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]


def test_seeded_sampling_is_reproducible(generator):
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in (1234, 99)]

    async def both():
        return await asyncio.gather(*(generator.generate([7, 8], p) for p in params))

    first, again = run(both()), run(both())
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert all(lp <= 0 for c in first for lp in c.logprobs)


def test_published_weights_by_hf_names_change_output_and_version(generator, tiny_model_dir):
    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in new.parameters():
            param.mul_(-1.0)
    before = run(generator.generate([9, 10, 11], GREEDY))
    publish(generator, new.named_parameters(), version=5)
    after = run(generator.generate([9, 10, 11], GREEDY))
    assert generator.version == 5 and after.policy_versions == [5] * 8
    assert after.token_ids != before.token_ids


def test_sleep_and_wake_keep_serving(generator):
    before = run(generator.generate([1, 2, 3], GREEDY))
    run(generator.sleep(1))
    run(generator.wake())
    assert run(generator.generate([1, 2, 3], GREEDY)).token_ids == before.token_ids
