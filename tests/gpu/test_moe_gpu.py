"""The fused mixture-of-experts kernel (layers/moe_kernel.py) against a loop over experts, under a CUDA
graph; the engine's Qwen3-MoE on the GPU (graphs, recorded routes) against its CPU path; the bf16 trainer
replaying the GPU engine's routes."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tandemrl.generation.base import EngineConfig
from tandemrl.generation.engine import Engine
from tandemrl.generation.engine.layers.moe import route
from tandemrl.types import SamplingParams

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def per_expert(x, gate_up, down, weights, ids):
    """transformers' eager Qwen3MoeExperts: one masked matmul pair per expert, in float32."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for expert in range(gate_up.shape[0]):
        token, slot = torch.where(ids == expert)
        gate, up = (x[token].float() @ gate_up[expert].float().T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ down[expert].float().T
        out.index_add_(0, token, y * weights[token, slot, None].float())
    return out


def random_moe(num_tokens: int, num_experts: int, top_k: int, hidden: int, width: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=g).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * width, hidden, device="cuda", generator=g) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, width, device="cuda", generator=g) / width**0.5).to(dtype)
    weights, ids = route(torch.randn(num_tokens, num_experts, device="cuda", generator=g).to(dtype), top_k, normalise=True)
    return x, gate_up, down, weights, ids


@cuda
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 512, 3000])
@pytest.mark.parametrize("shape", [(8, 2, 256, 128), (128, 8, 2048, 768)])  # experts, top-k, hidden, width (the second: Qwen3-30B-A3B's)
def test_fused_experts_equal_a_loop_over_experts(num_tokens, shape):
    from tandemrl.generation.engine.layers.moe_kernel import fused_experts

    x, gate_up, down, weights, ids = random_moe(num_tokens, *shape)
    expected = per_expert(x, gate_up, down, weights, ids)
    got = fused_experts(x, gate_up, down, weights, ids).float()
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max() + 1e-3


@cuda
def test_fused_experts_replay_in_a_cuda_graph_with_new_routes():
    """No host sync inside: captured once, replayed with other tokens and routes, it gives their result."""
    from tandemrl.generation.engine.layers.moe_kernel import fused_experts

    x, gate_up, down, weights, ids = random_moe(64, 16, 4, 256, 128)
    fused_experts(x, gate_up, down, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, gate_up, down, weights, ids)
    x2, _, _, weights2, ids2 = random_moe(64, 16, 4, 256, 128, seed=1)
    assert not torch.equal(ids, ids2)
    x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)
    graph.replay()
    torch.testing.assert_close(out.float(), fused_experts(x2, gate_up, down, weights2, ids2).float())


@cuda
def test_gpu_engine_with_graphs_matches_cpu_engine_tokens_and_routes(tmp_path):
    """float32 both: the GPU path (fused experts, CUDA-graph decode, routes read from the graph's buffer)
    gives the CPU path's tokens, and the same experts for nearly every token and layer."""
    from tandemrl.tasks.tiny import save_tiny

    model_dir = save_tiny(
        str(tmp_path), seed=1, model_type="qwen3_moe", head_dim=32, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=64, num_hidden_layers=3, mlp_only_layers=[1],
    )  # fmt: skip
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(9)]
    results = []
    for device in ("cpu", "cuda"):
        config = EngineConfig(model=model_dir, device=device, dtype="float32", routing_replay=True, gpu_memory_utilization=0.2, max_model_len=256)
        engine = Engine(config)

        async def generate_all(engine=engine):
            return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

        results.append(asyncio.run(generate_all()))
        asyncio.run(engine.close())
    matches = [(a, b) for a, b in zip(*results) if a.token_ids == b.token_ids]
    assert len(matches) >= len(prompts) - 1
    agree = sum(x == y for a, b in matches for x, y in zip(a.routes, b.routes)) / sum(len(a.routes) for a, _ in matches)
    assert agree >= 0.99 and all(len(b.routes) == 24 * 2 * 4 for _, b in matches)  # tokens x sparse layers x top-k, a byte each


@cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_trainer_replays_the_gpu_engines_routes(compiled):
    """The GPU trainer path (bf16 twin, packed attention, fused head, compiled layers or not) on an MoE policy
    with routes from the GPU engine: the step runs, replayed logprobs stay near the sampler's at lag 0."""
    from tandemrl.algo.presets import AlgoConfig
    from tandemrl.tasks.tiny import build_model, build_tokenizer
    from tandemrl.train.config import TrainerConfig
    from tandemrl.train.moe import routers_of
    from tandemrl.train.trainer import Trainer
    from tandemrl.types import Batch, Example, Group, Rollout, TokenTrace

    policy = build_model(
        build_tokenizer(), seed=2, model_type="qwen3_moe", head_dim=32, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=64, num_hidden_layers=3, mlp_only_layers=[1],
    ).cuda()  # fmt: skip
    with torch.no_grad():
        for router in routers_of(policy):
            router.weight.mul_(25)
    engine = Engine(EngineConfig(device="cuda", routing_replay=True, gpu_memory_utilization=0.2, max_model_len=256), model=policy, tokenizer=None)
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=0, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(8)]

    async def sample():
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    completions = asyncio.run(sample())
    asyncio.run(engine.close())
    rollouts = []
    for prompt, completion in zip(prompts, completions):
        trace = TokenTrace()
        trace.append_context(prompt)
        trace.append_sampled(completion)
        rollouts.append(Rollout(example=Example(prompt="p"), trace=trace))
    batch = Batch(groups=[Group(example=Example(prompt="p"), rollouts=rollouts, advantages=[1.0, -1.0] * 4)], policy_version=0)
    trainer = Trainer(TrainerConfig(torch_compile=compiled, router_aux_loss_coef=0.01), AlgoConfig(), policy, max_steps=1)
    metrics = trainer.train_step(batch)
    assert 0 < metrics["train/router_aux_loss"] < 10 and metrics["train/logprob_mismatch_kl_lag0"] < 0.05
