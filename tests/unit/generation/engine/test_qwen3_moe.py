"""The engine's mixture-of-experts models (Qwen3-MoE; OLMoE and Mixtral through the same class) against
transformers' in float32 on CPU: greedy tokens, logprobs, both weight namings (per-expert on disk, stacked
in memory and in updates), and the recorded routes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tandemrl.generation.base import EngineConfig
from tandemrl.generation.engine import Engine
from tandemrl.generation.engine.layers.moe import experts_reference, route
from tandemrl.types import SamplingParams

TINY_MOE = dict(
    model_type="qwen3_moe", head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True,
)  # fmt: skip
FAMILIES = {
    "qwen3_moe": TINY_MOE,
    "olmoe": dict(model_type="olmoe", num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False),
    "mixtral": dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
TEXTS = ("hello there", "the answer is 42", "abc", "x")


def run(coro):
    return asyncio.run(coro)


async def gather(engine, prompts, params):
    return await asyncio.gather(*(engine.generate(p, params) for p in prompts))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tandemrl.tasks.tiny import save_tiny

    return save_tiny(str(tmp_path_factory.mktemp("qwen3_moe")), seed=1, **TINY_MOE)


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe(request, moe_dir, tmp_path_factory):
    from tandemrl.tasks.tiny import save_tiny

    model_dir = moe_dir if request.param == "qwen3_moe" else save_tiny(str(tmp_path_factory.mktemp(request.param)), seed=1, **FAMILIES[request.param])
    engine = Engine(EngineConfig(model=model_dir, device="cpu", kv_cache_tokens=2048, routing_replay=True))
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield engine, reference
    run(engine.close())


def test_experts_reference_equals_a_loop_over_experts():
    torch.manual_seed(0)
    x, gate_up, down = torch.randn(7, 16), torch.randn(4, 2 * 8, 16), torch.randn(4, 16, 8)
    weights, ids = route(torch.randn(7, 4), 2, normalise=True)
    expected = torch.zeros_like(x)
    for n in range(7):
        for j in range(2):
            gate, up = (gate_up[ids[n, j]] @ x[n]).chunk(2)
            expected[n] += weights[n, j] * (down[ids[n, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(experts_reference(x, gate_up, down, weights, ids), expected)


def test_greedy_equals_transformers_generate_token_for_token(moe):
    engine, reference = moe
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    completions = run(gather(engine, prompts, GREEDY))
    for prompt, completion in zip(prompts, completions):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)
        assert completion.token_ids == expected[0, len(prompt) :].tolist()


def test_logprobs_and_routes_equal_a_transformers_forward(moe):
    """Each sampled token's logprob, and the experts of each sparse layer chosen for the token before it
    (the forward that sampled it), as transformers' router picks them."""
    engine, reference = moe
    prompt = engine.tokenizer.encode("the answer is")
    completion = run(engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.7, seed=3, ignore_eos=True)))
    chosen = []
    hooks = [block.gate.register_forward_hook(lambda _m, _a, out: chosen.append(out[2])) for block in _sparse_blocks(reference)]
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1 : -1]
    for hook in hooks:
        hook.remove()
    expected = (logits / 0.7).log_softmax(-1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)
    routes = np.frombuffer(completion.routes, dtype=np.uint8).reshape(len(completion.token_ids), len(chosen), 2)  # 8 experts, top-2
    for layer, ids in enumerate(chosen):  # [P + T, k] each
        assert np.array_equal(np.sort(routes[:, layer], axis=-1), np.sort(ids[len(prompt) - 1 : -1].numpy(), axis=-1))


def test_in_memory_model_and_stacked_updates_load_as_per_expert_files(moe_dir):
    """transformers 5 holds experts stacked ([X, 2I, E]): a colocated engine and a weight update take those names."""
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    engine = Engine(EngineConfig(device="cpu", kv_cache_tokens=2048), model=model, tokenizer=None)
    prompt = [5, 6, 7, 8]
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    run(engine.update_weights(list(model.named_parameters()), version=1))
    after = run(engine.generate(prompt, GREEDY))
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)[0, len(prompt) :]
    assert after.token_ids == expected.tolist() and after.routes is None  # routes only with routing_replay
    run(engine.close())


def _sparse_blocks(model) -> list:
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")]
