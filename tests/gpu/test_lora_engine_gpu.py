"""--lora_engine shared on the GPU: the engine's CUDA graphs read the adapters in place, so after an update
its decode equals an engine holding the merged weights (float32, to compare tokens exactly)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tandemrl.generation.base import EngineConfig
from tandemrl.generation.engine import Engine
from tandemrl.train.lora import BaseView, MergedView, adapter_weights, frozen_base
from tests.unit.generation.engine.test_lora_engine import GREEDY, PROMPTS, lora_policy

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tokens(engine: Engine) -> list[list[int]]:
    async def go():
        return await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))

    return [c.token_ids for c in asyncio.run(go())]


@cuda
def test_graph_decode_follows_adapter_updates(tmp_path):
    from tandemrl.tasks.tiny import save_tiny

    policy = lora_policy(save_tiny(str(tmp_path), seed=1)).to("cuda")
    config = EngineConfig(device="cuda", dtype="float32", kv_cache_tokens=1024, max_num_seqs=8)
    shared = Engine(config, model=BaseView(policy), adapter_rank=4)
    shared.share_base(frozen_base(policy))
    try:
        assert shared.unshared_base == set()
        for version in (1, 2):
            asyncio.run(shared.update_weights(adapter_weights(policy), version=version))
            merged = Engine(config, model=MergedView(policy))
            assert tokens(shared) == tokens(merged)
            asyncio.run(merged.close())
            with torch.no_grad():  # a "step": the adapters change; the captured graphs must see it
                for name, param in policy.named_parameters():
                    if ".lora_A." in name:
                        param.mul_(-1.5)
    finally:
        asyncio.run(shared.close())
