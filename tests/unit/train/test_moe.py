"""Routing replay and the router's load-balancing loss on a tiny random Qwen3-MoE, float32 on CPU: the
engine records routes, the trainer's transformers forward replays them."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from tandemrl.algo.presets import AlgoConfig
from tandemrl.generation.base import EngineConfig
from tandemrl.generation.engine import Engine
from tandemrl.tasks.tiny import build_model, build_tokenizer
from tandemrl.train.batching import pack
from tandemrl.train.config import TrainerConfig
from tandemrl.train.forward import packed_logprobs
from tandemrl.train.moe import packed_routes, prepare_forward, route_layout, routers_of
from tandemrl.train.trainer import Trainer
from tandemrl.types import Batch, Example, Group, Rollout, TokenTrace

TINY_MOE = dict(
    model_type="qwen3_moe", head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True,
)  # fmt: skip
PROMPTS = ([5, 6, 7, 8], [40, 41, 42], [100, 7, 9, 11, 13], [250, 3])


@pytest.fixture(scope="module")
def sampled():
    """(policy, traces): each prompt sampled by an engine recording routes, from the policy's weights."""
    from tandemrl.types import SamplingParams

    policy = build_model(build_tokenizer(), seed=2, **TINY_MOE)
    with torch.no_grad():
        for router in routers_of(policy):
            router.weight.mul_(25)  # decisive routes (init std 0.02 routes nearly uniformly)
    engine = Engine(EngineConfig(device="cpu", kv_cache_tokens=2048, routing_replay=True), model=policy, tokenizer=None)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=0, ignore_eos=True)

    async def sample():
        return await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))

    completions = asyncio.run(sample())
    asyncio.run(engine.close())
    traces = []
    for prompt, completion in zip(PROMPTS, completions):
        trace = TokenTrace()
        trace.append_context(list(prompt))
        trace.append_sampled(completion)
        traces.append(trace)
    return policy, traces


def chosen_experts(model, m, *, replay: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logprobs [T] of the trained targets, the experts each sparse layer's experts module got [N, k])."""
    seen = []
    handles = [layer.mlp.experts.register_forward_pre_hook(lambda _m, args: seen.append(args[1])) for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    prepare_forward(model, m.routes if replay else None)
    logprobs, _ = packed_logprobs(model, m.input_ids, m.position_ids, m.trained_index, m.target_ids, {}, temperature=1.0, chunk_size=64, with_entropy=False)
    for handle in handles:
        handle.remove()
    return logprobs, seen


def test_packed_routes_sit_at_the_position_that_sampled_each_token():
    trace = TokenTrace()
    trace.append_context([1, 2])
    from tandemrl.types import Completion

    routes = bytes([3, 4, 5, 6])  # two tokens, one layer, k 2
    trace.append_sampled(Completion(token_ids=[7, 8], logprobs=[0.0, 0.0], finish_reason="stop", policy_versions=[0, 0], routes=routes))
    import numpy as np

    from tandemrl.train.moe import RouteLayout

    table = packed_routes([trace, trace], np.array([0, 4]), 8, RouteLayout(num_layers=1, top_k=2, dtype=np.dtype(np.uint8)))
    assert table[:, 0].tolist() == [[-1, -1], [3, 4], [5, 6], [-1, -1]] * 2


def test_replayed_forward_gives_the_samplers_logprobs_and_experts(sampled):
    policy, traces = sampled
    m = pack(traces, [0.0] * len(traces), route_layout=route_layout(policy))
    with torch.no_grad():
        logprobs, seen = chosen_experts(policy, m, replay=True)
    torch.testing.assert_close(logprobs, m.behaviour_logprobs[m.trained_index], atol=1e-4, rtol=0)
    for layer, ids in enumerate(seen):
        recorded = m.routes[m.trained_index, layer]
        assert torch.equal(ids[m.trained_index], recorded)


def test_replay_makes_a_drifted_router_follow_the_recorded_routes_and_still_train(sampled):
    """The trainer's router drifted from the sampler's: alone it routes many sampled tokens elsewhere (and its
    logprobs move away); replayed, every sampled token goes to its recorded experts, the logprobs stay nearer
    the sampler's, and the router still gets a gradient through the chosen experts' probabilities."""
    policy, traces = sampled
    drifted = copy.deepcopy(policy)
    with torch.no_grad():
        for router in routers_of(drifted):
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(0)) * router.weight.std())
    m = pack(traces, [0.0] * len(traces), route_layout=route_layout(drifted))
    sampler = m.behaviour_logprobs[m.trained_index]
    free, free_ids = chosen_experts(drifted, m, replay=False)
    replayed, replayed_ids = chosen_experts(drifted, m, replay=True)
    recorded = m.routes[m.trained_index]  # [T, M, k]
    free_agree = torch.stack([ids[m.trained_index].sort(-1).values == recorded[:, layer].sort(-1).values for layer, ids in enumerate(free_ids)])
    assert free_agree.float().mean() < 0.8  # the drift changed many routes
    assert all(torch.equal(ids[m.trained_index], recorded[:, layer]) for layer, ids in enumerate(replayed_ids))
    assert (replayed - sampler).abs().mean() < (free - sampler).abs().mean()
    replayed.sum().backward()
    assert all(router.weight.grad.abs().sum() > 0 for router in routers_of(drifted))


def test_train_step_logs_the_aux_loss_and_adds_it_with_a_coefficient(sampled):
    policy, traces = sampled
    batch = Batch(groups=[Group(example=Example(prompt="p"), rollouts=[Rollout(example=Example(prompt="p"), trace=t) for t in traces], advantages=[1.0, -1.0, 0.5, -0.5])], policy_version=0)
    grads = {}
    for coef in (0.0, 1.0):
        model = copy.deepcopy(policy)
        trainer = Trainer(TrainerConfig(learning_rate=1e-3, router_aux_loss_coef=coef), AlgoConfig(), model, max_steps=1)
        metrics = trainer.train_step(batch)
        assert 0 < metrics["train/router_aux_loss"] < 10 and metrics["train/routing_replay_fraction"] == pytest.approx(1.0)
        grads[coef] = routers_of(model)[0].weight.grad.clone()
    assert not torch.allclose(grads[0.0], grads[1.0])
