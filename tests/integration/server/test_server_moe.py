"""`tandem rollout --routing_replay` on a tiny Qwen3-MoE: each completion's routes cross the wire (base64 in
the native routes' results) and arrive as the in-process engine records them."""

from __future__ import annotations

import asyncio

import pytest
from rollout_helpers import start_server

from tandemrl.generation.base import EngineConfig, RemoteConfig

from tandemrl.generation.factory import build_generator
from tandemrl.types import SamplingParams

TINY_MOE = dict(
    model_type="qwen3_moe", head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    num_hidden_layers=3, mlp_only_layers=[1],
)  # fmt: skip


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tandemrl.tasks.tiny import save_tiny

    return save_tiny(str(tmp_path_factory.mktemp("qwen3_moe")), seed=1, **TINY_MOE)


def test_routes_cross_the_wire_as_the_engine_records_them(moe_dir):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [40, 41]]
    server = start_server(moe_dir, "--routing_replay", backend="engine")
    try:
        remote = build_generator(RemoteConfig(urls=(server.url,), rollout_server_timeout=60))
        local = build_generator(EngineConfig(model=moe_dir, device="cpu", kv_cache_tokens=1024, max_model_len=128, routing_replay=True))

        async def both():
            try:
                got = await asyncio.gather(*(remote.generate(p, params) for p in prompts))
                expected = await asyncio.gather(*(local.generate(p, params) for p in prompts))
                return got, expected
            finally:
                await remote.close()
                await local.close()

        got, expected = asyncio.run(both())
    finally:
        server.stop()
    for a, b in zip(got, expected):
        assert a.token_ids == b.token_ids and a.routes == b.routes and len(a.routes) == 6 * 2 * 2
