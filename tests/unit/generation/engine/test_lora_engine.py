"""The engine serving a LoRA policy beside the trainer's own base (--lora_engine shared): the same tokens and
logprobs as an engine holding the merged weights, for every dense family; the base one copy (the trainer's
tensors are the engine's); weight updates move the adapters only; sleep level 2 keeps the shared base."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandemrl.generation.base import EngineConfig
from tandemrl.generation.engine import Engine
from tandemrl.train.config import LoraConfig
from tandemrl.train.lora import BaseView, MergedView, adapter_weights, apply_lora, frozen_base
from tandemrl.types import SamplingParams
from tests.unit.generation.engine.conftest import FAMILIES

pytest.importorskip("peft")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 17, 3, 2, 8, 11], [40, 41, 42], [7] * 12]  # the last runs past the families' window


def lora_policy(model_dir: str, targets: tuple[str, ...] = ("all-linear",)):
    """A float32 peft policy whose adapters are not zero (so it differs from its base)."""
    policy = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), LoraConfig(lora_r=4, lora_alpha=8, lora_target_modules=targets))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return policy


def engine_for(view, *, adapter_rank: int = 0) -> Engine:
    return Engine(EngineConfig(device="cpu", kv_cache_tokens=1024), model=view, adapter_rank=adapter_rank)


def shared_engine(policy) -> Engine:
    engine = engine_for(BaseView(policy), adapter_rank=4)
    engine.share_base(frozen_base(policy))
    asyncio.run(engine.update_weights(adapter_weights(policy), version=1))
    return engine


def generate(engine: Engine) -> list:
    async def go():
        return await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))

    return asyncio.run(go())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_adapters_beside_the_shared_base_equal_the_merged_weights(name, family_dirs):
    policy = lora_policy(family_dirs[name])
    merged, shared = engine_for(MergedView(policy)), shared_engine(policy)
    try:
        base_only = generate(engine_for(BaseView(policy)))
        expected, got = generate(merged), generate(shared)
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
        assert [c.token_ids for c in base_only] != [c.token_ids for c in expected]  # the adapters change the policy
        for a, b in zip(got, expected):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    finally:
        asyncio.run(merged.close())
        asyncio.run(shared.close())


def test_the_trainers_base_is_the_engines_and_updates_move_only_the_adapters(family_dirs):
    policy = lora_policy(family_dirs["qwen2"], targets=("q_proj", "v_proj", "down_proj"))  # k, o, gate, up: base only
    engine = shared_engine(policy)
    try:
        storages = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
        base = frozen_base(policy)
        assert base and all(t.untyped_storage().data_ptr() in storages for _, t in base)
        assert engine.unshared_base == set()
        names = [name for name, _ in adapter_weights(policy)]
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
        assert {n.split(".lora_")[0].rsplit(".", 1)[1] for n in names} == {"q_proj", "v_proj", "down_proj"}
        before = [c.token_ids for c in generate(engine)]
        # a training step changes the adapters: the engine follows from the update alone
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if ".lora_A." in n:
                    p.mul_(-1.0)
        asyncio.run(engine.update_weights(adapter_weights(policy), version=2))
        merged = engine_for(MergedView(policy))
        assert [c.token_ids for c in generate(engine)] == [c.token_ids for c in generate(merged)] != before
        asyncio.run(merged.close())
    finally:
        asyncio.run(engine.close())


def test_sleep_level_2_keeps_the_shared_base(family_dirs):
    policy = lora_policy(family_dirs["llama3-untied"])
    engine = shared_engine(policy)
    try:
        expected = [c.token_ids for c in generate(engine)]
        snapshot = {name: tensor.clone() for name, tensor in frozen_base(policy)}
        asyncio.run(engine.sleep(2))
        asyncio.run(engine.wake())
        assert all(torch.equal(tensor, snapshot[name]) for name, tensor in frozen_base(policy))  # the trainer's base survived
        assert not engine.awaiting_weights  # nothing of its own was dropped: the base is the trainer's, the adapters stay (small)
        assert [c.token_ids for c in generate(engine)] == expected
        asyncio.run(engine.update_weights(adapter_weights(policy), version=2))  # the loop's full refill after a level-2 wake
        assert [c.token_ids for c in generate(engine)] == expected
    finally:
        asyncio.run(engine.close())


def test_an_adapter_for_an_engine_without_adapters_is_one_line(family_dirs):
    policy = lora_policy(family_dirs["qwen2"])
    engine = engine_for(MergedView(policy))
    try:
        with pytest.raises(ValueError, match="is a LoRA adapter, and this engine holds none"):
            asyncio.run(engine.update_weights(adapter_weights(policy), version=1))
    finally:
        asyncio.run(engine.close())


def test_the_merged_checkpoint_saves_with_a_shared_base(family_dirs, tmp_path):
    """--lora_save_merged over views of the engine's fused qkv (k_proj not adapted: written as it is)."""
    from tandemrl.train.lora import save_merged

    policy = lora_policy(family_dirs["qwen2"], targets=("q_proj",))
    engine = shared_engine(policy)
    try:
        save_merged(policy, tmp_path / "merged")
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        merged = dict(MergedView(policy).state_dict())
        assert all(torch.equal(t, merged[n]) for n, t in reloaded.state_dict().items() if n in merged)
    finally:
        asyncio.run(engine.close())
