"""Sleep level 2: the engine's weights are freed with no copy kept, and it generates again only once the
weight updates have refilled every one of them (then exactly as before)."""

from __future__ import annotations

import asyncio

import pytest

from tandemrl.generation.base import EngineConfig
from tandemrl.generation.engine import Engine
from tandemrl.generation.engine.models import weights_of
from tandemrl.types import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("family", ["qwen2", "llama3-untied", "phi3-longrope", "gemma3_text", "olmo2"])  # tied and untied heads; fused checkpoint names; norms of each kind
def test_level_2_frees_the_weights_and_generates_only_once_all_are_refilled(family_dirs, family):
    engine = Engine(EngineConfig(model=family_dirs[family], device="cpu", kv_cache_tokens=1024))
    weights = dict(weights_of(family_dirs[family]))
    names = sorted(weights)

    async def scenario():
        before = await engine.generate([7, 8, 9], GREEDY)
        await engine.sleep(2)
        assert engine.runner.kv_cache is None
        assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
        await engine.wake()
        held = asyncio.ensure_future(engine.generate([7, 8, 9], GREEDY))
        await engine.update_weights([(n, weights[n]) for n in names[:-1]], version=0)
        await asyncio.sleep(0.2)
        assert not held.done() and engine.weights.missing  # one weight still missing: nothing runs on zeros
        await engine.update_weights([(names[-1], weights[names[-1]])], version=0)
        assert (await held).token_ids == before.token_ids
        await engine.close()

    asyncio.run(scenario())


def test_close_frees_the_kv_cache(family_dirs):
    """A closed engine's KV cache and graphs are freed though its caller still holds it (a second engine in
    one process had found the first one's whole cache still in use: bench/engine.py's 7B at 8k, then 16k)."""
    engine = Engine(EngineConfig(model=family_dirs["qwen2"], device="cpu", kv_cache_tokens=1024))

    async def scenario():
        await engine.generate([7, 8, 9], GREEDY)
        assert engine.runner.kv_cache is not None
        await engine.close()

    asyncio.run(scenario())
    assert engine.runner.kv_cache is None
    assert all(layer.self_attn.k_cache.numel() == 0 for layer in engine.model.model.layers)
